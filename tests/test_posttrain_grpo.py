"""GRPO math against numbers worked out by hand (see the comments), plus properties that must hold."""

import math
import os

import pytest
import torch
from trex_run import trex

from trex.posttrain.grpo_loss import group_advantages, k3_kl, policy_loss, token_entropy, token_weights

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_group_advantages_hand_computed():
    # group 1: rewards 1,0,0,0 -> mean 0.25; deviations .75,-.25,-.25,-.25;
    #   unbiased var = (.5625 + 3 * .0625) / 3 = .25 -> std .5 -> A = 1.5, -.5, -.5, -.5
    # group 2: all equal -> A = 0 (no learning signal, no division by zero)
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 2.0, 2.0, 2.0])
    adv = group_advantages(rewards, group_size=4, eps=0.0)
    assert adv.tolist() == pytest.approx([1.5, -0.5, -0.5, -0.5, 0.0, 0.0, 0.0, 0.0])
    assert group_advantages(rewards, 4, scale_by_std=False).tolist() == pytest.approx(
        [0.75, -0.25, -0.25, -0.25, 0, 0, 0, 0])
    # the eps keeps a zero-variance group finite with the division on
    assert torch.isfinite(group_advantages(torch.ones(4), 4)).all()


def test_group_advantages_bad_shapes():
    with pytest.raises(ValueError, match="groups of 3"):
        group_advantages(torch.zeros(4), 3)
    with pytest.raises(ValueError, match=">= 2"):
        group_advantages(torch.zeros(4), 1)


def _example():
    # two completions, two token slots; the second completion has one real token
    mask = torch.tensor([[1, 1], [1, 0]])
    ratio = torch.tensor([[1.5, 0.9], [0.5, 7.0]])  # 7.0 sits on padding and must not count
    old = torch.log(torch.tensor([[0.2, 0.3], [0.4, 0.1]]))
    logp = (old + ratio.log()).requires_grad_()
    adv = torch.tensor([2.0, -1.0])
    return mask, old, logp, adv


def test_clipped_loss_hand_computed():
    mask, old, logp, adv = _example()
    # eps 0.2 -> clip range [0.8, 1.2]; pg = -min(r A, clip(r) A):
    #   (0,0) r 1.5, A 2:  min(3.0, 2.4) = 2.4 -> -2.4   clipped (r > 1.2, A > 0)
    #   (0,1) r 0.9, A 2:  min(1.8, 1.8) = 1.8 -> -1.8   not clipped
    #   (1,0) r 0.5, A -1: min(-0.5, -0.8) = -0.8 -> 0.8 clipped (r < 0.8, A < 0)
    expected = {"token": (-2.4 - 1.8 + 0.8) / 3,           # 3 tokens
                "sequence": ((-2.4 - 1.8) / 2 + 0.8) / 2,  # mean per completion, then over completions
                "constant": (-2.4 - 1.8 + 0.8) / (2 * 2)}  # max_len 2 x 2 completions
    for agg, value in expected.items():
        w = token_weights(mask, agg, n_sequences=2, n_tokens=3, max_len=2)
        out = policy_loss(logp, old, adv, w, mask, eps_low=0.2, eps_high=0.2)
        assert out.loss.item() == pytest.approx(value, abs=1e-6), agg
        assert out.clipped.item() == 2
    # gradient (token aggregation): clipped tokens give none; the free one d(-r A)/dlogp / 3 = -2 * 0.9 / 3
    w = token_weights(mask, "token", 2, 3, 2)
    policy_loss(logp, old, adv, w, mask).loss.backward()
    assert logp.grad.flatten().tolist() == pytest.approx([0.0, -0.6, 0.0, 0.0], abs=1e-6)


def test_rollout_correction_hand_computed():
    """rho = pi_old / pi_rollout per token; token-level weights min(rho, C); sequence-level min(prod rho, C) on
    every token; masked IS drops tokens (completions, by the geometric mean) outside [low, high]."""
    import math

    from trex.posttrain.grpo_loss import rollout_correction

    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    rho = torch.tensor([[3.0, 0.5, 7.0], [1.5, 9.0, 9.0]])  # masked-off tokens must not count
    rollout = torch.log(torch.tensor([[0.2, 0.4, 0.1], [0.3, 0.1, 0.1]]))
    old = rollout + rho.log()
    w, keep = rollout_correction(old, rollout, mask, "token", 2.0, 0.0, math.inf)
    assert w.flatten().tolist() == pytest.approx([2.0, 0.5, 0.0, 1.5, 0.0, 0.0])
    assert keep.tolist() == mask.tolist()
    w, keep = rollout_correction(old, rollout, mask, "token", 2.0, 0.6, 2.5)  # 3.0 > 2.5 and 0.5 < 0.6 dropped
    assert keep.tolist() == [[False, False, False], [True, False, False]]
    w, keep = rollout_correction(old, rollout, mask, "sequence", 2.0, 0.0, math.inf)
    assert w.flatten().tolist() == pytest.approx([1.5, 1.5, 0.0, 1.5, 0.0, 0.0])  # 3 * 0.5 = 1.5; 1.5
    w, keep = rollout_correction(old, rollout, mask, "sequence", 1.2, 0.0, 1.3)
    # geometric means: sqrt(1.5) = 1.22 (kept), 1.5 (dropped); weights capped at 1.2
    assert w.flatten().tolist() == pytest.approx([1.2, 1.2, 0.0, 1.2, 0.0, 0.0])
    assert keep.tolist() == [[True, True, False], [False, False, False]]


def test_decoupled_weights_scale_each_tokens_surrogate():
    mask, old, logp, adv = _example()
    w = token_weights(mask, "token", 2, 3, 2)
    is_w = torch.tensor([[0.5, 2.0], [1.0, 0.0]])
    out = policy_loss(logp, old, adv, w, mask, eps_low=0.2, eps_high=0.2, is_weights=is_w)
    assert out.loss.item() == pytest.approx((0.5 * -2.4 + 2.0 * -1.8 + 0.8) / 3, abs=1e-6)


def test_asymmetric_clip():
    mask, old, logp, adv = _example()
    w = token_weights(mask, "token", 2, 3, 2)
    # eps_high 0.6: r = 1.5 is inside [0.8, 1.6] -> -3.0 instead of -2.4; eps_low unchanged
    out = policy_loss(logp, old, adv, w, mask, eps_low=0.2, eps_high=0.6)
    assert out.loss.item() == pytest.approx((-3.0 - 1.8 + 0.8) / 3, abs=1e-6)
    assert out.clipped.item() == 1


def test_on_policy_ratio_is_one_and_loss_is_minus_mean_advantage():
    logp = torch.log(torch.rand(4, 3)).requires_grad_()
    mask = torch.ones(4, 3)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    w = token_weights(mask, "sequence", 4, 12, 3)
    out = policy_loss(logp, logp.detach(), adv, w, mask)
    assert out.loss.item() == pytest.approx(-adv.mean().item(), abs=1e-6)
    assert out.clipped.item() == 0 and out.ratio_sum.item() == pytest.approx(12)


def test_k3_hand_computed_and_unbiased():
    # p = .5, ref = .25: e^d - d - 1 with d = ln(.5): .5 - ln .5 - 1 = 0.193147...
    assert k3_kl(torch.tensor(math.log(0.5)), torch.tensor(math.log(0.25))).item() == pytest.approx(
        0.5 + math.log(2) - 1, rel=1e-6)
    # its mean over samples of pi estimates KL(pi || ref)
    g = torch.Generator().manual_seed(0)
    pi = torch.tensor([0.6, 0.3, 0.1])
    ref = torch.tensor([0.2, 0.5, 0.3])
    x = torch.multinomial(pi, 200_000, replacement=True, generator=g)
    estimate = k3_kl(pi.log()[x], ref.log()[x]).mean().item()
    exact = (pi * (pi.log() - ref.log())).sum().item()
    assert estimate == pytest.approx(exact, rel=0.02)


def test_kl_term_adds_with_its_coefficient():
    mask, old, logp, adv = _example()
    ref = old - 0.3
    w = token_weights(mask, "token", 2, 3, 2)
    base = policy_loss(logp, old, adv, w, mask).loss
    with_kl = policy_loss(logp, old, adv, w, mask, ref_logp=ref, kl_coef=0.1)
    kl = k3_kl(logp, ref)
    expected_kl = (kl[0, 0] + kl[0, 1] + kl[1, 0]) / 3
    assert (with_kl.loss - base).item() == pytest.approx(0.1 * expected_kl.item(), abs=1e-6)
    assert with_kl.kl_sum.item() == pytest.approx(3 * expected_kl.item(), rel=1e-5)


@pytest.mark.parametrize("agg", ["token", "sequence", "constant"])
def test_micro_batch_split_gives_the_same_gradient(agg):
    torch.manual_seed(0)
    B, T = 6, 5
    mask = (torch.rand(B, T) < 0.7).float()
    mask[:, 0] = 1
    logp = torch.randn(B, T).requires_grad_()
    old = logp.detach() + 0.3 * torch.randn(B, T)
    adv = torch.randn(B)
    n_tok = int(mask.sum())
    whole = policy_loss(logp, old, adv, token_weights(mask, agg, B, n_tok, T), mask).loss
    (g_whole,) = torch.autograd.grad(whole, logp)
    parts = sum(policy_loss(logp[s], old[s], adv[s], token_weights(mask[s], agg, B, n_tok, T), mask[s]).loss
                for s in (slice(0, 2), slice(2, 6)))
    (g_parts,) = torch.autograd.grad(parts, logp)
    assert parts.item() == pytest.approx(whole.item(), abs=1e-6)
    torch.testing.assert_close(g_parts, g_whole)


def test_bad_aggregation():
    with pytest.raises(ValueError, match="token, sequence, constant"):
        token_weights(torch.ones(1, 1), "mean", 1, 1, 1)


def test_token_entropy():
    V = 16
    uniform = torch.zeros(3, 2, V)
    assert token_entropy(uniform, chunk=4).flatten().tolist() == pytest.approx([math.log(V)] * 6)
    logits = torch.randn(5, V)
    p = logits.softmax(-1)
    torch.testing.assert_close(token_entropy(logits, chunk=2), -(p * p.log()).sum(-1))


# ---- the grpo objective through the training loop ------------------------------------------------------
SMALL_MODEL = ('model.overrides={sliding_window=16, hidden_size=32, num_hidden_layers=2, '
               'layer_types=["sliding_attention","compressed_sparse_attention"], '
               'mlp_layer_types=["hash_moe","moe"], num_nextn_predict_layers=0}')


@pytest.fixture(scope="module")
def prompt_files(tmp_path_factory):
    from trex.data.arithmetic import ArithmeticTask, generate
    from trex.data.records import write_jsonl

    d = tmp_path_factory.mktemp("grpo")
    train_p, held = generate(ArithmeticTask(digits=1, n_train=24, n_eval=4))
    write_jsonl(d / "prompts.jsonl", [{"prompt": p.question, "answer": p.answer} for p in train_p])
    write_jsonl(d / "heldout.jsonl", [{"messages": [{"role": "user", "content": p.question}], "answer": p.answer}
                                      for p in held])
    # a user reward plug-in, named by module path in the recipe: 1 when the completion starts with a digit
    (d / "digit_reward.py").write_text("def first_digit(c):\n    return float(c.text[:1].isdigit())\n")
    return d


def _grpo_recipe(files, out, *extra):
    from trex.recipe import load
    from trex.train.config import TrainRecipe

    return load(TrainRecipe, overrides=[
        'train.mode="grpo"', 'data.tokenizer="compact"', "data.seq_len=32", f'train.out="{out}"',
        "train.progress=false", "fidelity.every=0", "optim.lr=1e-2", 'schedule.decay="constant"', SMALL_MODEL,
        f'grpo.prompts=["{files}/prompts.jsonl"]', f'grpo.eval_prompts=["{files}/heldout.jsonl"]',
        'grpo.rewards=["digit_reward:first_digit"]', "grpo.prompts_per_step=4", "grpo.group_size=8",
        "grpo.micro_batch_size=32", "sampling.max_new_tokens=2", *extra])


def _metrics(run_dir):
    import json

    return [json.loads(line) for line in open(run_dir / "metrics.jsonl")]


@pytest.mark.slow
def test_grpo_raises_the_reward_and_logs_rl_metrics(prompt_files, tmp_path, monkeypatch):
    from trex.train.loop import train

    monkeypatch.syspath_prepend(str(prompt_files))
    two_sets = f'grpo.eval_prompts=["{prompt_files}/heldout.jsonl", "{prompt_files}/prompts.jsonl"]'
    result = train(_grpo_recipe(prompt_files, tmp_path / "run", "train.steps=12", "train.eval_every=12", two_sets))
    rows = _metrics(tmp_path / "run")
    for key in ("reward_mean", "reward_std", "kl", "clip_frac", "response_length", "entropy", "logprob_diff",
                "reward/digit_reward:first_digit"):
        assert all(key in r for r in rows), key
    # one update per batch: ratio 1, so nothing is clipped; the trainer recomputes the sampler's log-probs
    assert all(r["clip_frac"] == 0 for r in rows)
    assert max(r["logprob_diff_max"] for r in rows) < 1e-3
    # trainer-vs-sampler parity: the same model in fp32, so in step to rounding
    assert min(r["rollout/pearson"] for r in rows) > 0.9999
    assert max(r["rollout/k3_kl"] for r in rows) < 1e-6
    assert all(0 <= r["rollout/prob_gap_mean"] <= r["rollout/prob_gap_max"] < 1e-3 for r in rows)
    first = sum(r["reward_mean"] for r in rows[:3]) / 3
    last = sum(r["reward_mean"] for r in rows[-3:]) / 3
    assert last > first + 0.2, (first, last)
    assert result.summary["warnings"] == [] and result.summary["data"]["steps_with_learning_signal"] > 0
    final = result.summary["eval"]["final"]  # over both files (4 + 24 prompts) and per file
    assert final["eval_exact_match"] == pytest.approx(
        (4 * final["eval_exact_match/heldout"] + 24 * final["eval_exact_match/prompts"]) / 28)


@pytest.mark.slow
def test_grpo_resume_mid_batch_reproduces_samples_and_losses(prompt_files, tmp_path, monkeypatch):
    """ppo_epochs 2 and a KL reference: resuming after step 3 (inside a sampled batch's two updates)
    gives step 4 the same samples, rewards, losses and the same final weights as an unbroken run."""
    from trex.train.loop import train

    monkeypatch.syspath_prepend(str(prompt_files))
    extra = ("train.steps=5", "grpo.ppo_epochs=2", "grpo.kl_coef=0.05", "checkpoint.save_every=3",
             "checkpoint.keep_last=0", "grpo.prompts_per_step=2", "grpo.group_size=4", "grpo.micro_batch_size=4")
    whole = train(_grpo_recipe(prompt_files, tmp_path / "a", *extra))
    resumed = train(_grpo_recipe(prompt_files, tmp_path / "b", *extra,
                                 f'checkpoint.resume="{tmp_path}/a/checkpoints/step_3"'))
    a, b = _metrics(tmp_path / "a"), _metrics(tmp_path / "b")
    assert [r["step"] for r in b] == [4, 5]
    assert a[3]["ppo_epoch"] == 1 and a[4]["ppo_epoch"] == 0  # step 4 reuses a batch, step 5 samples anew
    assert a[3]["kl"] > 0 and a[3]["clip_frac"] >= 0
    for ra, rb in zip(a[3:], b):
        for key in ("loss", "reward_mean", "reward_std", "kl", "clip_frac", "entropy", "response_length",
                    "logprob_diff", "grad_norm"):
            assert ra[key] == rb[key], (ra["step"], key)
    for (name, p), q in zip(whole.model.named_parameters(), resumed.model.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)


def test_a_run_in_which_no_step_had_a_learning_signal_ends_with_a_warning(prompt_files, tmp_path, monkeypatch,
                                                                         capsys):
    import json

    from trex.cli import main

    (tmp_path / "flat_reward.py").write_text("def constant(c):\n    return 1.0\n")  # equal in every group
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "recipe.toml").write_text("# everything set on the command line\n")
    sets = ['train.mode="grpo"', 'data.tokenizer="compact"', "data.seq_len=32", "train.progress=false",
            "fidelity.every=0", "train.steps=2", SMALL_MODEL, f'grpo.prompts=["{prompt_files}/prompts.jsonl"]',
            'grpo.rewards=["flat_reward:constant"]', "grpo.prompts_per_step=2", "grpo.group_size=2",
            "grpo.micro_batch_size=4", "sampling.max_new_tokens=2"]
    out = tmp_path / "run"
    assert main(["train", str(tmp_path / "recipe.toml"), "--out", str(out),
                 *[a for s in sets for a in ("--set", s)]]) == 0
    captured = capsys.readouterr()
    warned = [line for line in captured.err.splitlines() if "learning signal" in line]
    assert len(warned) == 1 and warned[0].startswith("trex: warning: grpo: no step had a learning signal: in all "
                                                     "2 steps every group of 2 completions got equal rewards"), warned
    assert "check the reward function (flat_reward:constant)" in warned[0] and "grpo.group_size" in warned[0]
    assert captured.out.startswith("completed: 2 steps")  # the run did complete, and said so after the warning
    summary = json.loads((out / "summary.json").read_text())
    assert summary["warnings"] == [warned[0].removeprefix("trex: warning: ")]
    assert summary["data"]["steps_with_learning_signal"] == 0


def test_prompt_file_errors_name_the_line(tmp_path):
    from trex.data.records import BadRecordError
    from trex.data.tokenizer import compact_tokenizer
    from trex.posttrain.on_policy import load_prompts

    bad = tmp_path / "p.jsonl"
    bad.write_text('{"prompt": "1+1", "answer": "2"}\n{"question": "2+2"}\n')
    with pytest.raises(BadRecordError, match=r"p.jsonl:2: bad record \(no_prompt\)"):
        load_prompts([str(bad)], compact_tokenizer(), thinking=False)
    bad.write_text('{"messages": [{"role": "system", "content": "be brief"}]}\n')
    with pytest.raises(BadRecordError, match="p.jsonl:1: .*end with a user"):
        load_prompts([str(bad)], compact_tokenizer(), thinking=False)


def test_sft_records_are_prompts_with_their_answer(tmp_path):
    from trex.data.chat import render_prompt
    from trex.data.tokenizer import compact_tokenizer
    from trex.posttrain.on_policy import load_prompts

    f = tmp_path / "sft.jsonl"
    f.write_text('{"messages": [{"role": "user", "content": "1+1"}, {"role": "assistant", "content": "2"}]}\n'
                 '{"prompt": "3+4", "answer": "7"}\n')
    tok = compact_tokenizer()
    a, b = load_prompts([str(f)], tok, thinking=False)
    assert a.record["answer"] == "2" and b.record["answer"] == "7"
    assert a.ids == tok.encode(render_prompt([{"role": "user", "content": "1+1"}], thinking=False)).tolist()
    assert tok.decode(b.ids).endswith("3+4<｜Assistant｜></think>")


def _two_process_args(prompt_files, out, nproc: int, layout: str) -> list[str]:
    """`trex train` arguments of the layout test on ``nproc`` processes (one process: the same for both layouts)."""
    data_ranks = nproc if layout.startswith("fsdp2") else 1
    # through the engine process, each rank its own: the same correction as in-process ("auto" would turn the
    # decoupled weights on, which amplify the sampler's rounding differences between layouts)
    engine = ['sampling.engine="server"', 'grpo.correction="none"'] if nproc > 1 and layout == "fsdp2-server" else []
    split = [f"parallel.dp_shard={data_ranks}"] + (
        [f"parallel.{layout[:2]}={nproc}"] if nproc > 1 and layout in ("cp2", "tp2") else [])
    sets = ['train.mode="grpo"', 'data.tokenizer="compact"', "data.seq_len=32", "train.progress=false",
            "fidelity.every=0", "optim.lr=1e-2", 'schedule.decay="constant"', "train.steps=4",
            SMALL_MODEL.replace("num_nextn_predict_layers=0", "num_nextn_predict_layers=1"),
            f'grpo.prompts=["{prompt_files}/prompts.jsonl"]', f'grpo.eval_prompts=["{prompt_files}/heldout.jsonl"]',
            'grpo.rewards=["digit_reward:first_digit"]', "grpo.prompts_per_step=4", "grpo.group_size=4",
            f"grpo.micro_batch_size={8 // data_ranks}", "grpo.ppo_epochs=2", "grpo.kl_coef=0.05",
            "sampling.max_new_tokens=2", *split, *engine]
    (prompt_files / "recipe.toml").write_text("# everything set on the command line\n")
    return ["train", str(prompt_files / "recipe.toml"), "--out", str(out), *[a for s in sets for a in ("--set", s)]]


def _reward_env(prompt_files) -> dict:
    """The environment of the layout test's runs: the reward plug-in on PYTHONPATH, one thread, the CPU."""
    path = os.pathsep.join([str(prompt_files), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "TREX_DEVICE": "cpu"}


@pytest.fixture(scope="module")
def one_process_grpo(prompt_files, tmp_path_factory):
    """The one-process run both layouts are compared with (its arguments do not depend on the layout)."""
    out = tmp_path_factory.mktemp("grpo_one") / "one"
    one = trex(_two_process_args(prompt_files, out, 1, "fsdp2"), env=_reward_env(prompt_files))
    assert one.returncode == 0, one.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def two_process_runs(prompt_files, tmp_path_factory):
    """The two-process runs, by layout, each started once (the server layout is compared with fsdp2's)."""
    from test_distributed import torchrun

    runs = {}

    def run(layout: str):
        if layout not in runs:
            out = tmp_path_factory.mktemp(f"grpo_{layout}") / "two"
            with pytest.MonkeyPatch.context() as mp:  # the reward plug-in on the ranks' path
                mp.setenv("PYTHONPATH", _reward_env(prompt_files)["PYTHONPATH"])
                two = torchrun(2, _two_process_args(prompt_files, out, 2, layout), timeout=400)
            assert two.returncode == 0, two.stderr[-3000:]
            runs[layout] = out
        return runs[layout]
    return run


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["fsdp2", "cp2", "tp2"])
def test_two_process_grpo_gives_the_samples_and_losses_of_one_process(prompt_files, one_process_grpo,
                                                                      two_process_runs, layout):
    """2-process FSDP (gloo) draws the same completions as one process (each row's draws depend on its
    place in the step, not its rank) and so logs the same rewards, losses, KL and gradient norms; so
    does context parallelism (both ranks sample the same rows, each trains on half of every rollout
    row, padded to a length that splits); so does tensor parallelism (tp = 2: both ranks sample the same rows
    through the split model, in-process, and the reference's log-probs come through the vocabulary-parallel
    ``head_nll``; the training forward's logits, which GRPO's loss reads whole, are gathered from each rank's
    vocabulary rows, and the gather's backward keeps each rank's columns: a reduce-scatter there once summed
    the group's identical gradients, grad_norm 2.24 against 1.29 at step 1; measured now: step 1 equal, loss, KL
    and grad_norm within 2e-5 relative through step 4). The model has an MTP block, which GRPO's loss ignores:
    under FSDP2 its balance-loss gradient once reached unsharded-then-freed weights (step 1 failed)."""
    a, b = _metrics(one_process_grpo), _metrics(two_process_runs(layout))
    assert len(a) == len(b) == 4
    assert any(r["reward_std"] > 0 for r in a) and any(r["kl"] > 0 for r in a)  # a learning signal, not zeros
    for x, y in zip(a, b):
        assert x["reward_mean"] == y["reward_mean"] and x["response_length"] == y["response_length"], x["step"]
        # the first update is judged at 1e-4; after it, lr 1e-2 amplifies the two layouts' fp32 reduction order
        # (~1e-7) about tenfold a step, and by how much depends on the CPU's BLAS kernels (step 4's KL: 4e-4 on
        # an AMD EPYC, within 1e-4 elsewhere), so later steps get the layout profile's 2e-3; a wrong split
        # (a gradient halved or doubled on one rank) moves them by tens of percent
        rel = 1e-4 if x["step"] <= 2 else 2e-3
        for key in ("loss", "kl", "entropy", "grad_norm"):
            assert x[key] == pytest.approx(y[key], rel=rel, abs=1e-6), (x["step"], key)


def test_row_uniforms_make_samples_independent_of_batch_and_rank():
    from trex.models import build_model
    from trex.models.deepseek_v4.config import tiny
    from trex.parallel.mesh import Parallel
    from trex.posttrain.on_policy import rank_uniforms
    from trex.rollout import SamplingParams, sample

    torch.manual_seed(0)
    model = build_model(tiny(sliding_window=16, hidden_size=32, num_hidden_layers=2,
                             layer_types=["sliding_attention", "compressed_sparse_attention"],
                             mlp_layer_types=["hash_moe", "moe"], num_nextn_predict_layers=0))
    prompts = [[1, 5 + i, 9, 7][: 2 + i % 3] for i in range(8)]
    params = SamplingParams(temperature=1.5, max_new_tokens=4)
    every = rank_uniforms(torch.Generator().manual_seed(3), 8, 4, Parallel(rank=0, world_size=1))
    whole = sample(model, prompts, params, pad_id=0, batch_size=8, uniforms=every)
    # two "ranks", each drawing from its own generator seeded alike and keeping its block, in smaller batches
    halves = [rank_uniforms(torch.Generator().manual_seed(3), 8, 4, Parallel(rank=r, world_size=2)) for r in (0, 1)]
    torch.testing.assert_close(torch.cat(halves), every, rtol=0, atol=0)
    split = [sample(model, prompts[4 * r:4 * r + 4], params, pad_id=0, batch_size=3, uniforms=halves[r])
             for r in (0, 1)]
    assert split[0].completion_ids + split[1].completion_ids == whole.completion_ids
    assert len({tuple(c) for c in whole.completion_ids}) > 1  # the draws differ between rows
    with pytest.raises(ValueError, match="uniforms of shape"):
        sample(model, prompts, params, pad_id=0, uniforms=every[:, :3])


def test_shipped_prompts_are_fresh_problems_of_the_default_task():
    import json
    import os

    from trex.data.arithmetic import fresh_problems, generate, prompt_records
    from trex.train.default_job import DefaultJob

    data = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes", "grpo_arithmetic_data")
    fresh = fresh_problems(DefaultJob().task, 4000, seed=1)
    for name, want in (("prompts", prompt_records(fresh[:3000])), ("heldout_fresh", prompt_records(fresh[3000:]))):
        assert [json.loads(line) for line in open(os.path.join(data, f"{name}.jsonl"))] == want
    train_p, held = generate(DefaultJob().task)
    assert not {p.question for p in fresh} & {p.question for p in train_p + held}


@pytest.mark.slow
def test_shipped_recipe_runs_on_a_shortened_schedule(tmp_path):
    """recipes/grpo_arithmetic.toml as shipped, on a random tiny model: 2 steps of 4 prompts x G = 8."""
    import os

    from trex.recipe import load
    from trex.train.config import TrainRecipe
    from trex.train.loop import train

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    data = os.path.join(root, "recipes", "grpo_arithmetic_data")
    recipe = load(TrainRecipe, os.path.join(root, "recipes", "grpo_arithmetic.toml"), [
        'model.path=""', SMALL_MODEL, "train.steps=2", "schedule.warmup_steps=1", "train.eval_every=0",
        f'train.out="{tmp_path}"', "train.progress=false", "grpo.prompts_per_step=4", "grpo.eval_limit=8",
        f'grpo.prompts=["{data}/prompts.jsonl"]', f'grpo.eval_prompts=["{data}/heldout_fresh.jsonl"]'])
    summary = train(recipe).summary
    assert summary["status"] == "completed" and summary["mode"] == "grpo" and summary["data"]["prompts"] == 3000
    assert 0 <= summary["eval"]["final"]["eval_exact_match"] <= 1


@pytest.mark.slow
def test_grpo_on_v41_under_fsdp2_ep2_and_cp2_gives_the_samples_and_losses_of_one_process(prompt_files, tmp_path,
                                                                                         monkeypatch):
    """GRPO on DeepSeek-V4.1 (tiny-v4.1: every layer kind, Engram, the candidate pool): rollouts sampled
    by re-running the prefix (V4.1 has no decode cache), on one process, on two ranks as FSDP2 + EP2 (the
    Engram tables split by rows) and as cp = 2 (both ranks sample whole rows, each trains on half):
    the same completions and rewards, and every step's loss, KL, entropy and gradient norm within 1e-5
    (3 Sinkhorn rounds in mHC, not 20: the same operations, a cheaper test).
    AdamW with eps 1e-8, not Muon: Muon's orthogonalisation gives a matrix whose gradient is at the level of
    the layouts' reduction-order differences (~1e-7) a full-size update, so with it cp = 2 left one process
    by 2.5e-3 at step 3 (measured; 4e-6 under AdamW); AdamW's first step at V4's eps of 1e-20 is the sign of
    the gradient, which does the same to elements whose gradient is rounding noise (DPO on V4.1: 2.3e-5
    at step 3 with it, 2.9e-6 with eps 1e-8)."""
    from test_distributed import torchrun

    def v41(args: list[str], ep: int) -> list[str]:
        return [('model.preset="tiny-v4.1"' if a.startswith("model.overrides=") else a) for a in args] + [
            "--set", "model.overrides={hc_sinkhorn_iters=3}", "--set", "train.steps=3", "--set", 'optim.name="adamw"',
            "--set", "optim.eps=1e-8", *(["--set", f"parallel.ep={ep}"] if ep > 1 else [])]

    env = _reward_env(prompt_files)
    monkeypatch.setenv("PYTHONPATH", env["PYTHONPATH"])
    one = trex(v41(_two_process_args(prompt_files, tmp_path / "one", 1, "fsdp2"), 1), env=env)
    assert one.returncode == 0, one.stderr[-3000:]
    a = _metrics(tmp_path / "one")
    assert len(a) == 3 and any(r["reward_std"] > 0 for r in a) and any(r["kl"] > 0 for r in a)
    for layout, ep in (("fsdp2", 2), ("cp2", 1)):
        two = torchrun(2, v41(_two_process_args(prompt_files, tmp_path / layout, 2, layout), ep), timeout=400)
        assert two.returncode == 0, (layout, two.stderr[-3000:])
        b = _metrics(tmp_path / layout)
        for x, y in zip(a, b):
            assert x["reward_mean"] == y["reward_mean"] and x["response_length"] == y["response_length"], layout
            for key in ("loss", "kl", "entropy", "grad_norm"):
                assert x[key] == pytest.approx(y[key], rel=1e-5, abs=1e-7), (layout, x["step"], key)


@pytest.mark.slow
def test_two_ranks_sampling_through_engine_processes_match_the_in_process_sampler(two_process_runs):
    """FSDP2 on two ranks, each sampling through an engine process of its own whose weights are synced from
    the shards before every batch: the same completions and, step by step, the losses, KL and gradient
    norms of the same two ranks sampling in-process, within 1e-6."""
    a, b = _metrics(two_process_runs("fsdp2")), _metrics(two_process_runs("fsdp2-server"))
    assert len(a) == len(b) == 4
    assert [r["engine/version"] for r in b] == [0.0, 0.0, 2.0, 2.0]  # a batch per two steps (ppo_epochs 2)
    for x, y in zip(a, b):
        assert x["reward_mean"] == y["reward_mean"] and x["response_length"] == y["response_length"], x["step"]
        for key in ("loss", "kl", "entropy", "grad_norm"):
            assert x[key] == pytest.approx(y[key], rel=1e-6, abs=1e-6), (x["step"], key)


# ---- multi-turn, tool-using rollouts ([environment]) --------------------------------------------------------
ENVIRONMENT = ('environment.name="tools"', 'environment.options={tools=["calculator"]}')


@pytest.mark.parametrize("routing", ["recompute", "replay"])
def test_grpo_on_multi_turn_trajectories_puts_no_loss_on_tool_tokens(prompt_files, tmp_path, monkeypatch, routing):
    """The recipe's environment through the in-process engine, each step's first turn forced to a calculator
    call (the tiny random model would never make one; its log-probs are the model's own), the rest sampled
    by the engine: the trainer's recompute of the whole trajectories matches the engine's log-probs on the
    model's tokens, and the loss's gradient with respect to the logits is exactly zero where the next token
    is a tool token. With routing replay, every token takes the experts of the call that first fed it."""
    from forced_calls import ForcedFirstTurn

    from trex.posttrain import grpo
    from trex.rollout.engine import InProcessEngine
    from trex.train.loop import train

    batches, seen = [], []
    collect, logprobs = grpo.GRPOObjective._collect, grpo.next_token_logprobs

    def spy(logits, ids, docs):
        logits.retain_grad()
        seen.append(logits)
        return logprobs(logits, ids, docs)
    def forced(section, model, dev, policy):
        return ForcedFirstTurn(InProcessEngine(model), model)

    def kept(self, *a):
        batches.append(collect(self, *a))
        return batches[-1]
    monkeypatch.setattr(grpo, "make_engine", forced)
    monkeypatch.setattr(grpo.GRPOObjective, "_collect", kept)
    monkeypatch.setattr(grpo, "next_token_logprobs", spy)
    (tmp_path / "turn_reward.py").write_text(  # differs within a group: a learning signal on every row
        "def last_turn(c):\n    return float(sum(c.trajectory.turn_ids[-1]) % 5)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    result = train(_grpo_recipe(prompt_files, tmp_path / "run", "train.steps=1", "grpo.eval_prompts=[]",
                                'grpo.rewards=["turn_reward:last_turn"]', "grpo.prompts_per_step=1",
                                "grpo.group_size=2", "sampling.max_new_tokens=140", "environment.max_tokens=180",
                                f'grpo.routing="{routing}"', *ENVIRONMENT))
    (row,) = _metrics(tmp_path / "run")
    assert row["env/turns"] == 2 and row["env/tool_calls"] == 1 and row["env/tool_errors"] == 0
    assert row["env/parse_errors"] == 0 and row["env/tool_seconds"] < 1 and row["env/answered"] <= 1
    assert result.summary["data"]["environment"] == "tools"
    assert row["logprob_diff_max"] < 1e-3  # the engine's tokens, in the engine's context, across turns
    (batch,), (logits,) = batches, seen
    r = batch.rollouts
    after_prompt = r.mask.cumsum(dim=1) > 0  # from the first sampled token on
    tool = after_prompt & ~r.mask & (r.doc_ids != 0)
    tool[:, -1] = False  # the last position has no next token
    assert tool.sum(dim=1).min() > 20  # every row holds a tool turn (the calculator's answer, as V4 renders it)
    assert r.versions[r.mask].eq(0).all() and r.versions[tool].eq(-1).all()  # step 0 sampled them
    grad = logits.grad.abs().sum(dim=-1)
    assert grad[tool].max() == 0 and (grad[r.mask] > 0).float().mean() > 0.5
    assert r.sampler_logp[tool].eq(0).all()
    if routing == "replay":  # every fed token has its experts; the last token of a row was fed by none
        routes = next(iter(r.routes.values()))
        fed = (r.doc_ids != 0).clone()
        fed[:, -1] = False
        assert (routes[fed] >= 0).all() and (routes[~fed] == -1).all()



def test_a_reused_multi_turn_batch_keeps_each_tokens_version_across_a_resume():
    import json

    from trex.posttrain.grpo import GroupBatch, _batch_from_state, _batch_state
    from trex.posttrain.on_policy import Rollouts

    mask = torch.tensor([[False, True, False, True, False]])
    r = Rollouts(torch.arange(5)[None], torch.ones(1, 5, dtype=torch.long), mask, torch.zeros(1, 5),
                 torch.ones(1).bool(), ["x"], versions=torch.tensor([[-1, 4, -1, 5, -1]]))
    b = GroupBatch(r, torch.ones(1), mask, None, torch.zeros(1, 5), None, None, {}, (1, 2))
    back = _batch_from_state(json.loads(json.dumps(_batch_state(b))), torch.device("cpu"))
    assert torch.equal(back.rollouts.versions, r.versions) and torch.equal(back.rollouts.mask, mask)
