"""`trex profile`: the step by class under torch.profiler, and its estimate on hardware profiles."""

from __future__ import annotations

import contextlib
import io
import json

import pytest
import torch

from trex.cli import main
from trex.hardware import HardwareProfile
from trex.models.common.moe import Gate
from trex.profile.classes import Unit
from trex.profile.estimate import estimate, fused, unit_seconds

# the fidelity recipe, one row of 64 tokens, AdamW: a step of a few hundred ms
SMALL = ["recipes/fidelity_default.toml", "--set", "data.micro_batch_size=1", "--set", 'optim.name="adamw"',
         "--warmup", "1", "--steps", "1"]


def _profile(tmp_path, capsys, *extra) -> dict:
    code = main(["profile", *SMALL, "--out", str(tmp_path / "p"), "--format", "json", "--hardware", "h200-sxm",
                 *extra])
    out = capsys.readouterr().out
    assert code == 0, out
    return json.loads(out)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["profile", *SMALL, "--out", str(tmp_path_factory.mktemp("profile") / "p"), "--format", "json",
                     "--hardware", "h200-sxm", "--as-dtype", "bf16"])
    assert code == 0
    return json.loads(out.getvalue())


def test_the_classes_add_up_to_the_measured_step_and_name_every_part(report):
    assert abs(report["sum_vs_step"] - 1) < 0.05  # against the wall clock between step ends
    got = {c["class"]: c for c in report["classes"]}
    for part in ("dense_gemm", "moe/expert_gemm", "attention/sliding", "attention/csa", "attention/hca", "moe/route",
                 "moe/dispatch", "norm_mhc", "head_loss", "optimizer/update", "host/python"):
        assert got[part]["time_s"] > 0, part
    assert "optimizer/muon_ns" not in got  # AdamW: no Newton-Schulz
    assert sum(c["share"] for c in report["classes"]) == pytest.approx(report["sum_vs_step"])
    assert report["optimizer_share"] == pytest.approx(got["optimizer/update"]["share"])
    assert report["tokens_per_s"] == pytest.approx(report["tokens_per_step"] / report["step_s"])


def test_forward_and_backward_flops_agree_with_the_model_count(report):
    """Every GEMM and attention kernel, forward and backward (classed through autograd's sequence
    numbers), against trex.models.flops: a missed backward reads ~1/3, a double count ~2x."""
    measured = sum(c["flops"] or 0 for c in report["classes"] if not c["class"].startswith("optimizer/"))
    model = report["model_flops_per_token"] * report["tokens_per_step"]
    assert 0.8 < measured / model < 1.4, (measured, model)


def test_the_run_directory_holds_the_report_and_a_chrome_trace_with_the_parts(report):
    with open(report["trace"]) as f:
        trace = json.load(f)
    names = {e.get("name") for e in trace["traceEvents"]}
    assert {"trex/attention/csa", "trex/moe/experts", "trex/norm_mhc"} <= names
    with open(f"{report['run_dir']}/profile.json") as f:
        assert json.load(f)["step_s"] == report["step_s"]
    (h200,) = report["estimates"]
    assert h200["hardware"] == "h200-sxm" and h200["as_dtype"] == "bf16"
    assert 0 < h200["compiled_s"] <= h200["eager_s"] < report["step_s"]


def test_a_planted_slow_op_lands_in_its_class(tmp_path, capsys, monkeypatch):
    forward = Gate.forward

    def slow(self, x, *args, **kwargs):
        y = torch.randn(256, 256) / 16
        for _ in range(60):
            y = (y @ y).tanh()  # GEMMs, but inside the router: moe/route, not dense_gemm
        return forward(self, x + 0 * y.sum(), *args, **kwargs)

    monkeypatch.setattr(Gate, "forward", slow)
    got = {c["class"]: c for c in _profile(tmp_path, capsys, "--warmup", "0")["classes"]}
    biggest = max(got.values(), key=lambda c: c["time_s"])
    assert biggest["class"] == "moe/route", {k: round(v["share"], 3) for k, v in got.items()}
    assert got["moe/route"]["flops"] >= 60 * 2 * 256**3 * 2  # both MoE layers' planted GEMMs, counted there


@pytest.mark.parametrize("args, expected", [
    (["no/such/recipe.toml"], "no/such/recipe.toml"),
    ([*SMALL, "--hardware", "h300"], "no hardware profile h300; known: "),
    ([*SMALL, "--steps", "0"], "expected steps >= 1"),
    ([*SMALL, "--set", "optim.lr=fast"], "optim.lr"),
])
def test_a_profile_it_cannot_run_is_one_line_and_exit_2(args, expected, tmp_path, capsys):
    code = main(["profile", *args, "--out", str(tmp_path / "p")])
    err = capsys.readouterr().err
    assert code == 2 and expected in err and len(err.strip().splitlines()) == 1, err


def test_an_absent_device_is_one_line(tmp_path, capsys):
    code = main(["--device", "no_such_device", "profile", *SMALL, "--out", str(tmp_path / "p")])
    err = capsys.readouterr().err
    assert code != 0 and len(err.strip().splitlines()) == 1 and "no_such_device" in err, err


HW = HardwareProfile(name="x", unit="card", peak_tflops={"bf16": 100.0, "fp32": 10.0}, memory_gib=80,
                     intra_node_gbps=1, inter_node_gbps=1, devices_per_node=8, memory_gbps=1000.0, kernel_us=5.0)


def test_the_estimate_is_the_roofline_with_a_kernel_floor():
    gemm = Unit("aten::mm", "dense_gemm", "forward", flops=2e12, bytes=1e9, dtype="bf16")
    assert unit_seconds(gemm, HW) == pytest.approx(2e12 / 100e12)  # compute-bound
    copy = Unit("aten::copy_", "other", "forward", flops=0, bytes=4e9, dtype="fp32")
    assert unit_seconds(copy, HW) == pytest.approx(4e9 / 1000e9)  # memory-bound
    tiny = Unit("aten::add", "other", "forward", flops=0, bytes=8, dtype="fp32")
    est = estimate([gemm, copy, tiny], HW, steps=1)
    assert est["eager_s"] == pytest.approx(0.02 + 0.004 + 5e-6)
    # fp32 work priced as bf16: half the bytes, the bf16 peak; norms and mHC stay fp32 by design
    fp32_gemm = Unit("aten::mm", "dense_gemm", "forward", flops=2e12, bytes=1e9, dtype="fp32")
    assert unit_seconds(fp32_gemm, HW, "bf16") == pytest.approx(0.02)
    norm = Unit("aten::mul", "norm_mhc", "forward", flops=0, bytes=4e9, dtype="fp32")
    assert unit_seconds(norm, HW, "bf16") == unit_seconds(norm, HW)


def test_compiled_fuses_consecutive_memory_bound_ops_of_one_class_and_phase():
    m = [Unit(f"aten::op{i}", "norm_mhc", "forward", 0, b, "fp32") for i, b in enumerate((1e6, 3e6, 2e6))]
    gemm = Unit("aten::mm", "norm_mhc", "forward", 1e9, 1e6, "fp32")
    back = Unit("aten::mul", "norm_mhc", "backward", 0, 5e6, "fp32")
    kernels = fused([*m, gemm, *m, back])
    assert [(k.name, k.bytes, k.launches) for k in kernels] == [
        ("aten::op0", 3e6, 3), ("aten::mm", 1e6, 1), ("aten::op0", 3e6, 3), ("aten::mul", 5e6, 1)]
    est = estimate([*m, gemm], HW, steps=1)
    assert est["classes"]["norm_mhc"]["kernels_eager"] == 4 and est["classes"]["norm_mhc"]["kernels_compiled"] == 2
    assert est["compiled_s"] < est["eager_s"]


def test_meta_records_the_step_without_running_it(tmp_path, capsys):
    """--meta: the recipe's step on the meta device (no data, no time), its FLOPs the model's."""
    code = main(["profile", "recipes/fidelity_default.toml", "--meta", "--as-dtype", "bf16", "--hardware", "h200-sxm",
                 "--format", "json", "--out", str(tmp_path / "m")])
    out = capsys.readouterr().out
    assert code == 0, out
    r = json.loads(out)
    assert r["device"] == "meta" and r["dtype"] == "bf16" and r["tokens_per_step"] == 4 * 64
    flops = sum(c["flops"] or 0 for c in r["classes"] if not c["class"].startswith("optimizer/"))
    assert 0.8 < flops / (r["model_flops_per_token"] * r["tokens_per_step"]) < 1.4
    (h200,) = r["estimates"]
    assert 0 < h200["optimizer_share_compiled"] < 1 and h200["mfu_compiled_forward_backward"] > h200["mfu_compiled"]


def test_gradient_accumulation_prices_forward_and_backward_per_micro_batch_and_the_optimizer_once():
    fwd = Unit("aten::mm", "dense_gemm", "forward", 2e12, 1e9, "bf16")
    bwd = Unit("aten::mm", "dense_gemm", "backward", 4e12, 2e9, "bf16")
    opt = Unit("aten::bmm", "optimizer/muon_ns", "optimizer", 1e12, 1e9, "bf16")
    one, eight = (estimate([fwd, bwd, opt], HW, steps=1, micro_batches=n) for n in (1, 8))
    assert eight["classes"]["dense_gemm"]["eager_s"] == pytest.approx(8 * one["classes"]["dense_gemm"]["eager_s"])
    assert eight["classes"]["optimizer/muon_ns"] == one["classes"]["optimizer/muon_ns"]
    assert eight["classes"]["dense_gemm"]["kernels_eager"] == 16


def test_on_a_plugged_device_without_kernel_timing_the_host_ops_time_the_classes(tmp_path):
    """The virtual accelerator (a PrivateUse1 plugin, trex_vdev) records no kernel times: the classes are
    its host ops', not an all-idle device. A process of its own (forked from a warm one, tests/trex_run.py): an
    imported plugin stays the accelerator."""
    from trex_run import trex

    proc = trex(["profile", *SMALL, "--set", 'train.device="vdev"', "--warmup", "0", "--out", str(tmp_path / "p"),
                 "--format", "json", "--hardware", "h200-sxm"], env={"TREX_DEVICE_PLUGINS": "trex_vdev"}, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = json.loads(proc.stdout)
    assert r["device"].startswith("vdev") and r["timing"] == "host ops"
    got = {c["class"]: c for c in r["classes"]}
    assert got["dense_gemm"]["time_s"] > 0 and "device/idle" not in got
    assert abs(r["sum_vs_step"] - 1) < 0.05


@pytest.mark.parametrize("preset, scopes", [
    ("tiny", {"attention/sliding", "attention/csa", "attention/hca", "norm_mhc"}),
    ("tiny-v4.1", {"attention/sliding", "attention/csa", "norm_mhc"}),
    ("tiny-v3", {"attention/mla"}),
    ("tiny-v3.2", {"attention/dsa"}),
])
def test_every_familys_modules_name_their_scope(preset, scopes):
    """Each family's own modules name their profile scope (``profile_scope``); the profiler imports no family.
    V4.1's attention has no ``layer_type``: the old by-class lookup raised on it."""
    from trex.models import build_model, get_preset
    from trex.profile.scopes import scope_of

    named = {scope_of(m) for m in build_model(get_preset(preset), device="meta").modules()}
    assert scopes <= named and {"linear", "moe/route", "moe/experts"} <= named, named
    assert not {s for s in named if s and s.startswith("attention/")} - scopes
