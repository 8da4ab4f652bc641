"""Fidelity signals recorded by the training loop, and the golden reference of the default recipe:
a short re-run passes, a perturbed run fails."""

from __future__ import annotations

import json
import os

import pytest
import torch

from trex.fidelity.compare import compare
from trex.fidelity.golden import DEFAULT_DATA_FILES, write_default_data
from trex.fidelity.profiles import get_profile
from trex.fidelity.runs import load_signals
from trex.models import build_model
from trex.models.common.cross_entropy import IGNORE_INDEX
from trex.models.deepseek_v4.config import tiny
from trex.recipe import load
from trex.train.config import TrainRecipe
from trex.train.loop import train
from trex.train.signals import grad_norms_by_group, layer_group, probe_positions

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = os.path.join(ROOT, "recipes", "fidelity_default.toml")
GOLDEN = os.path.join(ROOT, "fidelity", "golden", "default_cpu_fp32.json")


def test_committed_data_is_what_the_generator_writes(tmp_path):
    for generated in write_default_data(str(tmp_path)):
        committed = os.path.join(ROOT, "fidelity", "data", os.path.basename(generated))
        assert open(generated).read() == open(committed).read(), committed
    assert len(DEFAULT_DATA_FILES) == 2


def test_group_norms_combine_to_the_global_norm():
    model = build_model(tiny(), seed=0)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    out = model(ids, labels=ids)
    (out.loss + out.mtp_loss).backward()
    norms = grad_norms_by_group(model)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    assert sum(v * v for v in norms.values()) == pytest.approx(total.item() ** 2, rel=1e-5)
    embed = model.embed.weight.grad.norm().item()
    assert norms["embed"] == pytest.approx(embed, rel=1e-6)
    assert set(norms) == {layer_group(n) for n, p in model.named_parameters() if p.grad is not None}


def test_probe_positions_are_spread_over_each_rows_targets():
    targets = torch.full((3, 20), IGNORE_INDEX)
    targets[0, 4:14] = 1
    targets[2, 7] = 1
    chosen = probe_positions(targets, 3)
    assert chosen == [(0, 4), (0, 8), (0, 13), (2, 7)]  # row 1 has no target; row 2 has one


def _short(out, *extra):
    """The default fidelity recipe cut to its first 6 steps (absolute data paths: any working directory)."""
    data = os.path.join(ROOT, "fidelity", "data")
    return load(TrainRecipe, RECIPE, [
        f"train.out={json.dumps(str(out))}", "train.steps=6",
        f"data.paths={json.dumps([os.path.join(data, 'arithmetic_sft.jsonl')])}",
        f"fidelity.probe_paths={json.dumps([os.path.join(data, 'arithmetic_probe.jsonl')])}", *extra])


@pytest.mark.slow
def test_short_rerun_passes_the_golden_reference_and_a_wrong_lr_fails(tmp_path):
    golden = load_signals(GOLDEN)
    rerun = train(_short(tmp_path / "rerun")).run_dir
    signals = load_signals(rerun)
    assert sorted(signals.grad_norms) == sorted(signals.probe) == [5]  # [fidelity] every = 5
    result = compare(signals, golden, get_profile("layout"), allow_prefix=True)
    assert result.passed, [(c.measure, c.value, c.status) for c in result.checks]

    wrong = train(_short(tmp_path / "wrong_lr", "optim.lr=1.2e-2")).run_dir
    result = compare(load_signals(wrong), golden, get_profile("layout"), allow_prefix=True)
    assert not result.passed
    failed = {c.measure for c in result.checks if c.status == "FAIL"}
    assert {"loss_mean_rel_err", "layer_grad_norm_rel_err", "probe_kl"} <= failed


@pytest.mark.slow
def test_recording_does_not_change_the_run(tmp_path):
    quiet = train(_short(tmp_path / "quiet", "fidelity.every=0")).run_dir
    assert not os.path.exists(os.path.join(quiet, "grad_norms.jsonl"))
    loud = train(_short(tmp_path / "loud", "fidelity.every=1")).run_dir
    assert load_signals(quiet).series("loss") == load_signals(loud).series("loss")
    assert len(load_signals(loud).probe) == 6


@pytest.mark.slow
def test_bf16_run_passes_the_precision_profile_and_a_broken_one_fails(tmp_path):
    """bf16 (fp32 masters, bf16 compute) against the fp32 golden; doubling the lr is a real divergence."""
    golden = load_signals(GOLDEN)
    run = train(_short(tmp_path / "bf16", 'precision.dtype="bf16"'))
    assert run.summary["precision"]["param_dtype"] == "float32"
    assert all(p.dtype == torch.float32 for p in run.model.parameters())
    result = compare(load_signals(run.run_dir), golden, get_profile("precision"), allow_prefix=True)
    assert result.passed, [(c.measure, c.value, c.status) for c in result.checks]

    broken = train(_short(tmp_path / "bf16_lr", 'precision.dtype="bf16"', "optim.lr=2e-2")).run_dir
    result = compare(load_signals(broken), golden, get_profile("precision"), allow_prefix=True)
    assert not result.passed
    assert "loss_mean_rel_err" in {c.measure for c in result.checks if c.status == "FAIL"}
