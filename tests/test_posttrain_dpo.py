"""DPO: the loss against hand-worked numbers, preference data and its bad records, training on a
tiny model, precomputed vs online reference, resume, 2-process FSDP, and the shipped recipe."""

from __future__ import annotations

import json
import math
import os
import shutil

import pytest
import torch
from trex_run import trex

from trex.data.arithmetic import ArithmeticTask, generate, preference_records
from trex.data.config import DataSection
from trex.data.preference import collate, read_pairs
from trex.data.records import BadRecordError, BadRecordPolicy, write_jsonl
from trex.data.tokenizer import compact_tokenizer
from trex.posttrain.dpo import dpo_loss
from trex.recipe import load
from trex.train.config import TrainRecipe
from trex.train.loop import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_dpo_loss_matches_hand_worked_numbers():
    # beta = 0.5. Pair 1: rewards 0.5*(-2+2.5) = 0.25 and 0.5*(-3+2.5) = -0.25, margin 0.5.
    # Pair 2: rewards 0.5*(-1-0) = -0.5 and 0.5*(-1+2) = 0.5, margin -1.
    # loss = -log sigmoid(m) = log(1 + e^-m): log(1 + e^-0.5) = 0.4740770, log(1 + e^1) = 1.3132617.
    # label smoothing 0.1: 0.9 * log(1 + e^-m) + 0.1 * log(1 + e^m)
    #   pair 1: 0.9 * 0.4740770 + 0.1 * 0.9740770 = 0.5240770; pair 2: 0.9 * 1.3132617 + 0.1 * 0.3132617 = 1.2132617
    args = [torch.tensor(v) for v in ([-2.0, -1.0], [-3.0, -1.0], [-2.5, 0.0], [-2.5, -2.0])]
    plain = dpo_loss(*args, beta=0.5)
    assert plain.chosen_rewards.tolist() == [0.25, -0.5] and plain.rejected_rewards.tolist() == [-0.25, 0.5]
    assert plain.losses.tolist() == pytest.approx([0.4740770, 1.3132617], abs=1e-6)
    smoothed = dpo_loss(*args, beta=0.5, label_smoothing=0.1)
    assert smoothed.losses.tolist() == pytest.approx([0.5240770, 1.2132617], abs=1e-6)
    assert math.isclose(plain.losses[0].item(), math.log(1 + math.exp(-0.5)), abs_tol=1e-6)
    # RPO, alpha 0.2, chosen responses of 4 and 2 tokens: + 0.2 * (2/4) = 0.1 and + 0.2 * (1/2) = 0.1
    rpo = dpo_loss(*args, beta=0.5, rpo_alpha=0.2, chosen_tokens=torch.tensor([4.0, 2.0]))
    assert rpo.losses.tolist() == pytest.approx([0.5740770, 1.4132617], abs=1e-6)
    assert rpo.chosen_rewards.tolist() == plain.chosen_rewards.tolist()


def _cfg(path, policy="skip", seq_len=32):
    return DataSection(paths=[str(path)], tokenizer="compact", seq_len=seq_len, bad_record_policy=policy)


def test_pairs_encode_both_forms_and_bad_records_follow_the_policy(tmp_path):
    tok = compact_tokenizer()
    path = tmp_path / "pairs.jsonl"
    write_jsonl(path, [
        {"prompt": "1+2", "chosen": "3", "rejected": "4"},
        {"prompt": "5+5", "chosen": "10"},  # line 2: no rejected
        {"messages": [{"role": "system", "content": "math"}, {"role": "user", "content": "2+2"}],
         "chosen": [{"role": "assistant", "content": "4"}], "rejected": "5"},
        {"prompt": "1+1", "chosen": "2", "rejected": "2"},  # line 4: nothing to prefer
    ])
    pairs = read_pairs(_cfg(path), tok, BadRecordPolicy("skip"))
    assert len(pairs) == 2
    summary = pairs.summary()
    assert summary["skipped_by_reason"] == {"identical_responses": 1, "missing_rejected": 1}
    assert summary["first_seen"]["missing_rejected"] == f"{path}:2"
    # the scored tokens are exactly the response: answer + EOS
    for k, response in ((0, "3"), (1, "4"), (2, "4"), (3, "5")):
        assert tok.decode(pairs.tokens[k][pairs.response[k]].tolist()) == response + "<｜end▁of▁sentence｜>"
    batch = collate(pairs, torch.tensor([1, 0]).numpy(), tok.pad_id, 32)
    assert batch.input_ids.shape == (4, 32) and batch.scored.sum().item() == 8
    assert torch.equal(batch.input_ids[0, :len(pairs.tokens[2])], torch.from_numpy(pairs.tokens[2]).long())
    with pytest.raises(BadRecordError, match=rf"{path}:2: bad record \(missing_rejected\)"):
        read_pairs(_cfg(path, "fail"), tok, BadRecordPolicy("fail"))
    sft = tmp_path / "sft.jsonl"  # SFT data given to DPO: the error says what a preference record is
    write_jsonl(sft, [{"messages": [{"role": "user", "content": "2+2"}, {"role": "assistant", "content": "4"}]}])
    with pytest.raises(BadRecordError, match=r"sft.jsonl:1: .*no 'chosen' or 'rejected' field.*SFT data\?"):
        read_pairs(_cfg(sft, "fail"), tok, BadRecordPolicy("fail"))


@pytest.fixture(scope="module")
def pair_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("dpo")
    train_p, held = generate(ArithmeticTask(digits=2, n_train=16, n_eval=16))
    write_jsonl(d / "train.jsonl", preference_records(train_p))
    write_jsonl(d / "held.jsonl", preference_records(held, seed=1))
    return d


def _recipe(d, out, *extra):
    return load(TrainRecipe, overrides=[
        'train.mode="dpo"', f'data.paths=["{d}/train.jsonl"]', 'data.tokenizer="compact"', "data.seq_len=24",
        "data.micro_batch_size=4", "train.grad_accum=2", "train.steps=6", f'train.out="{out}"', "optim.lr=3e-3",
        "train.progress=false", "fidelity.every=3", "dpo.beta=0.5", "dpo.label_smoothing=0.05",
        "model.overrides={sliding_window=16}",
        *extra])


def _metrics(out):
    return [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]


@pytest.mark.slow
def test_dpo_learns_its_pairs_and_online_reference_gives_the_same_losses(pair_files, tmp_path):
    constant = ('schedule.decay="constant"', "data.micro_batch_size=8", "train.grad_accum=1")
    pre = _metrics(train(_recipe(pair_files, tmp_path / "pre", "train.steps=12", *constant)).run_dir)
    assert pre[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)  # policy == reference: margin 0
    assert pre[0]["reward_margin"] == pytest.approx(0.0, abs=1e-5)
    late = pre[-4:]
    assert sum(r["loss"] for r in late) / 4 < pre[0]["loss"] - 0.1
    assert sum(r["accuracy"] for r in late) / 4 >= 0.9
    online = _metrics(train(_recipe(pair_files, tmp_path / "online", "train.steps=3", *constant,
                                    'dpo.reference="online"')).run_dir)
    for a, b in zip(online, pre[:3]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-6)
        assert a["reward_margin"] == pytest.approx(b["reward_margin"], rel=1e-4, abs=1e-6)


def test_dpo_trains_deepseek_v41(pair_files, tmp_path):
    """V4.1 through DPO: the policy starts as its reference (loss log 2, margin 0) and learns the pairs;
    the fidelity probes run on it every 3 steps."""
    rows = _metrics(train(_recipe(pair_files, tmp_path / "v41", 'model.preset="tiny-v4.1"', "train.steps=8",
                                  'schedule.decay="constant"', "data.micro_batch_size=8",
                                  "train.grad_accum=1")).run_dir)
    assert rows[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert rows[0]["reward_margin"] == pytest.approx(0.0, abs=1e-5)
    assert sum(r["loss"] for r in rows[-3:]) / 3 < rows[0]["loss"] - 0.05
    assert os.path.getsize(tmp_path / "v41" / "probe.jsonl") > 0


@pytest.mark.slow
def test_resume_mid_dpo_reproduces_the_losses(pair_files, tmp_path):
    extra = ("checkpoint.save_every=3", f'eval.paths=["{pair_files}/held.jsonl"]', "train.eval_every=3")
    straight = train(_recipe(pair_files, tmp_path / "a", *extra))
    assert {"eval_loss", "eval_accuracy", "eval_reward_margin"} <= straight.summary["eval"]["final"].keys()
    assert straight.summary["data"]["pairs"] == 16 and os.path.exists(tmp_path / "a" / "probe.jsonl")
    shutil.copytree(tmp_path / "a" / "checkpoints" / "step_3", tmp_path / "step_3")
    train(_recipe(pair_files, tmp_path / "b", *extra, f'checkpoint.resume="{tmp_path}/step_3"'))
    keys = ("loss", "grad_norm", "accuracy", "reward_margin", "eval_accuracy", "tokens")
    want = [{k: r.get(k) for k in keys} for r in _metrics(tmp_path / "a")[3:]]
    assert [{k: r.get(k) for k in keys} for r in _metrics(tmp_path / "b")] == want


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["fsdp2", "cp2"])
def test_two_process_fsdp_gives_the_losses_of_one_process(pair_files, tmp_path, layout):
    """2-process FSDP, or a context-parallel pair of ranks splitting every row (seq_len 32: a multiple
    of cp x 8 and of the window halo), logs the losses and rewards of one process."""
    seq, split = (24, ["parallel.dp_shard=2"]) if layout == "fsdp2" else (32, ["parallel.dp_shard=1", "parallel.cp=2"])

    def args(out, nproc):
        rows = 4 // nproc if layout == "fsdp2" else 4
        return ["train", str(pair_files / "recipe.toml"), "--out", str(out), "--set", 'train.mode="dpo"',
                "--set", f'data.paths=["{pair_files}/train.jsonl"]', "--set", 'data.tokenizer="compact"',
                "--set", f"data.seq_len={seq}", "--set", f"data.micro_batch_size={rows}", "--set", "train.steps=4",
                "--set", "optim.lr=3e-3", "--set", "train.progress=false", "--set", "dpo.beta=0.5",
                "--set", "fidelity.every=0", "--set", "model.overrides={sliding_window=16}",
                "--set", f'eval.paths=["{pair_files}/held.jsonl"]']
    (pair_files / "recipe.toml").write_text("# everything set on the command line\n")
    one = trex(args(tmp_path / "one", 1), env={"TREX_DEVICE": "cpu"})
    assert one.returncode == 0, one.stderr[-3000:]
    from test_distributed import torchrun

    two = torchrun(2, [*args(tmp_path / "two", 2), *[a for s in split for a in ("--set", s)]], timeout=400)
    assert two.returncode == 0, two.stderr[-3000:]
    a, b = _metrics(tmp_path / "one"), _metrics(tmp_path / "two")
    assert len(a) == len(b) == 4
    for x, y in zip(a, b):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-4)
        assert x["reward_margin"] == pytest.approx(y["reward_margin"], rel=1e-3, abs=1e-4)
    final = [json.loads((tmp_path / n / "summary.json").read_text())["eval"]["final"] for n in ("one", "two")]
    assert final[0]["eval_loss"] == pytest.approx(final[1]["eval_loss"], rel=1e-4)
    assert final[0]["eval_reward_margin"] == pytest.approx(final[1]["eval_reward_margin"], rel=1e-3, abs=1e-4)


def test_shipped_pairs_are_mistakes_on_fresh_problems():
    """recipes/dpo_arithmetic_data (make_pairs.py): each pair is a problem of its split, in order,
    with the exact answer chosen and a different number rejected (the SFT model's own mistake)."""
    from trex.data.arithmetic import fresh_problems
    from trex.train.default_job import DefaultJob

    task = DefaultJob().task
    fresh = fresh_problems(task, 4000, seed=1)
    data = os.path.join(ROOT, "recipes", "dpo_arithmetic_data")
    for name, problems in (("train", fresh[:3000]), ("heldout", fresh[3000:] + generate(task)[1])):
        pairs = [json.loads(line) for line in open(os.path.join(data, f"{name}.jsonl"))]
        answers = {p.question: p.answer for p in problems}
        order = [p.question for p in problems]
        assert len(pairs) > 50 and [order.index(p["prompt"]) for p in pairs] == sorted(
            order.index(p["prompt"]) for p in pairs)
        for pair in pairs:
            assert pair["chosen"] == answers[pair["prompt"]]
            assert pair["rejected"].isdigit() and pair["rejected"] != pair["chosen"]


@pytest.mark.slow
def test_shipped_recipe_runs_on_a_shortened_schedule(tmp_path):
    data = os.path.join(ROOT, "recipes", "dpo_arithmetic_data")
    recipe = load(TrainRecipe, os.path.join(ROOT, "recipes", "dpo_arithmetic.toml"), [
        'model.path=""', 'model.overrides={sliding_window=32}', "train.steps=2", "schedule.warmup_steps=1",
        "train.eval_every=0",
        f'train.out="{tmp_path}"', "train.progress=false",
        f"data.paths={json.dumps([os.path.join(data, 'train.jsonl')])}",
        f"eval.paths={json.dumps([os.path.join(data, 'heldout.jsonl')])}"])
    summary = train(recipe).summary
    n_pairs = sum(1 for _ in open(os.path.join(data, "train.jsonl")))
    assert summary["status"] == "completed" and summary["mode"] == "dpo" and summary["data"]["pairs"] == n_pairs
    assert 0 <= summary["eval"]["final"]["eval_preference_accuracy"] <= 1


@pytest.mark.slow
def test_dpo_on_v41_under_fsdp2_ep2_and_cp2_gives_the_losses_of_one_process(pair_files, tmp_path):
    """DPO on tiny-v4.1 (every layer kind, Engram, the candidate pool) on two ranks, as FSDP2 + EP2 (the
    policy's and the reference's Engram tables split by rows) and as cp = 2: every step's loss and gradient
    norm within 1e-5 of one process, the reward margin within 1e-5 (AdamW with eps 1e-8, for the reason the
    V4.1 GRPO layout test gives)."""
    from test_distributed import torchrun

    def args(out, rows, extra=()):
        sets = ['train.mode="dpo"', f'data.paths=["{pair_files}/train.jsonl"]', 'data.tokenizer="compact"',
                "data.seq_len=32", f"data.micro_batch_size={rows}", "train.steps=3", "optim.lr=3e-3",
                'optim.name="adamw"', "optim.eps=1e-8", "train.progress=false", "dpo.beta=0.5", "fidelity.every=0",
                'model.preset="tiny-v4.1"', *extra]
        return ["train", str(pair_files / "recipe.toml"), "--out", str(out), *[a for s in sets for a in ("--set", s)]]

    (pair_files / "recipe.toml").write_text("# everything set on the command line\n")
    one = trex(args(tmp_path / "one", 4), env={"TREX_DEVICE": "cpu"})
    assert one.returncode == 0, one.stderr[-3000:]
    a = _metrics(tmp_path / "one")
    assert len(a) == 3 and a[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    for name, rows, extra in (("fsdp2-ep2", 2, ["parallel.dp_shard=2", "parallel.ep=2"]),
                              ("cp2", 4, ["parallel.dp_shard=1", "parallel.cp=2"])):
        two = torchrun(2, args(tmp_path / name, rows, extra), timeout=400)
        assert two.returncode == 0, (name, two.stderr[-3000:])
        for x, y in zip(a, _metrics(tmp_path / name)):
            for key in ("loss", "grad_norm"):
                assert x[key] == pytest.approx(y[key], rel=1e-5, abs=1e-7), (name, x["step"], key)
            # a difference of log-ratios near 0 (0.02 at step 3): judged absolutely (measured up to 1.1e-6)
            assert x["reward_margin"] == pytest.approx(y["reward_margin"], abs=1e-5), (name, x["step"])
