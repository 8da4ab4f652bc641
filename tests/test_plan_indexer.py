"""The planner's lightning indexer when it trains (``Layout.train_indexer``, a recipe's ``[train] indexer_loss`` > 0):
its FLOPs are what a training step of trex's model runs, its gradients and optimizer state join the trained
parameters, TP runs its whole part on every rank, and a model without one is refused in one line."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from trex.hardware import load_profiles
from trex.models import build_model, get_preset
from trex.plan.layout import Layout, PlanError
from trex.plan.planner import make_plan
from trex.plan.terms import terms


@pytest.mark.parametrize("preset", ["tiny-v3.2", "tiny"])
def test_the_indexers_training_flops_are_what_a_training_step_runs(preset):
    """FLOPs torch counts (matmuls and einsums, forward, the KL chunks' checkpoint recomputes and backward) in a
    training step with the indexer's alignment on, less the same step with it off, per token: equal to the family's
    ``indexer_training_flops`` (its split and whole parts together), for V3.2's and V4's indexers."""
    from torch.utils.flop_counter import FlopCounterMode

    cfg, S = get_preset(preset), 64
    model = build_model(cfg, device="cpu", dtype=torch.float32, seed=0).train()
    ids = torch.randint(0, cfg.vocab_size, (1, S), generator=torch.Generator().manual_seed(0))

    def flops(align: bool) -> int:
        model.align_indexer = align
        with FlopCounterMode(display=False) as counter:
            out = model(ids, labels=ids)
            (out.loss + (out.indexer_loss if align else 0.0)).backward()
        return counter.get_total_flops()

    split, whole = terms(cfg).indexer_training_flops(cfg, S)
    assert split > 0 and whole > 0
    assert (flops(True) - flops(False)) / S == split + whole


def _published_v32(train_indexer: bool):
    """DeepSeek-V3.2 at torchtitan-npu's 4K layout (tests/test_plan_tp.py's PUBLISHED row)."""
    cfg = dataclasses.replace(get_preset("deepseek-v3.2"), num_nextn_predict_layers=0)
    layout = Layout(dp_shard=32, tp=4, ep=64, recompute="full", optimizer="adamw", offload_optimizer=True,
                    reduce_every_micro_batch=True, grad_accum=16, train_indexer=train_indexer)
    return cfg, make_plan(cfg, layout, 4096, load_profiles()["ascend-910c-die"])


def test_a_trained_indexer_adds_its_flops_on_every_tp_rank_and_its_gradients_and_state():
    cfg, frozen = _published_v32(False)
    _, trained = _published_v32(True)
    layout, facts, S = trained.layout, trained.facts, 4096
    split, whole = terms(cfg).indexer_training_flops(cfg, S)
    tokens_per_device = layout.grad_accum * layout.dp_shard * S / layout.devices
    rate = trained.hardware.peak_flops(trained.assumptions.dtype) * trained.assumptions.compute_efficiency
    # its heads' share of the KL target on each TP rank, all of the rest on the group's every row
    assert trained.time.compute - frozen.time.compute == pytest.approx(tokens_per_device * (split + 4 * whole) / rate)
    assert trained.time.recompute == frozen.time.recompute  # the align runs in the recording forward only
    assert facts.indexer == 61 * (1536 * 64 * 128 + 7168 * (128 + 64) + 2 * 128)  # wq_b, wk, weights_proj, k_norm
    shard = layout.fsdp
    assert trained.memory.gradients - frozen.memory.gradients == pytest.approx(4 * facts.indexer / shard)
    assert trained.memory.optimizer_host - frozen.memory.optimizer_host == pytest.approx(8 * facts.indexer / shard)
    assert "indexer-trained" in layout.describe()


@pytest.mark.parametrize("preset, message", [
    ("tiny-v4.1", "layout: train_indexer: DeepSeek-V4.1's indexer has no alignment loss in trex"),
    ("tiny-v3", "layout: train_indexer: .* has no lightning indexer"),
])
def test_a_trained_indexer_the_model_does_not_have_is_refused_in_one_line(preset, message):
    with pytest.raises(PlanError, match=f"^{message}"):
        make_plan(get_preset(preset), Layout(dp_shard=1, train_indexer=True), 64, load_profiles()["h100-sxm"])


def test_a_recipe_with_indexer_loss_plans_the_indexer_trained_and_trex_train_refuses_it_without_one(tmp_path):
    from trex.plan.command import recipe_inputs
    from trex.recipe import load
    from trex.train.config import TrainRecipe
    from trex.train.loop import train

    recipe = tmp_path / "recipe.toml"
    recipe.write_text('[model]\npreset = "tiny-v3.2"\n[train]\nindexer_loss = 0.1\nfreeze_indexer = false\n')
    assert recipe_inputs(str(recipe), 1)[1].train_indexer
    bad = load(TrainRecipe, overrides=['model.preset="tiny-v4.1"', "train.indexer_loss=0.1", "train.freeze_indexer=false",
                                       f'train.out="{tmp_path}/run"', "train.steps=1", "train.progress=false"])
    with pytest.raises(ValueError, match=r"^train.indexer_loss: .* has no lightning indexer alignment to train"):
        train(bad)
    assert not (tmp_path / "run").exists()  # refused before the run directory is made
    warmup = load(TrainRecipe, overrides=['model.preset="tiny"', "train.indexer_warmup=true", "train.indexer_loss=0.1",
                                          "train.freeze_indexer=false",
                                          f'train.out="{tmp_path}/run2"', "train.steps=1", "train.progress=false"])
    with pytest.raises(ValueError, match=r"^train.indexer_warmup: .* has no dense warm-up stage"):
        train(warmup)
    assert not (tmp_path / "run2").exists()
