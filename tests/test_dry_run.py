"""--dry-run: the full-size model under the real parallel plan and a fake process group, on a CPU."""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import shlex

import pytest

from trex.models import count_parameters, get_preset
from trex.train.dry_run import dry_run
from trex.recipe import load
from trex.train.config import TrainRecipe

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_tiny_model_shards_evenly_across_ranks():
    recipe = load(TrainRecipe, overrides=["parallel.dp_shard=-1", "parallel.ep=2", 'optim.name="adamw"',
                                          "train.freeze_indexer=false"])
    one = dry_run(load(TrainRecipe, overrides=['optim.name="adamw"', "train.freeze_indexer=false"]), 1)
    four = dry_run(recipe, 4)
    total = one["per_rank"]["parameter_elements"]
    assert one["parameters_total"] == total
    assert total / 4 <= four["per_rank"]["parameter_elements"] <= total / 4 * 1.05  # FSDP pads a few rows
    assert four["per_rank"]["optimizer_state_bytes"] == 2 * four["per_rank"]["grads_bytes"]  # AdamW: 2 moments
    assert four["mesh"] == {"dp_replicate": 1, "dp_shard": 4, "efsdp": 2, "ep": 2, "cp": 1, "tp": 1}


def test_an_expert_parallel_group_spanning_the_tp_ranks_splits_the_experts_over_them():
    """tp = 2, ep = 4 on four ranks: the experts over dp_shard 2 x tp 2, a quarter on each rank, none FSDP-sharded
    further (efsdp 1)."""
    overrides = ["parallel.tp=2", 'optim.name="adamw"', "train.freeze_indexer=false"]
    # world size = dp_shard x tp = ep
    two, four = (dry_run(load(TrainRecipe, overrides=[*overrides, f"parallel.ep={ep}"]), ep) for ep in (2, 4))
    assert four["mesh"] == {"dp_replicate": 1, "dp_shard": 2, "efsdp": 1, "ep": 4, "cp": 1, "tp": 2}
    assert two["mesh"] == {"dp_replicate": 1, "dp_shard": 1, "efsdp": 1, "ep": 2, "cp": 1, "tp": 2}
    assert four["per_rank"]["parameter_elements"] < two["per_rank"]["parameter_elements"]


def test_bf16_on_a_cpu_where_it_is_slow_is_no_warning_in_a_dry_run(tmp_path, monkeypatch, capsys, caplog):
    """Nothing runs in a dry run, so nothing "will be slow"; a real run on that CPU is still warned."""
    from trex import device
    from trex.cli import main
    from trex.precision import PrecisionPolicy

    slow = dataclasses.replace(device.Device("cpu").capabilities(), bf16=True, bf16_fast=False)
    monkeypatch.setattr(device.Device, "capabilities", lambda self: slow)
    recipe = tmp_path / "bf16.toml"
    recipe.write_text('[precision]\ndtype = "bf16"\n')
    assert main(["train", str(recipe), "--dry-run", "--world-size", "2"]) == 0
    out, err = capsys.readouterr()
    assert "precision bf16" in out and "slow" not in err, err
    with caplog.at_level(logging.WARNING, logger="trex"):
        PrecisionPolicy.resolve("bf16", device.Device("cpu"))
    assert any("will be slow" in r.getMessage() for r in caplog.records)


README_DRY_RUN = ".venv/bin/trex train recipes/deepseek_v4_pro_sft.toml --dry-run --world-size 1024"


@pytest.mark.slow
def test_v4_pro_recipe_at_1024_ranks():
    """The README's command as written (its doc block is marked as run here), in this process (tests/trex_run.py:
    no ~4 CPU seconds of imports; its fake process group is destroyed when it returns)."""
    from trex_run import trex

    assert README_DRY_RUN in open(os.path.join(ROOT, "README.md")).read()
    program, *args = shlex.split(README_DRY_RUN)
    assert program == ".venv/bin/trex"
    proc = trex(args, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    counts = count_parameters(get_preset("deepseek-v4-pro"))
    total = float(re.search(r"model parameters: ([\d,.]+)B", proc.stdout)[1].replace(",", "")) * 1e9
    assert total == pytest.approx(counts.total + counts.mtp, abs=0.05e9)  # printed to 0.1B
    per_rank = float(re.search(r"\(([\d.]+)B elements\)", proc.stdout)[1]) * 1e9
    assert total / 1024 * 0.99 <= per_rank <= total / 1024 * 1.02  # printed to 0.01B
    assert float(re.search(r"total before activations\s+([\d.]+) GiB", proc.stdout)[1]) < 40
