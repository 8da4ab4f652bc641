"""trex plan: parameter counts, layout checks, memory and time models, search, command line."""

import dataclasses
import json
import re

import pytest

from trex.cli import main
from trex.hardware import HardwareProfile, load_profiles
from trex.models import build_model, count_parameters, get_preset
from trex.models.common.plan_terms import FUNCTIONS
from trex.models.deepseek_v4.config import tiny
from trex.models.registry import ARCHITECTURES
from trex.parallel.mesh import resolve_layout
from trex.plan import Layout, PlanError, TimeAssumptions, annotate, fewest_devices, make_plan, parse_layout, search
from trex.plan.model_facts import model_facts
from trex.plan.planner import device_counts

H100 = load_profiles()["h100-sxm"]
FLASH = get_preset("deepseek-v4-flash")


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_every_architecture_provides_the_planners_terms(name):
    """Each architecture's plan_terms module defines every function trex.models.common.plan_terms lists (the
    planner calls them through trex.plan.terms): a family that lacks one fails here, not halfway through a plan."""
    module = ARCHITECTURES[name].load("plan_terms")
    assert [f for f in FUNCTIONS if not callable(getattr(module, f, None))] == []


def test_parameter_counts_are_the_meta_model_and_split_by_type():
    for name in ("tiny", "deepseek-v4-flash"):
        cfg = get_preset(name)
        facts, ref = model_facts(cfg), count_parameters(cfg)
        assert (facts.total, facts.active, facts.mtp) == (ref.total, ref.active, ref.mtp)
        assert sum(facts.by_type.values()) == facts.total
        model = build_model(cfg, device="meta")
        experts = sum(p.numel() for n, p in model.named_parameters() if ".ffn.experts." in n)
        indexer = sum(p.numel() for n, p in model.named_parameters() if ".attn.indexer." in n)
        assert facts.experts == experts and facts.trainable == facts.stored - indexer
        assert facts.muon + facts.adamw == facts.trainable and facts.adamw >= facts.by_type["embedding"] * 2


def test_the_printed_total_counts_every_parameter_the_trained_ones_among_them(capsys):
    args = ["plan", "--model", "deepseek-v4-flash", "--hardware", "h200-sxm", "--seq", "4096", "--layout",
            "dp_shard=64,ep=64", "--recompute", "full"]
    assert main(args) == 0
    line = next(s for s in capsys.readouterr().out.splitlines() if s.startswith("parameters"))
    total, main_model, mtp = (float(x) for x in re.search(r"([\d.]+)B total = ([\d.]+)B main model .* \+ ([\d.]+)B MTP",
                                                          line).groups())
    trained = float(re.search(r"([\d.]+)B of them trained", line).group(1))
    every = sum(p.numel() for p in build_model(FLASH, device="meta").parameters())
    counted = count_parameters(FLASH)
    assert total == round(every / 1e9, 1) == round((counted.total + counted.mtp) / 1e9, 1) >= trained, line
    assert main_model == round(counted.total / 1e9, 1) and mtp == round(counted.mtp / 1e9, 1), line
    assert main([*args, "--format", "json"]) == 0
    p = json.loads(capsys.readouterr().out)["parameters"]
    assert p["total_with_mtp"] == every == p["total"] + p["mtp"] and p["total_with_mtp"] >= p["trainable"]


def test_a_layout_without_expert_parallelism_says_why(capsys):
    assert main(["plan", "--model", "deepseek-v4-flash", "--hardware", "h200-sxm", "--seq", "4096", "--devices",
                 "63"]) == 0
    out = capsys.readouterr().out
    assert "ep=1" in out and "note        expert parallelism off (ep=1): ep must divide both dp_shard=63 and the " \
                             "model's 256 routed experts" in out and "e.g. --devices 64 (dp_shard=64)" in out, out
    assert main(["plan", "--model", "deepseek-v4-flash", "--hardware", "h200-sxm", "--seq", "4096", "--devices", "63",
                 "--format", "json"]) == 0
    assert any(n.startswith("expert parallelism off") for n in json.loads(capsys.readouterr().out)["notes"])
    # the suggested count does split the experts; a layout that chose ep=1 where ep could be wider has no note
    assert not any("expert parallelism" in n for n in make_plan(FLASH, Layout(dp_shard=64, ep=64), 4096, H100).notes)
    assert not any("expert parallelism" in n for n in make_plan(FLASH, Layout(dp_shard=64), 4096, H100).notes)


def test_bad_input_gets_a_clear_error(capsys):
    with pytest.raises(PlanError, match="does not divide the model's 256 routed experts"):
        make_plan(FLASH, Layout(dp_shard=96, ep=96), 4096, H100)
    with pytest.raises(PlanError, match="does not divide the model's 43 layers"):
        make_plan(FLASH, Layout(dp_shard=8, pp=2), 4096, H100)
    with pytest.raises(PlanError, match="max_position_embeddings"):
        make_plan(FLASH, Layout(dp_shard=8), FLASH.max_position_embeddings + 1, H100)
    with pytest.raises(PlanError, match="ep=16 must divide dp_shard=8"):
        make_plan(FLASH, Layout(dp_shard=8, ep=16), 4096, H100)
    with pytest.raises(PlanError, match="key=value"):
        parse_layout("dp_shard=8,colour=red", Layout(dp_shard=1))
    assert main(["plan", "--model", "deepseek-v4-flash", "--hardware", "tpu-v9", "--seq", "4096"]) == 2
    assert "unknown hardware 'tpu-v9'" in capsys.readouterr().err


def test_state_shrinks_with_shards_and_recompute_trades_memory_for_time():
    base = Layout(dp_shard=64, ep=32)
    plans = {rc: make_plan(FLASH, dataclasses.replace(base, recompute=rc), 4096, H100)
             for rc in ("none", "selective", "full")}
    acts = [plans[rc].memory.activations for rc in ("none", "selective", "full")]
    work = [plans[rc].time.recompute for rc in ("none", "selective", "full")]
    times = [plans[rc].time.total for rc in ("none", "selective", "full")]
    assert acts[0] > acts[1] > acts[2] and work[0] == 0 < work[1] < work[2]
    assert times == sorted(times)  # recompute can hide behind communication, never make a step faster
    ep = [plans[rc].time.ep_comm for rc in ("none", "selective", "full")]
    assert ep[1] == ep[0] and ep[2] == pytest.approx(1.5 * ep[0])  # a full recompute dispatches and combines again
    wide = make_plan(FLASH, dataclasses.replace(base, dp_shard=128), 4096, H100)
    assert wide.memory.weights == pytest.approx(plans["none"].memory.weights / 2)
    # fp32 parameters (the masters) and gradients, Muon momentum / AdamW moments, all sharded
    f = model_facts(FLASH)
    m = plans["none"].memory
    assert m.weights + m.gradients + m.optimizer == pytest.approx(
        (4 * f.stored + 4 * f.trainable + 4 * f.muon + 8 * f.adamw) / 64)
    off = make_plan(FLASH, dataclasses.replace(base, offload_optimizer=True), 4096, H100)
    assert off.memory.optimizer == 0 and off.memory.optimizer_host == m.optimizer
    assert off.time.optimizer > plans["none"].time.optimizer


def test_reducing_every_micro_batch_trades_accumulated_gradients_for_reduce_scatters():
    base = Layout(dp_shard=64, ep=32, grad_accum=8)
    once = make_plan(FLASH, base, 4096, H100)
    every = make_plan(FLASH, dataclasses.replace(base, reduce_every_micro_batch=True), 4096, H100)
    f = model_facts(FLASH)
    unsharded = 4 * (f.trainable - f.experts + f.experts / 32)  # FSDP2's no-sync accumulation, fp32
    assert once.memory.accumulated_gradients == pytest.approx(unsharded)
    assert every.memory.accumulated_gradients == pytest.approx(4 * f.trainable / 64)  # sharded, fp32
    assert every.memory.step_peak < once.memory.step_peak
    assert every.time.total > once.time.total  # grad_accum reduce-scatters instead of one
    assert "reduce-every-micro-batch" in every.layout.describe()
    assert parse_layout("reduce_every_micro_batch=true", base).reduce_every_micro_batch


def test_mfu_uses_the_training_flops_formula_and_the_profile_peak():
    """One device, no communication, AdamW (no Newton-Schulz), no recompute: MFU is the efficiency."""
    cfg = tiny()
    hw = HardwareProfile(name="x", unit="card", peak_tflops={"bf16": 100.0}, memory_gib=80, intra_node_gbps=100,
                         inter_node_gbps=10, devices_per_node=8)
    plan = make_plan(cfg, Layout(dp_shard=1, optimizer="adamw", grad_accum=4), 512, hw,
                     TimeAssumptions(compute_efficiency=0.4))
    assert plan.time.exposed_comm == 0 and plan.mfu == pytest.approx(0.4)
    assert plan.global_batch_tokens == 4 * 512


def test_search_returns_fitting_layouts_fastest_first_at_the_requested_batch():
    plans = search(FLASH, 64, 4096, 64 * 4096 * 4, load_profiles()["h200-sxm"])
    assert plans and all(p.fits and p.layout.devices == 64 for p in plans)
    assert all(p.global_batch_tokens == 64 * 4096 * 4 for p in plans)
    assert [p.time.total for p in plans] == sorted(p.time.total for p in plans)
    assert not search(FLASH, 8, 4096, 8 * 4096, H100)  # 284B parameters do not fit on one node


def test_cli_plans_a_recipe_and_a_user_hardware_profile(tmp_path, monkeypatch, capsys):
    (tmp_path / "big.toml").write_text(
        'name = "big"\nunit = "card"\npeak_tflops = { bf16 = 1000.0 }\nmemory_gib = 4096\nintra_node_gbps = 400\n'
        'inter_node_gbps = 50\ndevices_per_node = 8\nsource = "test"\n')
    monkeypatch.setenv("TREX_HARDWARE_DIR", str(tmp_path))
    recipe = "recipes/deepseek_v4_flash_sft.toml"  # dp_shard = -1: every rank
    assert main(["plan", recipe, "--hardware", "big"]) == 2
    assert "--devices" in capsys.readouterr().err
    assert main(["plan", recipe, "--hardware", "big", "--devices", "64", "--format", "json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["fits"] and out["layout"]["devices"] == 64 and out["parameters"]["total"] == model_facts(FLASH).total
    assert main(["plan", "--model", "deepseek-v4-flash", "--hardware", "big", "--seq", "4096", "--devices", "16",
                 "--layout", "dp_shard=16,ep=16", "--global-batch-tokens", str(16 * 4096 * 2)]) == 0
    assert "ga=2" in capsys.readouterr().out


@pytest.mark.parametrize("model, hardware", [("deepseek-v4-flash", "h200-sxm"), ("deepseek-v4-flash", "ascend-910c-die"),
                                             ("deepseek-v4-pro", "h200-sxm"), ("deepseek-v4-pro", "ascend-910c-die"),
                                             ("deepseek-v4.1-flash", "h200-sxm")])
def test_the_fewest_devices_that_fit_are_found(model, hardware):
    cfg, hw = get_preset(model), load_profiles()[hardware]
    found = fewest_devices(cfg, 4096, hw)
    assert found.plans and all(p.fits and p.layout.devices == found.devices for p in found.plans)
    for p in found.plans:  # every one a layout trex train runs: its mesh accepts it (ep inside dp_shard)
        lay = p.layout
        assert lay.pp == 1 and resolve_layout(lay.dp_replicate, lay.dp_shard, lay.ep, lay.devices, lay.cp, lay.tp)
    assert [p.time.total for p in found.plans] == sorted(p.time.total for p in found.plans)
    assert found.fewer == max(n for n in device_counts(hw) if n < found.devices)  # the count just below was tried
    assert not search(cfg, found.fewer, 4096, found.fewer * 4096, hw)  # and no layout fits there


def test_how_many_devices_on_the_command_line_as_json(capsys):
    assert main(["plan", "--model", "deepseek-v4-flash", "--hardware", "h200-sxm", "--format", "json"]) == 0
    out = json.loads(capsys.readouterr().out)
    fewest = out["fewest_devices"]
    assert out["fits"] and out["layout"]["devices"] == fewest["devices"] and fewest["fewer_do_not_fit"] < fewest["devices"]
    assert out["model"] == "deepseek-v4-flash" and fewest["layouts_that_fit"] >= 1 and out["reasons"] == []
    assert main(["plan", "--model", "deepseek-v4-flash", "--hardware", "h200-sxm"]) == 0
    said = capsys.readouterr().out
    assert f"fewest devices that fit: {fewest['devices']} x h200-sxm; {fewest['fewer_do_not_fit']} do not fit" in said


def test_json_is_json_whatever_the_answer(capsys):
    # no layout fits: the reasons name only what the search did not try
    assert main(["plan", "--model", "deepseek-v4-flash", "--hardware", "h200-sxm", "--devices", "8", "--format",
                 "json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["fits"] is False and "add devices" in out["reasons"][0] and "allow recompute" not in out["reasons"][0]
    # a batch no layout reaches
    assert main(["plan", "--model", "tiny", "--hardware", "h200-sxm", "--devices", "6", "--global-batch-tokens",
                 str(4 * 4096), "--search", "--format", "json"]) == 1  # 4 sequences: dp 1 or 2, cp 6 or 3
    assert "must split evenly" in json.loads(capsys.readouterr().out)["reasons"][0]
    # a layout that does not fit states its total against usable
    assert main(["plan", "--model", "deepseek-v4-pro", "--hardware", "h200-sxm", "--devices", "8", "--layout",
                 "dp_shard=8,ep=8", "--format", "json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert not out["fits"] and f"needs {out['memory_bytes']['total'] / 2**30:.1f} GiB per device" in out["reasons"][0]
    # a user fault
    assert main(["plan", "--model", "nope", "--hardware", "h200-sxm", "--format", "json"]) == 2
    out, err = capsys.readouterr()
    assert "not a preset" in json.loads(out)["error"] and err.count("\n") == 1
    # the hardware list
    assert main(["plan", "--hardware", "list", "--format", "json"]) == 0
    profiles = json.loads(capsys.readouterr().out)
    assert {p["name"] for p in profiles} >= {"h200-sxm", "ascend-910c-die"} and all("source" in p for p in profiles)


@pytest.mark.parametrize("flag, value", [("--seq", "0"), ("--efficiency", "0"), ("--efficiency", "-0.5"),
                                         ("--efficiency", "1.5"), ("--fsdp-overlap", "1.5"), ("--ep-overlap", "-1"),
                                         ("--devices", "0"), ("--global-batch-tokens", "0"), ("--top", "0")])
def test_numbers_out_of_range_are_one_line(flag, value, capsys):
    assert main(["plan", "--model", "deepseek-v4-flash", "--hardware", "h200-sxm", flag, value]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"trex plan: {flag} ") and "expected" in err and err.count("\n") == 1


def test_a_recipe_alone_plans_the_clusters_its_header_names(capsys):
    recipe = "recipes/deepseek_v4_pro_sft.toml"
    named = annotate.targets(open(recipe).read())
    assert main(["plan", recipe, "--format", "json"]) == 0
    plans = json.loads(capsys.readouterr().out)
    assert [(p["layout"]["devices"], p["hardware"]["name"]) for p in plans] == [(t.devices, t.hardware) for t in named]
    assert all(p["fits"] for p in plans)


def test_the_compute_efficiency_can_come_from_a_profile(tmp_path, capsys):
    """`trex plan --efficiency-from`: a `trex profile` report's compiled forward + backward estimate on
    the planned hardware (or, measured on that device type, its forward + backward MFU)."""
    estimated = tmp_path / "meta.json"
    estimated.write_text(json.dumps({"device": "meta", "classes": [], "mfu": None, "estimates": [
        {"hardware": "h200-sxm", "mfu_compiled_forward_backward": 0.254}]}))
    measured = tmp_path / "device.json"
    measured.write_text(json.dumps({"device": "cuda:0", "classes": [], "mfu": 0.2, "optimizer_share": 0.2,
                                    "estimates": []}))
    base = ["plan", "--model", "deepseek-v4-flash", "--seq", "4096", "--devices", "64", "--hardware", "h200-sxm"]
    for path, expected in ((estimated, "compute efficiency 25%"), (measured, "compute efficiency 25%")):
        assert main([*base, "--efficiency-from", str(path)]) in (0, 1)
        assert expected in capsys.readouterr().out
    for path, expected in ((estimated, "no measurement on a ascend-910c-die and no estimate for it"),
                           (tmp_path / "none.json", "not a trex profile report")):
        code = main(["plan", "--model", "deepseek-v4-flash", "--seq", "4096", "--devices", "64", "--hardware", "ascend-910c-die",
                     "--efficiency-from", str(path)])
        err = capsys.readouterr().err
        assert code == 2 and expected in err and len(err.strip().splitlines()) == 1, err
