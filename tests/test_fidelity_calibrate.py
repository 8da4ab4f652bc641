"""Calibration: the reference's own run-to-run spread, measured, stored in the golden file, and
used by compare (noted where a threshold is tighter, or widened to it)."""

from __future__ import annotations

import json
import os

import pytest

from trex.cli import main
from trex.fidelity.calibrate import run_plan, vary_sets
from trex.fidelity.compare import compare
from trex.fidelity.profiles import get_profile
from trex.fidelity.runs import FidelityInputError, load_signals
from test_fidelity_compare import CURVE, write_run
from trex_run import trex

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = os.path.join(ROOT, "recipes", "fidelity_default.toml")


def test_the_plan_cycles_threads_and_variations_and_needs_two_runs():
    plan = run_plan(4, [1, 2], vary_sets(["train.grad_accum=2;data.micro_batch_size=2"]))
    assert [p["threads"] for p in plan] == [1, 2, 1, 2]
    assert plan[0]["overrides"] == [] and plan[3]["overrides"] == ["train.grad_accum=2", "data.micro_batch_size=2"]
    with pytest.raises(ValueError, match="at least 2 runs"):
        run_plan(1, [1], [])


def _golden_with_spread(tmp_path, spread: dict) -> str:
    from trex.fidelity.golden import export

    path = str(tmp_path / "golden.json")
    data = export(str(write_run(tmp_path / "ref", CURVE)), path)
    data["envelope"] = {"spread": spread, "loss": {"steps": [1, 2], "min": [3.4, 3.3], "max": [3.6, 3.5]}}
    open(path, "w").write(json.dumps(data))
    return path


def test_compare_notes_a_threshold_tighter_than_the_spread_or_widens_it(tmp_path):
    golden = _golden_with_spread(tmp_path, {"layout": {"loss_mean_rel_err": 0.01, "probe_kl": 0.0}})
    run = load_signals(str(write_run(tmp_path / "run", [v * 1.005 for v in CURVE])))
    noted = compare(run, load_signals(golden), get_profile("layout"))
    check = next(c for c in noted.checks if c.measure == "loss_mean_rel_err")
    assert check.spread == 0.01 and check.status == "FAIL" and len(noted.notes) == 1
    assert "tighter than the reference's own spread" in noted.notes[0]
    assert noted.curves["envelope_lo"][:2] == [3.4, 3.3]
    widened = compare(run, load_signals(golden), get_profile("layout"), envelope="widen")
    check = next(c for c in widened.checks if c.measure == "loss_mean_rel_err")
    assert check.threshold == 0.01 and check.status == "PASS" and "widened" in check.detail
    other = compare(run, load_signals(golden), get_profile("precision"))  # no spread measured for it
    assert all(c.spread is None for c in other.checks)


def test_a_reference_calibrated_per_layer_group_separates_a_noisy_group_from_a_defect(tmp_path):
    """Issue 53: on the default recipe two correct bf16 op orders move the mHC groups' gradient norms
    by ~100% (and the quiet groups by far less); a bound widened to the worst group's spread would let
    a real defect in a quiet group through. Calibrated per group, the noisy group passes by its own
    spread and the defect still fails in its group."""
    from trex.fidelity.calibrate import envelope

    ref_dir = write_run(tmp_path / "ref", CURVE)
    noise = write_run(tmp_path / "noise", CURVE, layer_scale={"layers.0.ffn": 2.0})  # a noisy-by-construction group
    golden = _golden_with_spread(tmp_path, {})
    data = json.load(open(golden))
    data["envelope"] = envelope([load_signals(str(ref_dir)), load_signals(str(noise))])
    assert data["envelope"]["group_spread"]["vendor"]["layer_grad_norm_rel_err"]["layers.0.ffn"] == pytest.approx(1.0)
    open(golden, "w").write(json.dumps(data))
    reference = load_signals(golden)

    def judged(layer_scale):
        run = load_signals(str(write_run(tmp_path / f"run{len(layer_scale)}", CURVE, layer_scale=layer_scale)))
        result = compare(run, reference, get_profile("vendor"), envelope="widen")
        return next(c for c in result.checks if c.measure == "layer_grad_norm_rel_err")

    noisy = judged({"layers.0.ffn": 1.9})
    assert noisy.status == "PASS" and "layers.0.ffn" in noisy.detail
    defect = judged({"layers.0.ffn": 1.9, "layers.0.attn": 1.5})  # 50% in a group whose spread is 0
    assert defect.status == "FAIL" and "layers.0.attn" in defect.detail and defect.threshold == 0.2
    noted = compare(load_signals(str(noise)), reference, get_profile("vendor"))
    assert any("layers.0.ffn" in note for note in noted.notes)


@pytest.mark.parametrize("spread, message", [({"layout": {"nonsense": 1.0}}, "not a measure"),
                                             ({"layout": {"probe_kl": -1}}, "expected a number >= 0"),
                                             ({"probe_kl": 1.0}, "expected a `spread` object")])
def test_a_bad_envelope_names_the_key(tmp_path, spread, message):
    with pytest.raises(FidelityInputError, match=message):
        load_signals(_golden_with_spread(tmp_path, spread))


def test_a_bad_per_step_spread_names_the_group_and_step(tmp_path):
    path = _golden_with_spread(tmp_path, {})
    data = json.load(open(path))
    data["envelope"]["group_step_spread"] = {"vendor": {"layers.0.hc": {"5": 0.1, "last": 0.2}}}
    open(path, "w").write(json.dumps(data))
    with pytest.raises(FidelityInputError, match=r"group_step_spread\.vendor\.layers\.0\.hc\.last: expected a step"):
        load_signals(path)


@pytest.mark.slow
def test_calibrate_measures_the_spread_of_a_reduction_order_and_compare_uses_it(tmp_path, capsys):
    golden, out = tmp_path / "golden.json", tmp_path / "cal"
    cmd = ["fidelity", "calibrate", RECIPE, "--golden", str(golden), "--out", str(out), "--runs", "2",
           "--set", "train.steps=4", "--vary", "data.micro_batch_size=2;train.grad_accum=2"]
    proc = trex(cmd)  # the runs are `trex train` processes of their own (forked from a warm one: tests/trex_run.py)
    assert proc.returncode == 0, proc.stderr[-3000:]
    printed = proc.stdout
    envelope = json.load(open(golden))["envelope"]
    assert envelope["runs"] == 2 and envelope["variation"][1]["threads"] == 2
    layout = envelope["spread"]["layout"]
    assert 0 < layout["loss_mean_rel_err"] < 1e-5  # a different summation order: not bitwise, far inside layout
    assert "| loss_mean_rel_err |" in printed
    report = json.load(open(out / "calibration.json"))
    assert "loss_mean_rel_err" not in report["tighter_than_spread"]
    lo, hi = envelope["loss"]["min"], envelope["loss"]["max"]
    assert len(lo) == 4 and all(a <= b for a, b in zip(lo, hi))
    # the second run against the golden file: bitwise fails, and says the reference itself is not bitwise
    bitwise = ["fidelity", "compare", str(out / "run-1"), str(golden), "--profile", "bitwise",
               "--out", str(tmp_path / "report")]
    assert main(bitwise) == 1 and "tighter than the reference's own spread" in capsys.readouterr().out
    assert main([*bitwise, "--envelope", "widen"]) == 0
    capsys.readouterr()
    assert main(cmd) == 2  # --out holds the runs now
    err = capsys.readouterr().err
    assert "--overwrite" in err and err.count("\n") == 1


def test_calibrations_from_two_machines_merge_into_one_envelope_that_names_its_sources(tmp_path, capsys):
    """Machine B's calibration (the committed golden file, as if calibrated on another device and host,
    with a wider spread of one measure and wider loss bounds) merged with machine A's: each measure's
    spread is the larger, named by its machine; the loss bounds span both; compare reads the result."""
    golden_a = os.path.join(ROOT, "fidelity", "golden", "default_cpu_fp32.json")
    data = json.load(open(golden_a))
    b = json.loads(json.dumps(data))
    b["environment"].update(device_name="virtual accelerator", host="cluster-b")
    b["envelope"]["spread"]["layout"]["loss_mean_rel_err"] = 10 * data["envelope"]["spread"]["layout"]["loss_mean_rel_err"] + 1e-6
    b["envelope"]["loss"]["max"] = [v + 0.5 for v in b["envelope"]["loss"]["max"]]
    b["envelope"]["group_step_spread"] = {"vendor": {"layers.0.hc": {"5": 0.02, "20": 0.3}}}
    (tmp_path / "b.json").write_text(json.dumps(b))
    merged_path = tmp_path / "merged.json"
    capsys.readouterr()
    assert main(["fidelity", "calibrate", "--merge", golden_a, "--merge", str(tmp_path / "b.json"),
                 "--golden", str(merged_path)]) == 0
    printed = capsys.readouterr().out
    merged = json.loads(merged_path.read_text())["envelope"]
    assert merged["spread"]["layout"]["loss_mean_rel_err"] == b["envelope"]["spread"]["layout"]["loss_mean_rel_err"]
    assert merged["spread_from"]["layout"]["loss_mean_rel_err"] == "virtual accelerator on cluster-b (b.json)"
    others = [m for m in merged["spread_from"]["layout"] if m != "loss_mean_rel_err"]
    assert others and all(merged["spread_from"]["layout"][m].endswith("(default_cpu_fp32.json)") for m in others)
    assert merged["loss"]["max"] == b["envelope"]["loss"]["max"] and merged["loss"]["min"] == data["envelope"]["loss"]["min"]
    assert merged["runs"] == 2 * data["envelope"]["runs"] and "virtual accelerator on cluster-b" in printed
    assert load_signals(str(merged_path)).envelope["spread"] == merged["spread"]  # compare reads it
    assert merged["group_step_spread"]["vendor"]["layers.0.hc"] == {"5": 0.02, "20": 0.3}  # per step, the larger
    b["config"]["optim"]["lr"] = 1.0
    (tmp_path / "other.json").write_text(json.dumps(b))
    assert main(["fidelity", "calibrate", "--merge", golden_a, "--merge", str(tmp_path / "other.json"),
                 "--golden", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err
    assert "[optim] differs" in err and err.count("\n") == 1
