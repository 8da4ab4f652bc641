"""DeepSeek-V4.1's Engram tables at full size: frozen or trained with row-wise AdaGrad, split by rows over
every rank (trex.parallel.engram), and counted by the planner and the dry run as trex holds them. The
lookup's exchange is checked end to end in tests/test_model_v41.py (two ranks against one process)."""

from __future__ import annotations

import math

import pytest
import torch

from trex.models import count_parameters, get_preset
from trex.recipe import load
from trex.train.config import TrainRecipe

FLASH_ROWS = (384_006_168, 384_016_682)


def test_rowwise_adagrad_moves_only_the_rows_a_step_read_by_the_hand_computed_amount():
    from trex.train.optim import MuonAdamW

    table = torch.nn.Parameter(torch.randn(5, 4, generator=torch.Generator().manual_seed(0)))
    start = table.detach().clone()
    opt = MuonAdamW([{"params": [table], "algorithm": "rowwise_adagrad", "lr": 0.1, "eps": 1e-10,
                      "weight_decay": 0.0}])
    grads = [torch.zeros(5, 4), torch.zeros(5, 4)]
    grads[0][1] = torch.tensor([1.0, -2.0, 0.5, 0.0])
    grads[0][3] = torch.tensor([0.25, 0.25, -0.25, 1.0])
    grads[1][1] = torch.tensor([2.0, 0.0, 0.0, 0.0])
    expected = start.clone()
    sum_sq = torch.zeros(5)
    for g in grads:
        table.grad = g.clone()
        opt.step()
        for row in range(5):
            sum_sq[row] += sum(float(x) ** 2 for x in g[row]) / 4
            if g[row].any():
                expected[row] -= 0.1 * g[row] / (math.sqrt(sum_sq[row]) + 1e-10)
    torch.testing.assert_close(table.detach(), expected, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(opt.state[table]["sum_sq"], sum_sq)
    for row in (0, 2, 4):  # never read: bit for bit as they started, no state
        assert torch.equal(table.detach()[row], start[row]) and opt.state[table]["sum_sq"][row] == 0
    skipped = table.detach().clone()
    table.grad = grads[0].clone()
    opt.step(apply=torch.tensor(False))  # a skipped step changes neither the rows nor the state
    assert torch.equal(table.detach(), skipped) and torch.equal(opt.state[table]["sum_sq"], sum_sq)


def test_the_tables_are_frozen_by_default_and_trained_in_their_own_group_when_asked():
    from trex.models.deepseek_v4.config_v41 import tiny_v41
    from trex.models.deepseek_v4.model_v41 import DeepseekV41
    from trex.train.moe_balance import freeze_for_post_training
    from trex.train.optim import OptimSection, build_optimizer

    frozen = DeepseekV41(tiny_v41())
    names = freeze_for_post_training(frozen, True, load(TrainRecipe).train.engram)
    assert {n for n in names if "engram" in n} == {"layers.0.engram.embed.weight", "layers.3.engram.embed.weight"}
    assert frozen.layers[0].engram.wkv.weight.requires_grad  # the gate's projection still trains
    trained = DeepseekV41(tiny_v41())
    freeze_for_post_training(trained, True, "train")
    groups = {g["rule"]: g for g in build_optimizer(trained, OptimSection(lr=1e-3, engram_lr_scale=4.0)).param_groups}
    table = groups["engram_table"]
    assert table["algorithm"] == "rowwise_adagrad" and table["lr"] == pytest.approx(4e-3)
    assert table["weight_decay"] == 0.0 and len(table["params"]) == 2
    v4 = get_preset("tiny")
    from trex.models import build_model

    with pytest.raises(ValueError, match='train.engram = "train": this model \\(deepseek_v4\\) has no Engram'):
        freeze_for_post_training(build_model(v4, device="meta"), True, "train")


def test_the_planner_counts_the_flash_tables_rows_and_keeps_them_apart():
    from trex.hardware import load_profiles
    from trex.plan.layout import Layout
    from trex.plan.model_facts import model_facts
    from trex.plan.planner import make_plan

    cfg = get_preset("deepseek-v4.1-flash")
    facts = model_facts(cfg)
    counts = count_parameters(cfg)
    assert facts.engram_rows == sum(FLASH_ROWS) and facts.engram_tables == sum(FLASH_ROWS) * 256
    assert facts.by_type["engram_tables"] == facts.engram_tables == counts.engram
    assert facts.total == counts.total and facts.active == counts.active and facts.mtp == 0
    assert facts.stored == counts.total - counts.engram  # what FSDP shards
    h200 = load_profiles()["h200-sxm"]
    frozen = make_plan(cfg, Layout(dp_shard=128, ep=64, recompute="full"), 4096, h200)
    trained = make_plan(cfg, Layout(dp_shard=128, ep=64, recompute="full", train_engram=True), 4096, h200)
    tables = 4 * facts.engram_tables / 128
    assert frozen.memory.weights == pytest.approx(4 * facts.stored / 128 + tables)
    assert trained.memory.gradients - frozen.memory.gradients == pytest.approx(tables)
    assert trained.memory.optimizer - frozen.memory.optimizer == pytest.approx(4 * sum(FLASH_ROWS) / 128)
    assert trained.time.ep_comm > frozen.time.ep_comm  # the rows' gradients travel back
    from trex.plan.layout import Trained
    from trex.plan.planner import search

    found = search(cfg, 128, 4096, 128 * 4096, h200, micro_batches=(1,), recompute=("full",), largest_ep_only=True,
                   trained=Trained(engram=True))
    assert found and all(p.layout.train_engram for p in found)  # a search keeps the tables' mode


@pytest.mark.parametrize("engram", ["frozen", "train"])
def test_the_flash_recipe_dry_runs_at_128_ranks_with_each_rank_holding_its_rows(engram):
    """The shipped V4.1 recipe under its real plan on a fake process group: each rank holds ceil(rows / 128)
    rows of each table, outside FSDP and outside the gathered block, and the planner's weights agree."""
    from trex.hardware import load_profiles
    from trex.plan.command import plan_recipe
    from trex.train.dry_run import dry_run

    path = "recipes/deepseek_v41_flash_sft.toml"
    recipe = load(TrainRecipe, path, overrides=[f'train.engram="{engram}"', 'model.path=""'])
    report = dry_run(recipe, 128)["per_rank"]
    local_rows = sum(-(-rows // 128) for rows in FLASH_ROWS)
    assert report["engram_table_bytes"] == 4 * 256 * local_rows
    assert report["largest_unsharded_block_bytes"] < 2 * 2**30  # no table is gathered with its block
    plan = plan_recipe(path, 128, load_profiles()["h200-sxm"].name)
    assert report["params_fp32_bytes"] == pytest.approx(plan.memory.weights, rel=0.01)
    if engram == "train":
        frozen = dry_run(load(TrainRecipe, path, overrides=['model.path=""']), 128)["per_rank"]
        assert report["optimizer_state_bytes"] - frozen["optimizer_state_bytes"] == 4 * local_rows
        assert report["grads_bytes"] - frozen["grads_bytes"] == 4 * 256 * local_rows
