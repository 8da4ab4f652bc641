"""Shipped cluster recipes are true: each names the clusters it is meant for, and the planner's
verdict on those lines (written by `trex plan RECIPE --annotate`) is current and says it fits."""

from __future__ import annotations

import glob
import os
import shutil

import pytest

from trex import recipe as recipe_io
from trex.cli import main
from trex.models import get_preset
from trex.plan import annotate
from trex.plan.command import plan_recipe
from trex.train.config import TrainRecipe

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLUSTER_RECIPES = sorted(p for p in glob.glob(os.path.join(ROOT, "recipes", "*.toml"))
                         if recipe_io.load(TrainRecipe, p).model.preset.startswith(("deepseek-v", "kimi-k2")))


def test_the_cluster_recipes_are_found():
    assert {os.path.basename(p) for p in CLUSTER_RECIPES} >= {"deepseek_v4_pro_sft.toml", "deepseek_v4_flash_sft.toml",
                                                            "deepseek_v31_sft.toml", "kimi_k2_sft.toml"}


@pytest.mark.parametrize("path", CLUSTER_RECIPES, ids=os.path.basename)
def test_every_planned_line_is_current_and_fits(path):
    text = open(path, encoding="utf-8").read()
    found = annotate.targets(text)
    assert found, f"{path}: no '#   N x HARDWARE:' line names the cluster it is for"
    recipe = recipe_io.load(TrainRecipe, path)
    preset = get_preset(recipe.model.preset)
    assert preset.n_routed_experts % recipe.parallel.ep == 0
    for t in found:
        plan = plan_recipe(path, t.devices, t.hardware)
        assert t.verdict == annotate.verdict(plan), \
            f"{path}:{t.line + 1} is stale: run `trex plan {os.path.relpath(path, ROOT)} --annotate`"
        assert plan.fits, f"{path}:{t.line + 1}: {annotate.verdict(plan)}"
        assert recipe.parallel.world_size(t.devices) == t.devices


def test_annotate_rewrites_typed_numbers_and_exits_1_when_a_cluster_is_too_small(tmp_path, capsys):
    path = tmp_path / "pro.toml"
    shutil.copy(os.path.join(ROOT, "recipes", "deepseek_v4_pro_sft.toml"), path)
    text = path.read_text()
    first = annotate.targets(text)[0]
    lines = text.splitlines(keepends=True)
    lines[first.line] = f"#   {first.devices} x {first.hardware}: fits, 96 GiB (typed by hand)\n"
    lines.insert(first.line + 1, f"#   {first.devices} x ascend-910c-die: fits\n")  # 64 GiB dies: too small
    path.write_text("".join(lines))

    assert main(["plan", str(path), "--annotate"]) == 1
    out = capsys.readouterr().out
    new = annotate.targets(path.read_text())
    assert "typed by hand" not in path.read_text()
    assert new[0].verdict == annotate.verdict(plan_recipe(str(path), first.devices, first.hardware))
    assert new[1].hardware == "ascend-910c-die" and new[1].verdict.startswith("DOES NOT FIT")
    assert f"{path}:{first.line + 2}: {first.devices} x ascend-910c-die: DOES NOT FIT" in out
    assert path.read_text().count("\n") == text.count("\n") + 1  # nothing but the verdicts changed
    assert not list(tmp_path.glob(".*.tmp"))


def test_annotate_refuses_a_recipe_without_planned_lines(tmp_path, capsys):
    path = tmp_path / "r.toml"
    path.write_text('[model]\npreset = "tiny"\n')
    assert main(["plan", str(path), "--annotate"]) == 2
    assert "no planned lines" in capsys.readouterr().err


def test_a_model_and_a_device_count_alone_plan_the_fastest_layout_that_fits(capsys):
    # the README's line: no recipe, no --seq, no --layout
    assert main(["plan", "--model", "deepseek-v4-pro", "--hardware", "ascend-910c-die", "--devices", "1024"]) == 0
    out, err = capsys.readouterr()
    assert "FITS" in out and "(1024 x ascend-910c-die" in out and "4096" in out
    assert "4096-token sequences" in err and "fastest of" in err


def test_annotate_of_a_missing_recipe_is_one_line(tmp_path, capsys):
    assert main(["plan", str(tmp_path / "none.toml"), "--annotate"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == f"trex plan: {tmp_path / 'none.toml'}: No such file or directory"
