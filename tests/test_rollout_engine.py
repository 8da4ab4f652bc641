"""The rollout engine boundary (trex.rollout.engine): the out-of-process stand-in against the in-process
sampler, weight sync (digest, completeness, versions), the parity gate, and the off-policy correction's
effect when the engine's policy is not the trainer's."""

from __future__ import annotations

import copy
import json
import threading

import pytest
import torch

from trex.models import build_model, get_preset
from trex.rollout.engine import InProcessEngine, ServerEngine, SyncError, check_parity, parity_probe, stream_weights
from trex.rollout.sampling import Samples, SamplingParams


@pytest.fixture(autouse=True)
def warm_engine_processes(monkeypatch):
    """Each engine process a child forked from a warm one (tests/trex_run.py: ~3.5 CPU seconds of imports spared
    a start)."""
    from trex_run import warm_python

    warm_python(monkeypatch)


@pytest.fixture(scope="module")
def tiny():
    return build_model(get_preset("tiny"), device="cpu", dtype=torch.float32, seed=0)


@pytest.fixture(scope="module")
def tiny_server(tiny):
    """An engine process of ``tiny``'s config (its weights come by each test's sync)."""
    engine = ServerEngine(tiny.cfg.to_hf_dict(), bucket_bytes=1 << 16)  # many buckets
    yield engine
    engine.close()


def test_the_server_engine_samples_what_the_in_process_sampler_samples(tiny, tiny_server):
    """After a sync the engine process holds the trainer's weights byte for byte: the same uniforms give the
    same tokens and log-probs, and the probe's k3 is 0; a sync of other weights moves the probe."""
    engine = tiny_server
    engine.sync(tiny, 3)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    params = SamplingParams(temperature=1.0, max_new_tokens=6, stop_ids=(1,))
    uniforms = torch.rand(2, 6, generator=torch.Generator().manual_seed(0))
    ours = InProcessEngine(tiny).generate(prompts, params, uniforms, 8)
    theirs = engine.generate(prompts, params, uniforms, 8)
    assert theirs.completion_ids == ours.completion_ids and theirs.logprobs == ours.logprobs
    assert parity_probe(engine, tiny, prompts).tolist() == [0.0, 0.0, 0.0] and engine.version == 3
    moved = copy.deepcopy(tiny)
    with torch.no_grad():
        moved.head.weight.mul_(1.5)
    with pytest.raises(SyncError, match=r"^step 7: rollout engine log-prob parity after weight sync v3: k3 .* > "
                                        r"bound 1e-06 \(max \|delta log p\| .*\)"):
        check_parity(parity_probe(engine, moved, prompts).tolist(), 1e-6, 7, engine.version)


class _Dropping(ServerEngine):
    """A sync that leaves out one tensor (a planted transport bug)."""

    def weights(self, model):
        return ([(n, t) for n, t in group if n != "layers.1.attn.wkv.weight"] for group in stream_weights(model))


def test_a_sync_missing_a_tensor_is_refused_naming_it(tiny):
    engine = _Dropping(tiny.cfg.to_hf_dict())
    try:
        with pytest.raises(SyncError, match=r"^weight sync v1: the rollout engine's model got no 1 tensor\(s\): "
                                            r"layers\.1\.attn\.wkv\.weight$"):
            engine.sync(tiny, 1)
        assert engine.version == -1
    finally:
        engine.close()


def test_a_deepseek_v3_syncs_under_its_released_hf_names(tmp_path):
    """The V3 family streams the names its released checkpoints (and vLLM) use, the routed experts one by
    one and MTP as layer n_layers: the engine process fills every tensor and serves the trainer's log-probs."""
    from trex.models.deepseek_v3.config import tiny_v3

    model = build_model(tiny_v3(), device="cpu", dtype=torch.float32, seed=0)
    names = [n for group in stream_weights(model) for n, _ in group]
    assert "model.layers.1.mlp.experts.7.up_proj.weight" in names and "lm_head.weight" in names
    assert any(n.startswith(f"model.layers.{model.cfg.num_hidden_layers}.") for n in names)  # MTP
    engine = ServerEngine(model.cfg.to_hf_dict(), bucket_bytes=1 << 16)
    try:
        engine.sync(model, 0)
        k3, worst, _ = parity_probe(engine, model, [[5, 6, 7, 8], [9, 10, 11]]).tolist()
        assert k3 == 0 and worst == 0
    finally:
        engine.close()


def test_the_weights_are_streamed_under_official_names_with_the_fp32_and_buffer_tensors(tiny):
    names = {n: t for group in stream_weights(tiny) for n, t in group}
    assert "layers.1.ffn.gate.bias" in names and "layers.0.hc_attn_fn" in names and "layers.0.attn.attn_sink" in names
    assert "layers.0.ffn.gate.tid2eid" in names  # the hash layer's table
    assert "layers.1.ffn.experts.3.w1.weight" in names and not any(n.endswith("experts.w1") for n in names)
    assert names["layers.0.hc_attn_fn"].dtype == torch.float32


# ---- through the training loop -----------------------------------------------------------------------------
def _files(tmp_path):
    from trex.data.arithmetic import ArithmeticTask, generate
    from trex.data.records import write_jsonl

    train_p, held = generate(ArithmeticTask(digits=1, n_train=24, n_eval=4))
    write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": p.question, "answer": p.answer} for p in train_p])
    (tmp_path / "digit_reward.py").write_text("def first_digit(c):\n    return float(c.text[:1].isdigit())\n")
    return tmp_path


def _recipe(files, out, *extra):
    from test_posttrain_grpo import _grpo_recipe

    return _grpo_recipe(files, out, 'grpo.eval_prompts=[]', "train.steps=3", *extra)


def _metrics(out):
    return [json.loads(line) for line in open(out / "metrics.jsonl")]


def test_grpo_through_the_server_engine_matches_the_in_process_sampler(tmp_path, monkeypatch):
    """One trainer process: the same seeds give the same completions (rewards, lengths) and the losses agree
    within 1e-6, both with the decoupled correction; the engine's weight version follows the steps and its
    parity probe reads 0 (the same fp32 code on the same weights)."""
    from trex.train.loop import train

    files = _files(tmp_path)
    monkeypatch.syspath_prepend(str(files))
    for engine in ("in_process", "server"):
        train(_recipe(files, tmp_path / engine, f'sampling.engine="{engine}"', 'grpo.correction="decoupled"'))
    a, b = _metrics(tmp_path / "in_process"), _metrics(tmp_path / "server")
    assert [r["engine/version"] for r in b] == [0.0, 1.0, 2.0] and all(r["engine/parity_k3"] == 0 for r in b)
    for x, y in zip(a, b):
        assert x["reward_mean"] == y["reward_mean"] and x["response_length"] == y["response_length"]
        for key in ("loss", "kl", "grad_norm", "rollout_corr/is_mean"):
            assert x[key] == pytest.approx(y[key], abs=1e-6), (x["step"], key)


def test_a_stale_engine_stops_the_run_at_the_gate_in_one_line(tmp_path, monkeypatch):
    """A planted stale sync: the engine gets the initial weights again at every sync, complete and with a
    matching digest; the parity probe after the first update stops the run at step 2, in one line."""
    from trex.train.loop import train

    files = _files(tmp_path)
    monkeypatch.syspath_prepend(str(files))
    first = {}

    def stale(self, model):
        if not first:
            first["groups"] = [[(n, t.clone()) for n, t in group] for group in stream_weights(model)]
        return iter(first["groups"])

    monkeypatch.setattr(ServerEngine, "weights", stale)
    with pytest.raises(SyncError) as e:
        train(_recipe(files, tmp_path / "run", 'sampling.engine="server"', "sampling.parity_bound=1e-9"))
    assert "\n" not in str(e.value)
    assert str(e.value).startswith("step 2: rollout engine log-prob parity after weight sync v1: k3 ")


def test_a_killed_engine_ends_the_run_in_one_line_that_summary_json_keeps(tmp_path, monkeypatch, capsys):
    """The engine's process killed (SIGKILL, as the out-of-memory killer sends) as step 2 asks it to sample:
    `trex train` stops at once with exit 4 and one line naming the engine, its pid and the signal, no
    traceback; summary.json says the run failed, why, and that it completed step 1; train.log keeps it."""
    import os
    import signal

    from trex.cli import main
    from trex.recipe import save

    monkeypatch.undo()  # the engine a process of its own: the SIGKILL must reach it, not a client of a forked one
    files = _files(tmp_path)
    monkeypatch.syspath_prepend(str(files))
    generate, pids = ServerEngine.generate, []

    def killed(self, *args, **kwargs):
        pids.append(self._proc.pid)
        if len(pids) == 2:
            os.kill(self._proc.pid, signal.SIGKILL)
        return generate(self, *args, **kwargs)

    monkeypatch.setattr(ServerEngine, "generate", killed)
    save(_recipe(files, tmp_path / "run", 'sampling.engine="server"'), str(tmp_path / "recipe.toml"))
    assert main(["train", str(tmp_path / "recipe.toml")]) == 4
    err = capsys.readouterr().err
    reason = f"rollout engine (server, pid {pids[0]}) died: killed by signal 9 (SIGKILL) during sampling at step 2"
    assert f"trex train: {reason}" in err.splitlines() and "Traceback" not in err
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert (summary["status"], summary["reason"], summary["steps_completed"]) == ("failed", reason, 1)
    assert reason in (tmp_path / "run" / "train.log").read_text()  # with the traceback, for whoever debugs it


def test_the_decoupled_correction_recovers_the_on_policy_gradient(tiny):
    """An engine whose policy is not the trainer's (its head perturbed: another precision or kernel in
    miniature) samples 65,536 one-token completions of a prompt with the sampler's own draw; the GRPO
    gradient from them, uncorrected, sits far from the on-policy gradient, and with the decoupled
    correction (token level, cap 2) about half as far. docs/post_training.md records the distances.

    The on-policy gradient is exact: for one-token completions the large-group limit of the GRPO
    gradient is sum over the vocabulary of pi(y) (r(y) - mu) / sigma * grad log pi(y) (mu = pi's mean
    reward, sigma its std). The trainer's own policy, sampled as many times with independent uniforms,
    gives the sampling noise at this size (its distance to the exact gradient), and the bounds hold with
    a margin of several times that noise. (The test once compared against the trainer's policy sampled
    with the same uniforms, which leant on the sampler's draw coupling the two sample sets; the draw
    inverts the CDF in vocabulary order now, which keeps no such coupling between different policies.)
    Measured: noise 0.05-0.07, uncorrected 1.18-1.23, decoupled 0.62-0.65 over five seeds; the
    estimators' exact limits are 1.21 and 0.64 (what stays with the correction is the cap's bias: the
    engine puts 11% of its mass on tokens with rho > 2; and its group std, 0.15 vs the trainer's 0.19)."""
    from trex.posttrain.grpo_loss import group_advantages, policy_loss, rollout_correction, token_weights
    from trex.rollout.sampling import choose_tokens

    model = copy.deepcopy(tiny)
    engine_model = copy.deepcopy(tiny)
    with torch.no_grad():
        engine_model.head.weight.add_(torch.randn(engine_model.head.weight.shape,
                                                  generator=torch.Generator().manual_seed(1)) * 0.2)
    prompt = torch.tensor([[5, 6, 7, 8]])
    n = 65536
    params = SamplingParams(temperature=1.0, max_new_tokens=1)

    def reward(tokens: torch.Tensor) -> torch.Tensor:
        return ((tokens >= 11) & (tokens < 21)).float()  # a verifiable reward: the token is one of ten

    def gradient(sampler: torch.nn.Module, correction: str, seed: int) -> torch.Tensor:
        with torch.no_grad():
            tokens, rollout_logp = choose_tokens(sampler(prompt).logits[:, -1].expand(n, -1), params,
                                                 torch.Generator().manual_seed(seed))
        rewards = reward(tokens)
        model.zero_grad()
        logp = torch.log_softmax(model(prompt).logits[0, -1].float(), -1)[tokens][:, None]  # [n, 1]
        mask = torch.ones_like(logp, dtype=torch.bool)
        weights, keep = rollout_correction(logp.detach(), rollout_logp[:, None], mask, "token", 2.0, 0.0, float("inf"))
        policy_loss(logp, logp.detach(), group_advantages(rewards, n), token_weights(mask, "token", n, n, 1), keep,
                    is_weights=weights if correction == "decoupled" else None).loss.backward()
        return model.head.weight.grad.flatten().clone()

    model.zero_grad()
    logp_all = torch.log_softmax(model(prompt).logits[0, -1].float(), -1)
    pi, r = logp_all.exp().detach(), reward(torch.arange(logp_all.numel()))
    mu = (pi * r).sum()
    (-(pi * (r - mu) / (mu * (1 - mu)).sqrt() * logp_all).sum()).backward()
    exact = model.head.weight.grad.flatten().clone()

    def distance(g: torch.Tensor) -> float:
        return ((g - exact).norm() / exact.norm()).item()

    noise = distance(gradient(model, "none", 2))
    far = distance(gradient(engine_model, "none", 3))
    near = distance(gradient(engine_model, "decoupled", 4))
    print(f"relative distance to the exact on-policy gradient: on-policy samples {noise:.3f}, "
          f"uncorrected {far:.3f}, decoupled {near:.3f}")
    assert noise < 0.15, noise  # the sampled GRPO gradient estimates the exact one
    assert far > 1.0 and near < 0.6 * far and far - near > 4 * noise, (noise, near, far)


# ---- routing replay (R3) -----------------------------------------------------------------------------------
def test_routing_replay_gives_the_trainer_the_samplers_routes_and_closes_the_parity_gap(tiny):
    """An engine whose routers differ from the trainer's (the gates perturbed) samples with its routes
    recorded, the server's as the in-process sampler's. The trainer's own routing picks other experts for
    some tokens; replayed, every fed token of every MoE layer (the hash layer included) takes the sampler's,
    and the trainer's log-probs of the sampled tokens come closer to the engine's (measured: 239 tokens
    routed apart, mean k3 to the engine 1.9e-4; replayed, none and 1.1e-6)."""
    engine_model = copy.deepcopy(tiny)
    with torch.no_grad():
        for name, p in engine_model.named_parameters():
            if name.endswith(".ffn.gate.weight"):
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(3)) * 0.05)
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13]] * 4
    params = SamplingParams(temperature=1.0, max_new_tokens=8)
    uniforms = torch.rand(len(prompts), 8, generator=torch.Generator().manual_seed(4))
    samples = InProcessEngine(engine_model).generate(prompts, params, uniforms, 8, record_routes=True)
    server = ServerEngine(tiny.cfg.to_hf_dict())
    try:
        server.sync(engine_model, 0)
        remote = server.generate(prompts, params, uniforms, 8, record_routes=True)
    finally:
        server.close()
    assert all(torch.equal(a[k], b[k]) for a, b in zip(samples.routes, remote.routes) for k in a)
    assert set(samples.routes[0]) == {f"layers.{i}" for i in range(len(tiny.layers))}  # layer 0 is hash-routed

    def trainer(replay: bool):
        changed, k3 = 0, []
        for prompt, completion, routes, logp in zip(prompts, samples.completion_ids, samples.routes, samples.logprobs):
            row = torch.tensor([prompt + completion])
            given = {k: torch.cat([v, torch.full_like(v[:1], -1)])[None] for k, v in routes.items()} if replay else None
            log = {}
            with torch.no_grad():
                out = tiny(row, routes=given, route_log=log)
            for k, v in routes.items():
                changed += (log[k][0, :-1].sort(-1).values != v.sort(-1).values).any(-1).sum().item()
            ours = torch.log_softmax(out.logits[0, len(prompt) - 1:-1].float(), -1).gather(
                -1, torch.tensor(completion)[:, None]).squeeze(-1)
            d = ours.double() - torch.tensor(logp, dtype=torch.float64)
            k3.append(torch.expm1(d) - d)
        return changed, torch.cat(k3).mean().item()

    changed_own, k3_own = trainer(replay=False)
    changed_replayed, k3_replayed = trainer(replay=True)
    print(f"tokens routed apart: {changed_own} own routing, {changed_replayed} replayed; "
          f"k3 to the engine: {k3_own:.2e} own, {k3_replayed:.2e} replayed")
    assert changed_own > 0 and changed_replayed == 0
    assert k3_replayed < k3_own


def test_grpo_with_routing_replay_trains_through_the_engine(tmp_path, monkeypatch):
    """`grpo.routing = "replay"` through the server engine: the routes cross the process boundary and the
    training forward takes them; the run matches one that recomputes them (the same weights route alike)."""
    from trex.train.loop import train

    files = _files(tmp_path)
    monkeypatch.syspath_prepend(str(files))
    train(_recipe(files, tmp_path / "replay", 'sampling.engine="server"', 'grpo.routing="replay"'))
    train(_recipe(files, tmp_path / "own", 'sampling.engine="server"'))
    a, b = _metrics(tmp_path / "replay"), _metrics(tmp_path / "own")
    for x, y in zip(a, b):
        assert x["reward_mean"] == y["reward_mean"]
        assert x["loss"] == pytest.approx(y["loss"], abs=1e-6) and x["grad_norm"] == pytest.approx(y["grad_norm"], rel=1e-5)


def test_distillation_through_the_server_engine_matches_the_in_process_sampler(tmp_path):
    """On-policy distillation samples through the engine process too (synced and gated every step): with
    the decoupled correction on both sides, its losses and KLs are the in-process run's within 1e-6."""
    from test_posttrain_distill import _two_teachers_task

    from trex.recipe import load
    from trex.train.config import TrainRecipe
    from trex.train.loop import train

    task = _two_teachers_task(tmp_path, steps=3)
    for engine in ("in_process", "server"):
        train(load(TrainRecipe, overrides=[*task, f'train.out="{tmp_path}/{engine}"', f'sampling.engine="{engine}"',
                                            'distill.correction="decoupled"', 'distill.eval_prompts=[]']))
    a, b = _metrics(tmp_path / "in_process"), _metrics(tmp_path / "server")
    assert [r["engine/version"] for r in b] == [0.0, 1.0, 2.0]
    for x, y in zip(a, b):
        for key in ("loss", "reverse_kl/teacher0", "grad_norm", "rollout_corr/is_mean", "response_length"):
            assert x[key] == pytest.approx(y[key], abs=1e-6), (x["step"], key)


def test_asynchronous_rollouts_are_one_step_off_policy(tmp_path, monkeypatch):
    """`sampling.asynchronous`: the engine generates step k + 1's batch while step k trains, so every batch
    after the first is one weight version behind (``engine/lag`` 1). At lr 0 the versions hold the same
    weights, so the run equals the synchronous one sample for sample and loss for loss; at lr 1e-2 the
    decoupled weights move off 1 (the lag's policy change is corrected)."""
    from trex.train.loop import train

    files = _files(tmp_path)
    monkeypatch.syspath_prepend(str(files))
    for name, extra in (("sync", []), ("async", ["sampling.asynchronous=true"])):
        train(_recipe(files, tmp_path / name, 'sampling.engine="server"', "optim.lr=0", *extra))
    a, b = _metrics(tmp_path / "sync"), _metrics(tmp_path / "async")
    assert [r["engine/lag"] for r in a] == [0.0, 0.0, 0.0] and [r["engine/lag"] for r in b] == [0.0, 1.0, 1.0]
    for x, y in zip(a, b):
        assert x["reward_mean"] == y["reward_mean"] and x["loss"] == pytest.approx(y["loss"], abs=1e-7)
    train(_recipe(files, tmp_path / "learning", 'sampling.engine="server"', "sampling.asynchronous=true"))
    rows = _metrics(tmp_path / "learning")
    assert rows[0]["rollout_corr/is_mean"] == pytest.approx(1.0, abs=1e-5)
    assert abs(rows[2]["rollout_corr/is_mean"] - 1.0) > 1e-4
    with pytest.raises(ValueError, match="asynchronous = true needs"):
        train(_recipe(files, tmp_path / "bad", "sampling.asynchronous=true"))
    with pytest.raises(ValueError, match="^sampling.asynchronous = true: on-policy distillation samples each"):
        train(_recipe(files, tmp_path / "distill", 'train.mode="distill"', 'sampling.engine="server"',
                      "sampling.asynchronous=true"))


class _Lagging:
    """A slowed engine: it takes only every ``every``-th weight sync, so the batches it samples come from
    weights up to ``every`` - 1 versions older than the ones it was asked to hold, as an engine that falls
    behind the trainer would. At lr 0 every version holds the same weights, so the parity gate passes."""

    def __init__(self, engine, every: int):
        self.engine, self.every = engine, every

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def sync(self, model, version):
        if version % self.every == 0:
            self.engine.sync(model, version)


def test_asynchronous_rollouts_never_train_a_sample_beyond_max_staleness(tmp_path, monkeypatch):
    """`sampling.max_staleness`: two batches are in flight while a step trains (as many as the bound allows,
    fewer near the end; a checkpoint's prompt position is the oldest one's, drawn again on resume); with an
    engine that lags (its batches 0, 1, 2 and 3 versions behind the step that trains them), no trained
    sample's first token is more than max_staleness = 2 versions old; the 3-stale batch carries no loss and
    is counted in the staleness histogram, `rollout/stale_dropped`, the summary and a warning."""
    from trex.posttrain import grpo
    from trex.train.loop import train

    files = _files(tmp_path)
    monkeypatch.syspath_prepend(str(files))
    make, collect, batches = grpo.make_engine, grpo.GRPOObjective._collect, []
    monkeypatch.setattr(grpo, "make_engine", lambda *a: _Lagging(make(*a), every=4))

    def kept(self, model, step):  # and where a resume would draw from: after the batches taken, not those in flight
        batches.append((step, collect(self, model, step), len(self.inflight)))
        assert self.state_dict()["order"]["pos"] == step + 1 < self.order.pos or not self.inflight
        return batches[-1][1]
    monkeypatch.setattr(grpo.GRPOObjective, "_collect", kept)
    result = train(_recipe(files, tmp_path / "run", 'sampling.engine="server"', "sampling.asynchronous=true",
                           "sampling.max_staleness=2", "optim.lr=0", "train.steps=4", "grpo.prompts_per_step=1",
                           "grpo.group_size=2"))
    assert [n for _, _, n in batches] == [2, 2, 1, 0]  # in flight after each step's batch was taken
    trained = {step: b.loss_mask.any(dim=1) for step, b, _ in batches}
    assert [b.rollouts.version for _, b, _ in batches] == [0, 0, 0, 0]  # sampled at v0: 0, 1, 2, 3 steps stale
    assert [int(t.sum()) for t in trained.values()] == [2, 2, 2, 0]
    assert all(step - b.rollouts.version <= 2 for step, b, _ in batches if trained[step].any())
    rows = _metrics(tmp_path / "run")
    hist = [[r[f"rollout/staleness_{k}"] for k in range(3)] + [r["rollout/stale_dropped"]] for r in rows]
    assert hist == [[2, 0, 0, 0], [0, 2, 0, 0], [0, 0, 2, 0], [0, 0, 0, 2]]
    assert [r["rollout/older_token_share"] for r in rows[:3]] == [0.0, 1.0, 1.0]
    assert rows[3]["response_length"] > 0 and rows[3]["loss"] == 0  # sampled, scored, never trained
    assert result.summary["data"]["stale_dropped"] == 2
    assert any("2 samples dropped untrained" in w for w in result.summary["warnings"])


def test_a_run_resumed_from_a_checkpoint_taken_with_batches_in_flight_draws_them_again(tmp_path, monkeypatch):
    """Asynchronous GRPO saved at step 2 while the batches of steps 3 and 4 are in flight (max_staleness 2), then
    resumed from that checkpoint: the resumed run draws those two batches again, from the checkpoint's prompt
    position and sampler generator, under the checkpoint's weights (both at version 2: 0 and 1 step stale), and
    trains them as the unbroken run did. At lr 0 every version holds the same weights, so the two runs give
    the same prompts, tokens, rewards and losses; no prompt is skipped or trained twice."""
    from trex.posttrain import grpo
    from trex.train.loop import train

    files = _files(tmp_path)
    monkeypatch.syspath_prepend(str(files))
    collect, taken = grpo.GRPOObjective._collect, []

    def record(self, model, step):
        batch = collect(self, model, step)
        taken.append((step, len(self.inflight), batch.rollouts))
        return batch
    monkeypatch.setattr(grpo.GRPOObjective, "_collect", record)
    extra = ('sampling.engine="server"', "sampling.asynchronous=true", "sampling.max_staleness=2", "optim.lr=0",
             "train.steps=4", "grpo.prompts_per_step=2", "grpo.group_size=2", "checkpoint.save_every=2",
             "checkpoint.keep_last=0")
    train(_recipe(files, tmp_path / "a", *extra))
    unbroken = taken[:]
    train(_recipe(files, tmp_path / "b", *extra, f'checkpoint.resume="{tmp_path}/a/checkpoints/step_2"'))
    resumed = taken[len(unbroken):]
    assert [(s, n) for s, n, _ in unbroken] == [(0, 2), (1, 2), (2, 1), (3, 0)]  # two in flight at the save
    assert [(s, n) for s, n, _ in resumed] == [(2, 1), (3, 0)]
    # the unbroken run sampled them in flight, at a version the rollout thread's timing decides (never above the
    # step's); the resumed one draws both before its first sync after the checkpoint's: at 2
    assert all(r.version <= step for step, _, r in unbroken) and [r.version for _, _, r in resumed] == [2, 2]
    for (_, _, x), (_, _, y) in zip(unbroken[2:], resumed):
        assert torch.equal(x.input_ids, y.input_ids) and x.texts == y.texts  # same prompts, same tokens
    a, b = _metrics(tmp_path / "a"), _metrics(tmp_path / "b")
    assert [r["step"] for r in b] == [3, 4]
    assert [[r[f"rollout/staleness_{k}"] for k in range(3)] for r in b] == [[4, 0, 0], [0, 4, 0]]
    for x, y in zip(a[2:], b):
        assert x["reward_mean"] == y["reward_mean"] and x["response_length"] == y["response_length"]
        assert x["loss"] == pytest.approx(y["loss"], abs=1e-7), x["step"]


class _RoundsAcrossSyncs:
    """A slowed engine for asynchronous multi-turn rollouts: every round is the forced calculator call
    (forced_calls, with the engine's own log-probs of it at its current weights). In the rollout thread, a
    trajectory's second round waits for the trainer's next weight sync, and that sync waits for the first
    round: every batch sampled in flight spans exactly one sync (first round at version k - 1, second at k)."""

    def __init__(self, engine):
        self.engine, self.calls, self.first, self.cond = engine, 0, -1, threading.Condition()

    @property
    def version(self):
        return self.engine.version

    def sync(self, model, version):  # batch k + 1's first round comes before sync k + 1 (batch 0: two calls)
        with self.cond:
            assert self.cond.wait_for(lambda: version == 0 or self.calls >= 2 * version + 1, timeout=120)
        self.engine.sync(model, version)
        with self.cond:
            self.cond.notify_all()

    def generate(self, prompts, params, uniforms, batch_size, record_routes=False):
        from forced_calls import CALCULATOR_CALL

        with self.cond:
            if self.calls % 2 == 0:
                self.first = self.engine.version
            elif threading.current_thread() is not threading.main_thread():  # in flight: after the next sync
                assert self.cond.wait_for(lambda: self.engine.version > self.first, timeout=120)
        n = len(CALCULATOR_CALL)
        logp = [lp[-n:] for lp in self.engine.score([p + CALCULATOR_CALL for p in prompts])]
        out = Samples(prompts, [CALCULATOR_CALL] * len(prompts), logp, [True] * len(prompts), None,
                      self.engine.version)
        with self.cond:
            self.calls += 1
            self.cond.notify_all()
        return out

    def score(self, rows):
        return self.engine.score(rows)

    def close(self):
        self.engine.close()


def test_a_multi_turn_trajectory_in_flight_across_a_sync_goes_on_under_the_new_weights(tmp_path, monkeypatch):
    """Asynchronous GRPO with an [environment]: each batch sampled while the previous step trained began
    under weights k - 1 and, after the trainer's sync, went on under weights k (a partial rollout). Each token
    keeps its own version, the sample counts one step stale (its first token's), and the decoupled correction
    weighs each token by its own engine log-prob: the tokens of the current weights get importance weight 1,
    those of the version before do not (the trainer moved at lr 1e-2)."""
    from trex.posttrain import grpo
    from trex.train.loop import train

    files = _files(tmp_path)
    (files / "counted_reward.py").write_text(  # rewards that differ within a group: the weights move each step
        "import itertools\n_n = itertools.count()\ndef counted(c):\n    return float(next(_n) % 3)\n")
    monkeypatch.syspath_prepend(str(files))
    make, collect, batches = grpo.make_engine, grpo.GRPOObjective._collect, []
    monkeypatch.setattr(grpo, "make_engine", lambda *a: _RoundsAcrossSyncs(make(*a)))

    def kept(self, model, step):
        batches.append(collect(self, model, step))
        return batches[-1]
    monkeypatch.setattr(grpo.GRPOObjective, "_collect", kept)
    train(_recipe(files, tmp_path / "run", 'sampling.engine="server"', "sampling.asynchronous=true",
                  'environment.name="tools"', 'environment.options={tools=["calculator"]}', "environment.max_turns=2",
                  "environment.max_tokens=320", "sampling.max_new_tokens=140", 'grpo.rewards=["counted_reward:counted"]',
                  "grpo.prompts_per_step=1", "grpo.group_size=2", "train.steps=2"))
    rows = _metrics(tmp_path / "run")
    assert len(batches) == len(rows) == 2
    for k, (b, row) in enumerate(zip(batches, rows)):
        r = b.rollouts
        versions = r.versions[r.mask]
        assert set(versions.tolist()) == ({0} if k == 0 else {k - 1, k}), k  # per round, across the sync
        assert row[f"rollout/staleness_{min(k, 1)}"] == 2 and row["rollout/stale_dropped"] == 0
        assert row["rollout/older_token_share"] == pytest.approx((versions < k).float().mean().item())
        assert b.loss_mask.any(dim=1).all()  # one step stale: within max_staleness = 1, trained
        if k:
            current, older = r.mask & (r.versions == k), r.mask & (r.versions == k - 1)
            assert row["rollout/older_token_share"] == pytest.approx(0.5)  # two calls of one length
            assert (b.is_weights[current] - 1).abs().max() < 1e-4, k
            assert (b.is_weights[older] - 1).abs().max() > 1e-3, k


def test_max_staleness_is_refused_in_one_line_below_one_or_without_asynchronous(tmp_path):
    from trex.posttrain.on_policy import SamplingSection

    with pytest.raises(ValueError, match=r"^sampling\.max_staleness must be >= 1 .*, got 0$"):
        SamplingSection(asynchronous=True, max_staleness=0)
    with pytest.raises(ValueError, match=r"^sampling\.max_staleness = 3 bounds asynchronous rollouts only"):
        SamplingSection(max_staleness=3)


def test_a_quantised_sync_serves_what_the_exported_checkpoint_serves(tiny, tmp_path):
    """`sync_quantize = "fp8+fp4experts"`: the sync sends FP8 linears and FP4 experts with their scales (the
    export's codec), the engine dequantises them, and its log-probs are those of the same model exported
    with that quantisation and loaded back; the parity probe against the unrounded trainer measures it."""
    from trex.checkpoint import load_pretrained, save_pretrained

    save_pretrained(tiny, str(tmp_path / "served"), layout="official", dtype="bf16", quantize="fp8+fp4experts")
    served = load_pretrained(str(tmp_path / "served"), dtype=torch.float32, device="cpu")
    groups = list(stream_weights(tiny, "fp8+fp4experts"))
    assert any(t.dtype == torch.float8_e4m3fn for g in groups for _, t in g)
    assert any(t.dtype == torch.int8 and n.endswith(".w1.weight") for g in groups for n, t in g)
    engine = ServerEngine(tiny.cfg.to_hf_dict(), quantize="fp8+fp4experts", bucket_bytes=1 << 14)
    try:
        engine.sync(tiny, 1)
        rows = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14]]
        assert parity_probe(engine, served, rows).tolist() == [0.0, 0.0, 0.0]
        k3, worst, _ = parity_probe(engine, tiny, rows).tolist()
        assert 0 < k3 < 1e-2 and worst > 0
    finally:
        engine.close()


# ---- the vLLM adapter, against a fake of vLLM's HTTP surface ----------------------------------------------
def test_grpo_through_the_vllm_adapter_against_a_fake_vllm(tmp_path, monkeypatch):
    """The adapter's protocol, against tests/fake_vllm.py (not vLLM: see its docstring): every step writes the
    synced weights under vllm_sync_dir, and pauses, reloads, versions and resumes the server in that order;
    completions come back with the sampled tokens' log-probs and, replayed, their routed experts; the parity
    gate reads the server's prompt log-probs (0 here: the fake serves the synced weights)."""
    from fake_vllm import FakeVLLM

    from trex import device as device_layer
    from trex.precision import PrecisionPolicy
    from trex.train.loop import model_for, tokenizer_for, train

    files = _files(tmp_path)
    monkeypatch.syspath_prepend(str(files))
    recipe = _recipe(files, tmp_path / "run", 'sampling.engine="vllm"', f'sampling.vllm_sync_dir="{tmp_path}/sync"',
                     'grpo.routing="replay"', "sampling.parity_bound=1e-9")
    dev = device_layer.detect("cpu")
    served = model_for(recipe, tokenizer_for("compact"), dev, PrecisionPolicy.resolve("fp32", dev))
    fake = FakeVLLM(served)
    try:
        recipe.sampling.vllm_url = fake.url
        train(recipe)
    finally:
        fake.close()
    sync = [p for p, _ in fake.calls if not p.startswith("v1/")]
    assert sync == ["collective_rpc"] + ["pause?mode=wait", "collective_rpc", "update_weight_version", "resume"] * 3
    assert fake.version == "2" and sorted(p.name for p in (tmp_path / "sync").iterdir()) == ["v0", "v1", "v2"]
    rows = _metrics(tmp_path / "run")
    assert [r["engine/version"] for r in rows] == [0.0, 1.0, 2.0] and all(r["engine/parity_k3"] == 0 for r in rows)
    completions = [b for p, b in fake.calls if p == "v1/completions" and "logprobs" in b]
    assert completions and all(b["logprobs"] == 0 and b["return_token_ids"] for b in completions)


@pytest.mark.parametrize("fault, how", [
    ("500", "it answered HTTP 500 (EngineCore encountered an issue. See stack trace (above) for the root cause.)"),
    ("drop", "its connection failed (RemoteDisconnected: Remote end closed connection without response)")])
def test_a_vllm_server_that_fails_mid_run_is_lost_in_one_line(tmp_path, monkeypatch, capsys, fault, how):
    """A vLLM that served step 1, then, as step 2 asks it to sample, answers HTTP 500 (its engine core died)
    or closes the connection unanswered: `trex train` exits 4 (a process of the job is gone, which a
    scheduler retries; not 2, bad input) with one line naming the engine, how it failed and the step, no
    traceback; summary.json says the run failed, why, after step 1. The URL was given as a bare HOST:PORT:
    the line names it as the requests used it, with http://."""
    from fake_vllm import FakeVLLM

    from trex import device as device_layer
    from trex.cli import main
    from trex.precision import PrecisionPolicy
    from trex.recipe import save
    from trex.rollout.vllm_engine import VLLMEngine
    from trex.train.loop import model_for, tokenizer_for

    files = _files(tmp_path)
    monkeypatch.syspath_prepend(str(files))
    recipe = _recipe(files, tmp_path / "run", 'sampling.engine="vllm"', f'sampling.vllm_sync_dir="{tmp_path}/sync"')
    dev = device_layer.detect("cpu")
    fake = FakeVLLM(model_for(recipe, tokenizer_for("compact"), dev, PrecisionPolicy.resolve("fp32", dev)),
                    return_routed_experts=False)
    generate, calls = VLLMEngine.generate, []

    def failing(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            fake.fault = fault
        return generate(self, *args, **kwargs)

    monkeypatch.setattr(VLLMEngine, "generate", failing)
    recipe.sampling.vllm_url = fake.url.removeprefix("http://")
    save(recipe, str(tmp_path / "recipe.toml"))
    try:
        code = main(["train", str(tmp_path / "recipe.toml")])
    finally:
        fake.close()
    err = capsys.readouterr().err
    reason = f"rollout engine (vLLM at {fake.url}) lost: {how} during sampling at step 2"
    assert code == 4 and f"trex train: {reason}" in err.splitlines() and "Traceback" not in err, err[-2000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert (summary["status"], summary["reason"], summary["steps_completed"]) == ("failed", reason, 1)
    assert f'vllm_url = "{fake.url}"' in (tmp_path / "run" / "config.toml").read_text()  # recorded as used


def test_a_vllm_url_without_its_scheme_is_taken_as_http_and_a_wrong_one_refused_naming_the_key():
    from trex.recipe import RecipeError, load
    from trex.train.config import TrainRecipe

    assert load(TrainRecipe, overrides=['sampling.vllm_url="127.0.0.1:8000"']).sampling.vllm_url == \
        "http://127.0.0.1:8000"
    assert load(TrainRecipe, overrides=['sampling.vllm_url="https://engine:8000/"']).sampling.vllm_url == \
        "https://engine:8000"
    for wrong in ("ftp://engine:8000", "engine:port", "http://"):
        with pytest.raises(RecipeError, match=rf"sampling\.vllm_url = '{wrong}': expected http://HOST:PORT \(or "
                                              rf"https://; a bare HOST:PORT is taken as http://\)$"):
            load(TrainRecipe, overrides=[f'sampling.vllm_url="{wrong}"'])


def test_the_vllm_adapter_refuses_a_server_without_trex_s_worker_extension(tiny):
    from fake_vllm import FakeVLLM

    from trex.rollout.vllm_engine import VLLMEngine

    fake = FakeVLLM(tiny, extension=False)
    try:
        with pytest.raises(SyncError, match=r"^vLLM at .* has no trex worker extension .*--worker-extension-cls "
                                            r"trex_vllm_worker\.TrexWorkerExtension"):
            VLLMEngine(fake.url, sync_dir="/tmp").check(tiny)
    finally:
        fake.close()


def test_the_vllm_adapter_reports_a_server_that_is_not_there_in_one_line():
    from trex.rollout.vllm_engine import VLLMEngine

    engine = VLLMEngine("http://127.0.0.1:9", sync_dir="/tmp")
    with pytest.raises(SyncError, match=r"^vLLM at http://127\.0\.0\.1:9 is not reachable .*VLLM_SERVER_DEV_MODE=1"):
        engine.score([[1, 2, 3]])
    with pytest.raises(ValueError, match="needs sampling.vllm_sync_dir"):
        VLLMEngine("http://127.0.0.1:9", transport="disk")


def test_a_multi_turn_trajectory_through_the_server_engine_is_the_in_process_ones(tiny, tiny_server):
    """Token-in, token-out through the engine process: with the same uniforms, the server engine's
    multi-turn trajectories (a forced calculator call, its answer, the engine's next turn) hold the
    in-process engine's ids, log-probs, loss mask, weight versions and routes."""
    from forced_calls import ForcedFirstTurn

    from trex.data.tokenizer import compact_tokenizer
    from trex.data.tool_calls import tool_codec
    from trex.rollout.environment import ToolsEnvironment
    from trex.rollout.multiturn import TurnLimits, roll_out_turns

    tok, codec, env = compact_tokenizer(), tool_codec("deepseek-v4", thinking=False), ToolsEnvironment(["calculator"])
    records = [{"prompt": "2+3?"}]
    params = SamplingParams(temperature=1.0, max_new_tokens=140, stop_ids=(tok.eos_id,))
    uniforms = torch.rand(1, 3, 140, generator=torch.Generator().manual_seed(0))
    runs = []
    for engine in (InProcessEngine(tiny), tiny_server):
        engine.sync(tiny, 5)
        runs.append(roll_out_turns(ForcedFirstTurn(engine, tiny), [env.reset(r) for r in records], records, codec,
                                   tok, params, TurnLimits(max_turns=3, max_tokens=180), uniforms, 8,
                                   record_routes=True))
    ours, theirs = runs
    for a, b in zip(ours, theirs):
        assert len(a.turns) >= 2 and a.results[0][0].content == "5"  # the forced call computes 2+3
        assert (a.ids, a.sampled, a.versions, a.stop) == (b.ids, b.sampled, b.versions, b.stop)
        assert not all(a.sampled) and set(a.versions) == {5, -1}
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
        assert a.routes.keys() == b.routes.keys() and all(torch.equal(a.routes[k], b.routes[k]) for k in a.routes)
