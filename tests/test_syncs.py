"""The training step never waits for the host: a SyncCounter around every step of a real run."""

from __future__ import annotations

import pytest
import torch

from arithmetic_data import write_sft
from trex.recipe import load
from trex.syncs import SyncCounter
from trex.train import loop
from trex.train.config import TrainRecipe


def test_counter_sees_every_kind_of_host_read():
    x = torch.arange(6.0)
    with SyncCounter() as s:
        y = (x * 2).sum()  # device work only
    assert s.count == 0
    with SyncCounter() as s:
        y.item()
        x.tolist()
        int(y)
        bool(y > 0)
        x[x > 2]  # boolean-mask indexing: a data-dependent shape
        torch.nonzero(x)
        torch.bincount(x.long())
        torch.repeat_interleave(torch.arange(3), torch.tensor([1, 2, 3]))
    kinds = [what for what, _ in s.events]
    assert kinds == ["item", "tolist", "__int__", "__bool__", "boolean-mask indexing", "nonzero", "bincount",
                     "repeat_interleave without output_size"], s.report()
    with SyncCounter() as s:
        torch.repeat_interleave(torch.arange(3), torch.tensor([1, 2, 3]), output_size=6)  # size given: no read
    assert s.count == 0


@pytest.fixture(scope="module")
def sft_file(tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    return write_sft(d, n_train=200)[0]


def _syncs_per_step(monkeypatch, sft_file, out, *extra) -> list[SyncCounter]:
    counters = []
    real = loop.train_step

    def counted(*args, **kwargs):
        with SyncCounter() as s:
            result = real(*args, **kwargs)
        counters.append(s)
        return result

    monkeypatch.setattr(loop, "train_step", counted)
    recipe = load(TrainRecipe, overrides=[
        f'data.paths=["{sft_file}"]', 'data.tokenizer="compact"', "data.seq_len=64", "data.micro_batch_size=2",
        "train.steps=2", "train.grad_accum=2", f'train.out="{out}"', "train.progress=false", "fidelity.every=0",
        'model.overrides={sliding_window=16}', "train.bias_gamma=0.001", *extra])
    loop.train(recipe)
    return counters


@pytest.mark.parametrize("extra", [
    (),  # fp32, Muon + AdamW, packed rows (documents change inside a row), the aux-loss-free bias update
    ('parallel.activation_checkpointing="full"', 'precision.dtype="bf16"', 'optim.name="adamw"'),
    # DeepSeek-V4.1: CSA2 with shared KV and picks, the candidate pool, Engram's hashing and lookup, single-pass
    # mHC; every served rounding point simulated (32x32 FP8 linears, Engram rows, FP4 experts, KV, indexer)
    ('model.preset="tiny-v4.1"', 'precision.qat="official"'),
    # DeepSeek-V3: MLA, group-limited routing, a dense first layer, MTP
    ('model.preset="tiny-v3"', "model.overrides={}"),
    # DeepSeek-V3.2's sparse stage: the indexer's picks, MLA over them, the indexer's KL trained
    ('model.preset="tiny-v3.2"', "model.overrides={}", "train.indexer_loss=0.1", "train.freeze_indexer=false"),
], ids=["fp32-muon", "bf16-adamw-recompute", "v4.1-qat", "v3", "v3.2-sparse"])
def test_training_step_has_no_host_sync(monkeypatch, sft_file, tmp_path, extra):
    """Every layer type (sliding, CSA with the indexer, HCA; V4.1's CSA2 and Engram), hash and score MoE, MTP,
    clipping, the guard, the optimizer and the router-bias update: zero host reads from forward to the
    update."""
    counters = _syncs_per_step(monkeypatch, sft_file, tmp_path / "run", *extra)
    assert len(counters) == 2
    for s in counters:
        assert s.count == 0, "host syncs inside the training step:\n" + s.report()


def test_reference_kernels_are_caught(monkeypatch, sft_file, tmp_path):
    """The counter fails on a regression: the host-offset grouped-matmul oracle reads once per matmul."""
    monkeypatch.setenv("TREX_KERNELS", "reference")
    counters = _syncs_per_step(monkeypatch, sft_file, tmp_path / "ref")
    assert counters[0].count > 0 and all("grouped_mm" in where for _, where in counters[0].events)


@pytest.mark.slow
def test_distributed_step_syncs_only_for_expert_parallel_split_sizes(sft_file, tmp_path):
    """Two FSDP2 ranks: no host read without expert parallelism (context parallelism adds none, on V4 and on
    DeepSeek-V3's MLA, nor does tensor parallelism on DeepSeek-V3); with it, exactly one per MoE layer forward (the
    all-to-all split sizes), in expert_parallel.py, and nothing else, also when the expert-parallel group spans the
    tp ranks (its token split and output gather add none). The six layouts (FSDP2, FSDP2 + EP2, cp = 2, tiny-v3 at
    cp = 2, tiny-v3 at tp = 2, tiny-v3 at tp = 2 x ep = 2) run one after the other in one launch."""
    import json
    import os

    from trex_run import torchrun  # each rank forked from a warm process

    here = os.path.dirname(os.path.abspath(__file__))
    grad_accum = 2
    v3 = ('model.preset="tiny-v3"', "model.overrides={}")
    layouts = {"fsdp": (1, 1, ()), "fsdp-ep": (2, 1, ()), "cp": (1, 2, ()), "v3-cp": (1, 2, v3),
               "v3-tp": (1, 1, (*v3, "parallel.tp=2", "parallel.dp_shard=1")),
               "v3-tp-ep": (2, 1, (*v3, "parallel.tp=2", "parallel.dp_shard=1"))}
    cases = [[f"parallel.dp_shard={2 // cp}", f"parallel.ep={ep}", f"parallel.cp={cp}", f"train.grad_accum={grad_accum}",
              *model] for ep, cp, model in layouts.values()]
    proc = torchrun(os.path.join(here, "syncs_worker.py"), [str(tmp_path), str(sft_file), json.dumps(cases)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    for i, (name, (ep, cp, _)) in enumerate(layouts.items()):
        for rank in (0, 1):
            result = json.loads((tmp_path / f"case{i}_rank{rank}.json").read_text())
            assert len(result["steps"]) == 2, name
            for events in result["steps"]:
                expected = 0 if ep == 1 else result["moe_layers"] * grad_accum
                assert len(events) == expected, (name, events)
                assert all(what == "tolist" and "expert_parallel.py" in where for what, where in events), (name, events)