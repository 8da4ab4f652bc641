"""The fidelity ladder: a divergence planted at each rung is found at that rung and at the right
layer; a variant that changes nothing the profile cares about climbs all five rungs."""

from __future__ import annotations

import json
import os

import pytest
import torch
from trex_run import trex

from trex import device as device_layer
from trex.fidelity.ladder import agreement, ladder_overrides, lr0_overrides, run_ladder, tensor_errors
from trex.fidelity.profiles import get_profile
from trex.precision import PrecisionPolicy
from trex.recipe import load
from trex.train.config import TrainRecipe
from trex.train.loop import model_for, tokenizer_for, train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = os.path.join(ROOT, "recipes", "fidelity_default.toml")
DATA = os.path.join(ROOT, "fidelity", "data")
PATHS = [f"data.paths={json.dumps([os.path.join(DATA, 'arithmetic_sft.jsonl')])}",
         f"fidelity.probe_paths={json.dumps([os.path.join(DATA, 'arithmetic_probe.jsonl')])}"]


def ladder(tmp_path, variant=(), edit=None, profile="layout", steps=4):
    return run_ladder(RECIPE, [*PATHS, *variant], str(tmp_path / "ladder"), get_profile(profile),
                      reference_overrides=PATHS, steps=steps, edit=edit)


def statuses(report) -> list[str]:
    return [r["status"] for r in report["rungs"]]


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the backward multiplies the gradient by 1.2 (a gradient bug)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * 1.2


def wrong_norm_eps(model):
    model.layers[2].ffn_norm.eps = 1e-2


def gradient_bug_in_layer_1(model):
    model.layers[1].ffn.register_forward_hook(lambda module, args, out: _ScaleGrad.apply(out))


def bf16_attention_in_layer_2(model):
    model.layers[2].attn.register_forward_hook(lambda module, args, out: out.bfloat16().float())


def test_a_wrong_norm_epsilon_in_one_block_is_found_at_the_forward_rung_in_that_block(tmp_path):
    report = ladder(tmp_path, edit=wrong_norm_eps)
    assert statuses(report) == ["FAIL", "not run", "not run", "not run", "not run"]
    forward = report["rungs"][0]
    assert forward["departure"]["block"] == "layers.2"
    before = {r["name"]: r for r in forward["rows"]}
    assert all(before[b]["max_abs"] == 0 for b in ("embed", "layers.0", "layers.1"))  # exact up to the block
    assert report["first_failing_rung"] == 1
    assert os.path.isfile(tmp_path / "ladder" / "ladder.png")


def test_a_gradient_bug_in_one_layer_is_found_at_the_backward_rung_in_that_layer(tmp_path):
    report = ladder(tmp_path, edit=gradient_bug_in_layer_1)
    assert statuses(report)[:2] == ["PASS", "FAIL"]
    assert report["rungs"][0]["measures"]["loss_err"] == 0  # the forward is untouched
    departure = report["rungs"][1]["departure"]
    assert departure["group"].startswith("layers.1."), departure
    rows = {r["name"]: r for r in report["rungs"][1]["rows"]}
    assert all(r["norm_rel_err"] == 0 for n, r in rows.items() if n.startswith(("layers.2.", "layers.3.", "head")))


def test_an_optimizer_bug_is_found_at_the_optimizer_rung(tmp_path):
    report = ladder(tmp_path, variant=["optim.ns_iterations=[5, 2]"])  # Newton-Schulz cut short
    assert statuses(report)[:3] == ["PASS", "PASS", "FAIL"]
    assert report["rungs"][1]["measures"]["worst_parameter_err"] == 0  # gradients are the same
    departure = report["rungs"][2]["departure"]
    assert departure["parameter"] == "layers.0.ffn.experts.w1"  # the first Muon (matrix) parameter
    md = open(tmp_path / "ladder" / "ladder.md").read()
    assert "first failing rung: 3 optimizer" in md


def test_a_precision_change_in_one_block_is_found_at_the_forward_rung_in_that_block(tmp_path):
    report = ladder(tmp_path, edit=bf16_attention_in_layer_2)
    assert report["first_failing_rung"] == 1
    assert report["rungs"][0]["departure"]["block"] == "layers.2"
    assert report["rungs"][0]["measures"]["loss_err"] < get_profile("layout").ladder.loss  # the loss alone passes


@pytest.mark.slow
def test_bf16_climbs_every_rung_of_the_precision_ladder_and_fails_the_layout_one(tmp_path):
    report = ladder(tmp_path, variant=['precision.dtype="bf16"'], profile="precision")
    assert statuses(report) == ["PASS"] * 5, json.dumps(report["rungs"], default=str)[:2000]
    for number, tag in ((4, "lr0"), (5, "run")):
        for side in ("reference", "variant"):
            assert os.path.isfile(tmp_path / "ladder" / side / tag / "metrics.jsonl")
        assert os.path.isfile(report["rungs"][number - 1]["report"])
    lr0 = [json.loads(line)["loss"] for line in open(tmp_path / "ladder" / "reference" / "lr0" / "metrics.jsonl")]
    assert len(lr0) == 4 and len(set(lr0)) == 4  # lr = 0 still sees a new batch every step
    strict = run_ladder(RECIPE, [*PATHS, 'precision.dtype="bf16"'], str(tmp_path / "strict"), get_profile("layout"),
                        reference_overrides=PATHS, steps=4)
    assert strict["first_failing_rung"] == 1 and strict["rungs"][0]["departure"]["block"] == "embed"


def test_lr0_keeps_every_weight(tmp_path):
    """Rung 4's premise: at optim.lr = 0 (and no router-bias update) the training loop leaves the
    weights exactly as they were."""
    recipe = load(TrainRecipe, RECIPE, [*PATHS, "optim.lr=0", "train.bias_gamma=0", "train.steps=3",
                                        f"train.out={json.dumps(str(tmp_path / 'run'))}", "train.progress=false"])
    dev = device_layer.detect("cpu")
    tokenizer = tokenizer_for(recipe.data.tokenizer)
    model = model_for(recipe, tokenizer, dev, PrecisionPolicy.resolve("fp32", dev))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trained = train(recipe, model=model, tokenizer=tokenizer).model
    assert all(torch.equal(before[n], p) for n, p in trained.named_parameters())


def test_a_lr0_rung_shorter_than_the_long_runs_record_interval_still_records():
    """`--steps 20 --lr0-steps 4`: the long run records every 5 steps, so rung 4 must record more often, or it
    has no per-layer gradient norms or probe to judge (it failed on their absence)."""
    side = ladder_overrides(RECIPE, PATHS, 20)
    long_run = load(TrainRecipe, RECIPE, side)
    assert long_run.train.steps == 20 and long_run.fidelity.every == 5
    rung4 = load(TrainRecipe, RECIPE, [*side, *lr0_overrides(RECIPE, side, 4)])
    assert rung4.train.steps == 4 and rung4.optim.lr == 0 and 0 < rung4.fidelity.every <= 2
    default = load(TrainRecipe, RECIPE, [*side, *lr0_overrides(RECIPE, side, None)])
    assert default.train.steps == 20 and default.fidelity.every == 5


def test_tensor_errors_judge_norm_and_direction_and_the_floor():
    ref = {"a": torch.tensor([3.0, 4.0]), "b": torch.tensor([1e-4, 0.0])}
    rows = tensor_errors({"a": torch.tensor([4.0, 3.0]), "b": torch.tensor([0.0, 1e-4])}, ref, ["a", "b"], 1e-3, 0.05)
    a, b = rows
    assert a["norm_rel_err"] == 0 and a["direction_err"] == pytest.approx(1 - 24 / 25) and a["departs"]
    assert b["direction_err"] == 0 and not b["departs"]  # below 5% of the global norm: judged by norm only
    missing = tensor_errors({}, ref, ["a"], 1.0, 0.0)[0]
    assert missing["departs"] and "only in the reference" in missing["note"]
    same = agreement(torch.ones(3), torch.ones(3))
    assert same["cosine"] == 1.0 and same["max_abs"] == 0.0


def test_the_cli_refuses_a_layout_of_several_processes_in_one_line(tmp_path):
    out = tmp_path / "ladder"
    proc = trex(["fidelity", "ladder", RECIPE, "--variant", "parallel.dp_shard=2", "--out", str(out)])
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "trex fidelity matrix" in proc.stderr
    assert not out.exists()
