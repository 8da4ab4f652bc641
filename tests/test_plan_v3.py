"""`trex plan` for the DeepSeek-V3 family (deepseek-v3, deepseek-v3.2, kimi-k2): model facts, fit as the
numbers say, no context parallelism, and the Kimi-K2 dry run at 1,024 ranks."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

import pytest

from trex.cli import main
from trex.hardware import load_profiles
from trex.models import count_parameters, get_preset
from trex.plan.layout import Layout, PlanError
from trex.plan.model_facts import model_facts
from trex.plan.planner import GiB, make_plan, search

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
H200, DIE = load_profiles()["h200-sxm"], load_profiles()["ascend-910c-die"]


@pytest.mark.parametrize("name", ["deepseek-v3", "kimi-k2", "moonlight"])
def test_facts_count_what_the_model_counts(name):
    cfg = get_preset(name)
    facts, counts = model_facts(cfg), count_parameters(cfg)
    assert (facts.total, facts.active, facts.mtp) == (counts.total, counts.active, counts.mtp)
    assert facts.by_type["dense_mlp"] == cfg.first_k_dense_replace * 3 * cfg.hidden_size * cfg.intermediate_size
    assert facts.trainable == facts.stored and facts.muon + facts.adamw == facts.trainable


def test_v32_counts_its_indexer_from_the_config_frozen():
    v3, v32 = model_facts(get_preset("deepseek-v3")), model_facts(get_preset("deepseek-v3.2"))
    per_layer = 1536 * 64 * 128 + 7168 * 128 + 2 * 128 + 7168 * 64
    assert v32.by_type["indexer"] == 61 * per_layer and v32.mtp == v3.mtp + per_layer
    assert v32.trainable == v3.trainable  # frozen, as V4's in post-training
    plan = make_plan(get_preset("deepseek-v3.2"), Layout(dp_shard=256, ep=256, recompute="full"), 4096, H200)
    assert plan.time.compute > 0 and any("does not build V3.2" in n for n in plan.notes)


@pytest.mark.parametrize("name, devices, hw, ep, fits", [
    ("deepseek-v3", 256, H200, 256, True),  # 74.1 GiB of 126.9
    ("deepseek-v3", 512, DIE, 256, False),  # 59.3 GiB of 57.6
    ("deepseek-v3", 1024, DIE, 256, True),  # 53.7
    ("kimi-k2", 128, H200, 128, True),  # 117.9
    ("kimi-k2", 64, H200, 64, False),
    ("kimi-k2", 512, DIE, 128, True),  # 51.0
])
def test_each_preset_fits_or_not_as_the_numbers_say(name, devices, hw, ep, fits):
    plan = make_plan(get_preset(name), Layout(dp_shard=devices, ep=ep, recompute="full"), 4096, hw)
    assert plan.fits == fits == (plan.memory.total <= hw.memory_gib * GiB * 0.9)
    assert 0 < plan.mfu < 0.6


def test_no_context_parallelism_for_v3():
    cfg = get_preset("deepseek-v3")
    with pytest.raises(PlanError, match="cp = 1 only"):
        make_plan(cfg, Layout(dp_shard=128, cp=2, ep=128), 4096, H200)
    plans = search(cfg, 256, 4096, 256 * 4096, H200, micro_batches=(1,), recompute=("full",), offload=(False,))
    assert plans and {p.layout.cp for p in plans} == {1}


@pytest.mark.parametrize("model", ["deepseek-v3", "deepseek-v3.2", "kimi-k2"])
def test_the_cli_plans_the_v3_family(model, capsys):
    assert main(["plan", "--model", model, "--hardware", "h200-sxm", "--devices", "256"]) == 0
    out = capsys.readouterr().out
    assert "FITS" in out and "cp = 1 only" in out
    assert main(["plan", "--model", model, "--hardware", "h200-sxm", "--devices", "256", "--search", "--top", "3"]) == 0
    assert "cp=" not in capsys.readouterr().out  # every layout searched has cp = 1


DRY_RUN = "-m trex train recipes/kimi_k2_sft.toml --dry-run --world-size 1024"


@pytest.mark.slow
def test_kimi_k2_recipe_at_1024_ranks():
    """A 1,026B-parameter model under FSDP2 + EP128 on a fake 1,024-rank process group, on this CPU (~15 s)."""
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "src")}
    proc = subprocess.run([sys.executable, *shlex.split(DRY_RUN)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "efsdp 8 x ep 128" in proc.stdout
    total = float(re.search(r"model parameters: ([\d,.]+)B", proc.stdout)[1].replace(",", "")) * 1e9
    assert total == pytest.approx(count_parameters(get_preset("kimi-k2")).total, abs=0.05e9)
    per_rank = float(re.search(r"\(([\d.]+)B elements\)", proc.stdout)[1]) * 1e9
    assert total / 1024 * 0.99 <= per_rank <= total / 1024 * 1.02
    assert float(re.search(r"total before activations\s+([\d.]+) GiB", proc.stdout)[1]) < 20
