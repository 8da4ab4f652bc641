"""Context parallelism: a sequence split over cp ranks computes what one process computes.

The arithmetic (layouts grouped by shard and their canonical order, the split check) is tested in one process;
the collectives with torchrun on gloo: one SFT step of the tiny model (every layer type, hash and
score-routed MoE, MTP, packed documents crossing shard boundaries) at cp = 2 and 4 and at FSDP2 +
EP + cp, against one process; and 10 steps of `trex train` at cp = 2 against one process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import context_parallel_worker as worker
from trex_run import trex
from trex.models.deepseek_v4.config import check_shardable, tiny
from trex.models.deepseek_v4.context import SeqContext
from trex.parallel.mesh import ParallelSection, resolve_layout
from test_distributed import _free_port

HERE = os.path.dirname(os.path.abspath(__file__))


# ---- one process: the arithmetic ------------------------------------------------------------------------
class _Shard:
    """A SequenceShard for layout arithmetic only (no collectives are called)."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size


def test_layout_grouped_by_shard_shows_each_query_the_same_windows():
    batch = worker.global_batch()
    cfg = tiny()
    whole = SeqContext(cfg, batch.input_ids, batch.doc_ids)
    for size in (2, 4):
        sharded = SeqContext(cfg, batch.input_ids, batch.doc_ids, shard=_Shard(0, size))
        for m in (4, 8):
            a, b = whole.layout(m), sharded.layout(m)
            assert b.n == a.n and b.per_shard * size == b.n
            seen_a = a.visible(0, worker.SEQ)[..., None] & a.valid[:, None, :, None]
            # the same window starts seen by every query, wherever the layout keeps them
            starts_a = torch.where(a.visible(0, worker.SEQ), a.starts[:, None, :], -1).sort(-1).values
            starts_b = torch.where(b.visible(0, worker.SEQ), b.starts[:, None, :], -1).sort(-1).values
            assert torch.equal(starts_a, starts_b), (size, m)
            assert seen_a.any()  # the batch has windows to see
            # each shard's entries are the windows that start in it
            L = worker.SEQ // size
            owner = torch.where(b.valid, b.starts // L, -1)
            expected = torch.arange(size).repeat_interleave(b.per_shard).expand_as(owner)
            assert torch.equal(owner[b.valid], expected[b.valid])


def test_split_check_names_lengths_that_work():
    cfg = tiny()  # window 8 (halo 7), compression rates 4 and 8
    check_shardable(cfg, 64, 4)
    check_shardable(cfg, 1000, 1)
    with pytest.raises(ValueError, match=r"multiple of 16 .* 48 or 64 would work"):
        check_shardable(cfg, 50, 2)
    with pytest.raises(ValueError, match=r"at least 7"):
        check_shardable(cfg, 32, 8)  # 4 tokens a shard: shorter than the halo


def test_canonical_order_puts_the_entries_as_one_process_does():
    batch = worker.global_batch()
    cfg = tiny()
    whole = SeqContext(cfg, batch.input_ids, batch.doc_ids)
    assert whole.layout(4).canonical is None
    for size in (2, 4):
        sharded = SeqContext(cfg, batch.input_ids, batch.doc_ids, shard=_Shard(1, size))
        for m in (4, 8):
            a, b = whole.layout(m), sharded.layout(m)
            order = b.canonical
            assert torch.equal(b.starts.gather(1, order), a.starts)  # valid entries by start, then padding
            for t0, t1 in ((0, 16), (16, 40)):
                seen = b.visible(t0, t1).gather(2, order[:, None, :].expand(-1, t1 - t0, -1))
                assert torch.equal(seen, a.visible(t0, t1))


def test_layout_sizes_count_cp_ranks():
    assert ParallelSection(cp=2).world_size(8) == 8
    assert resolve_layout(1, -1, 2, 8, cp=2) == (1, 4, 2)
    with pytest.raises(ValueError, match="dp_replicate x cp"):
        resolve_layout(1, -1, 1, 6, cp=4)


# ---- torchrun on gloo: the collectives ------------------------------------------------------------------
def _gradient_errors(ref: dict, got: dict) -> dict[str, float]:
    """Each tensor's gradient error ||got - ref|| relative to max(||ref||, the norm it would have at the
    model's RMS gradient per element): 1e-5 relative for every gradient, and for one that nearly cancels
    (mHC biases and scales, a norm 1e-3 of the typical size) 1e-5 of the typical size, as fp32 sums of
    the same terms in another order (over shards, not over the sequence) differ by more than 1e-5 of
    such a gradient."""
    total = torch.cat([g.flatten() for g in ref.values()])
    rms = total.norm() / total.numel() ** 0.5
    return {name: ((got[name] - g).norm() / torch.maximum(g.norm(), rms * g.numel() ** 0.5)).item()
            for name, g in ref.items()}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process on the whole batch."""
    d = tmp_path_factory.mktemp("cp_ref")
    worker.step(str(d / "one.pt"))
    return torch.load(d / "one.pt")


def _run_worker(tmp_path, nproc: int, dp_shard: int, ep: int, cp: int, compiled: int, v3: int = 0, tp: int = 1) -> dict:
    """One layout's step in a launch of its own (each rank forked from a warm process)."""
    from trex_run import torchrun

    out = tmp_path / f"cp{cp}_dp{dp_shard}_ep{ep}_tp{tp}.pt"
    proc = torchrun(os.path.join(HERE, "context_parallel_worker.py"),
                    [",".join(map(str, [out, dp_shard, ep, cp, compiled, v3, tp]))], nproc=nproc)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out)


# name -> (nproc, dp_shard, ep, cp, compiled, v3) of context_parallel_worker.py; the compiled layout last on its
# ranks, after the eager ones
LAYOUTS = {"cp2": (2, 1, 1, 2, 0, 0), "cp4": (4, 1, 1, 4, 0, 0), "fsdp2-ep2-cp2": (4, 2, 2, 2, 0, 0),
           "v3-fsdp2-ep2-cp2": (4, 2, 2, 2, 0, 1), "v32-cp2": (2, 1, 1, 2, 0, 2), "cp2-checkpointed-compiled": (2, 1, 1, 2, 1, 0)}


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> dict:
    """Each layout's step (its loss, NLL and gradients, a path to ``torch.load``): one torchrun per number of
    ranks, which runs its layouts one after the other on one process group, each rank forked from a warm
    process (tests/trex_run.py)."""
    from trex_run import torchrun

    d = tmp_path_factory.mktemp("cp")
    for nproc in sorted({layout[0] for layout in LAYOUTS.values()}):
        args = [",".join(map(str, [d / f"{name}.pt", *layout[1:]])) for name, layout in LAYOUTS.items()
                if layout[0] == nproc]
        proc = torchrun(os.path.join(HERE, "context_parallel_worker.py"), args, nproc=nproc)
        assert proc.returncode == 0, proc.stderr[-3000:]
    return {name: d / f"{name}.pt" for name in LAYOUTS}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["cp2", "cp4", "fsdp2-ep2-cp2", "cp2-checkpointed-compiled"])
def test_sharded_sequence_gives_the_losses_and_gradients_of_one_process(reference, sharded, name):
    _assert_as_one_process(reference, torch.load(sharded[name]))


@pytest.mark.slow
def test_deepseek_v3_under_fsdp2_ep2_cp2_gives_the_losses_and_gradients_of_one_process(tmp_path, sharded):
    """tiny-v3 (MLA gathering its KV latents, a dense first layer, group-limited routing, MTP) on the same packed
    batch on four ranks, FSDP2 over dp_shard 2 x cp 2, experts split in two, every row split in two: the loss,
    every position's NLL of both heads and every gradient as one process's (measured, the core being
    ``latent_attention``'s chunked online softmax: loss 9e-8 relative, NLL within 1e-6, gradients 5.2e-7). cp = 2 alone on two ranks: tests/test_migration.py's V3 move, in `trex train`."""
    worker.step(str(tmp_path / "one.pt"), v3=1)
    _assert_as_one_process(torch.load(tmp_path / "one.pt"), torch.load(sharded["v3-fsdp2-ep2-cp2"]))


@pytest.mark.slow
def test_deepseek_v32_under_cp2_gives_the_losses_and_gradients_of_one_process(tmp_path, sharded):
    """tiny-v3.2 on two ranks, every row split in two, the indexer's KL trained (the sparse stage): each rank's
    queries pick among the whole rows' gathered index keys, and the loss, the NLL and every gradient (the
    indexers' from the KL through the gathered keys included) are one process's."""
    worker.step(str(tmp_path / "one.pt"), v3=2)
    one = torch.load(tmp_path / "one.pt")
    assert any(".attn.indexer." in name for name in one["grads"])
    _assert_as_one_process(one, torch.load(sharded["v32-cp2"]))


def _assert_as_one_process(one: dict, got: dict) -> None:
    assert torch.allclose(got["loss"], one["loss"], rtol=1e-5, atol=0)
    for a, b in zip(one["nll"], got["nll"]):  # every position of a row, gathered from its shards
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)
    assert got["grads"].keys() == one["grads"].keys()
    errors = _gradient_errors(one["grads"], got["grads"])
    worst = max(errors, key=errors.get)
    assert errors[worst] <= 1e-5, f"{worst}: gradient error {errors[worst]:.2e}"


@pytest.mark.slow
def test_ten_steps_at_cp2_match_one_process(tmp_path):
    from test_distributed import _losses
    from trex.data.arithmetic import ArithmeticTask, generate, sft_records
    from trex.data.records import write_jsonl

    problems, _ = generate(ArithmeticTask(digits=2, n_train=300, n_eval=10))
    write_jsonl(tmp_path / "sft.jsonl", sft_records(problems))
    (tmp_path / "recipe.toml").write_text("# everything set on the command line\n")
    args = ["train", str(tmp_path / "recipe.toml"), "--set", f'data.paths=["{tmp_path}/sft.jsonl"]',
            "--set", 'data.tokenizer="compact"', "--set", "data.seq_len=64", "--set", "data.micro_batch_size=2",
            "--set", "train.steps=10", "--set", "optim.lr=3e-3", "--set", "train.progress=false",
            "--set", "train.balance_alpha=0.01"]
    runs = {}
    for name, nproc, extra in (("one", 1, []), ("cp2", 2, ["--set", "parallel.cp=2"])):
        proc = trex([*args, "--out", str(tmp_path / name), *extra], procs=nproc, env={"TREX_DEVICE": "cpu"})
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[name] = tmp_path / name
    compare = trex(["fidelity", "compare", str(runs["cp2"]), str(runs["one"]), "--profile", "layout"])
    assert compare.returncode == 0, compare.stdout + compare.stderr
    assert len(_losses(runs["cp2"])) == 10
    summary = json.loads((runs["cp2"] / "summary.json").read_text())
    assert summary["parallel"]["cp"] == 2
    one = [json.loads(line) for line in open(runs["one"] / "metrics.jsonl")]
    cp2 = [json.loads(line) for line in open(runs["cp2"] / "metrics.jsonl")]
    assert [m["tokens"] for m in one] == [m["tokens"] for m in cp2]  # a cp group counts its rows once


@pytest.mark.slow
def test_a_sequence_the_layout_cannot_split_fails_before_step_one(tmp_path):
    (tmp_path / "recipe.toml").write_text("# everything set on the command line\n")
    cmd = [sys.executable, "-m", "trex", "launch", "--nproc-per-node=2", f"--master-port={_free_port()}", "train",
           str(tmp_path / "recipe.toml"), "--out", str(tmp_path / "run"), "--set", "parallel.cp=2",
           "--set", "data.seq_len=100", "--set", "train.steps=1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TREX_DEVICE": "cpu"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 2, proc.stderr[-3000:]  # a user error
    assert "data.seq_len = 100 with parallel.cp = 2" in proc.stderr and "would work" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
