"""--dry-run: the full-size model under the real parallel plan and a fake process group, on a CPU."""

from __future__ import annotations

import os

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
    assert four["mesh"] == {"dp_replicate": 1, "dp_shard": 4, "efsdp": 2, "ep": 2, "cp": 1}


@pytest.mark.slow
def test_v4_pro_recipe_at_1024_ranks():
    recipe = load(TrainRecipe, os.path.join(ROOT, "recipes", "deepseek_v4_pro_sft.toml"))
    report = dry_run(recipe, 1024)
    counts = count_parameters(get_preset("deepseek-v4-pro"))
    assert report["parameters_total"] == counts.total + counts.mtp
    per_rank = report["per_rank"]["parameter_elements"]
    assert report["parameters_total"] / 1024 <= per_rank <= report["parameters_total"] / 1024 * 1.02
    assert report["per_rank"]["total_bytes"] < 40 * 2**30
