"""Fidelity comparison without training: measures, verdicts, profiles and bad input, on small
synthetic runs written as run directories and golden files."""

from __future__ import annotations

import dataclasses
import json
import math
import os

import pytest

from trex.cli import main
from trex.fidelity.compare import compare, position_kl
from trex.fidelity.golden import export
from trex.fidelity.profiles import PROFILES, get_profile, parse_overrides
from trex.fidelity.runs import FidelityInputError, load_signals
from trex.train.signals import layer_group

GROUPS = ("embed", "layers.0.attn", "layers.0.ffn", "head")


def _probe(step, shift=0.0):
    logp = [math.log(p) for p in (0.5, 0.2, 0.1)]
    return {"step": step, "loss": 2.0 - 0.01 * step + shift, "tokens": 10, "positions": [[0, 3], [1, 5]],
            "ids": [[4, 7, 1], [2, 3, 9]], "logprobs": [logp, [v + shift for v in logp]]}


def write_run(path, losses, grad_scale=1.0, layer_scale=None, probe_shift=0.0, every=2, skipped=0):
    """A run directory: loss per step, grad norms, per-layer norms and probe records every ``every`` steps."""
    path.mkdir(parents=True, exist_ok=True)
    with open(path / "metrics.jsonl", "w") as f:
        for i, loss in enumerate(losses, start=1):
            f.write(json.dumps({"step": i, "loss": loss, "grad_norm": grad_scale * (1 + 1 / i),
                                "skipped_steps": skipped}) + "\n")
    layer_scale = layer_scale or {}
    with open(path / "grad_norms.jsonl", "w") as f, open(path / "probe.jsonl", "w") as g:
        for step in range(every, len(losses) + 1, every):
            scale = {name: layer_scale.get(name, 1.0) for name in GROUPS}  # a number, or a function of the step
            norms = {name: (v(step) if callable(v) else v) * (i + 1) / step for i, (name, v) in enumerate(scale.items())}
            f.write(json.dumps({"step": step, "norms": norms}) + "\n")
            g.write(json.dumps(_probe(step, probe_shift)) + "\n")
    return path


CURVE = [3.0 * 0.97 ** i + 0.5 for i in range(20)]


def test_identical_runs_pass_every_profile_with_zero_error(tmp_path):
    ref = load_signals(str(write_run(tmp_path / "ref", CURVE)))
    run = load_signals(str(write_run(tmp_path / "run", CURVE)))
    for profile in PROFILES.values():
        result = compare(run, ref, dataclasses.replace(profile, min_steps=0))  # migration asks for 1,000 steps
        assert result.passed, (profile.name, [(c.measure, c.value) for c in result.checks])
    values = {c.measure: c.value for c in compare(run, ref, get_profile("bitwise")).checks}
    assert values["loss_mean_rel_err"] == 0 and values["probe_kl"] == 0 and values["layer_grad_norm_rel_err"] == 0


def test_loss_measures_match_their_definition(tmp_path):
    noisy = [v * (1 + (0.01 if i % 2 else -0.01)) for i, v in enumerate(CURVE)]
    ref = load_signals(str(write_run(tmp_path / "ref", CURVE)))
    run = load_signals(str(write_run(tmp_path / "run", noisy)))
    result = compare(run, ref, get_profile("vendor"))
    values = {c.measure: c.value for c in result.checks}
    assert values["loss_mean_rel_err"] == pytest.approx(0.01, rel=1e-9)
    assert values["final_loss_rel_delta"] == pytest.approx(0.01, rel=1e-9)
    assert values["loss_band_rel"] == pytest.approx(0.01)  # step 1: the EMA starts at the raw value
    late = abs(result.curves["ema_run"][-1] / result.curves["ema_ref"][-1] - 1)
    assert late < 0.005  # then smoothing averages the alternating error out
    assert result.passed
    assert not compare(run, ref, get_profile("layout")).passed  # 1% is far outside a layout change


def test_the_migration_standard_judges_the_first_step_the_mean_and_the_length(tmp_path):
    ref = load_signals(str(write_run(tmp_path / "ref", CURVE)))
    migration = get_profile("migration")

    def values(losses, name, profile=migration):
        result = compare(load_signals(str(write_run(tmp_path / name, losses))), ref, profile)
        return {c.measure: (c.value, c.status) for c in result.checks}, result

    # first step 3.5: 0.4% passes, 0.6% fails (relative: the loss is above 1)
    v, _ = values([CURVE[0] * 1.004, *CURVE[1:]], "first_ok")
    assert v["first_loss_err"] == (pytest.approx(0.004), "PASS")
    v, _ = values([CURVE[0] * 1.006, *CURVE[1:]], "first_bad")
    assert v["first_loss_err"][1] == "FAIL"
    # the mean: every step 0.5% high passes, 1.5% fails
    v, _ = values([x * 1.005 for x in CURVE], "mean_ok")
    assert v["loss_mean_delta"] == (pytest.approx(0.005), "PASS")
    v, _ = values([x * 1.015 for x in CURVE], "mean_bad")
    assert v["loss_mean_delta"][1] == "FAIL"
    # 20 steps are 980 short of the standard's 1,000, whatever the curves
    v, result = values(CURVE, "short")
    assert v["steps_short"] == (980.0, "FAIL") and not result.passed
    assert compare(load_signals(str(tmp_path / "short")), ref, dataclasses.replace(migration, min_steps=20)).passed
    # below a loss of 1 the bound is absolute: 0.004 off a loss of 0.2 (2%) passes
    small = [0.2 + 0.001 * i for i in range(20)]
    small_ref = load_signals(str(write_run(tmp_path / "small_ref", small)))
    run = load_signals(str(write_run(tmp_path / "small_run", [small[0] + 0.004, *small[1:]])))
    check = next(c for c in compare(run, small_ref, migration).checks if c.measure == "first_loss_err")
    assert check.value == pytest.approx(0.004) and check.status == "PASS"


def test_drift_gives_the_first_step_outside_the_band(tmp_path):
    drift = [v * (1 + 0.01 * max(0, i - 9)) for i, v in enumerate(CURVE)]  # starts drifting after step 10
    ref = load_signals(str(write_run(tmp_path / "ref", CURVE)))
    run = load_signals(str(write_run(tmp_path / "run", drift)))
    profile = get_profile("precision").with_overrides({"loss_band_rel": 0.03, "loss_mean_rel_err": 1.0,
                                                       "final_loss_rel_delta": 1.0})
    result = compare(run, ref, profile)
    assert result.first_step_outside_band is not None and 13 <= result.first_step_outside_band <= 20
    assert not result.passed and {c.measure for c in result.checks if c.status == "FAIL"} == {"loss_band_rel"}


def test_gradients_that_disagree_fail_even_when_the_loss_agrees(tmp_path):
    """The known case: forward loss within 1%, first-layer gradients 50-100% apart."""
    ref = load_signals(str(write_run(tmp_path / "ref", CURVE)))
    run = load_signals(str(write_run(tmp_path / "run", [v * 1.005 for v in CURVE], layer_scale={"embed": 1.6})))
    result = compare(run, ref, get_profile("vendor"))
    status = {c.measure: c.status for c in result.checks}
    assert status["loss_mean_rel_err"] == "PASS" and status["layer_grad_norm_rel_err"] == "FAIL"
    assert "embed" in next(c.detail for c in result.checks if c.measure == "layer_grad_norm_rel_err")
    assert result.layer_errors["embed"] == pytest.approx(0.6)


def test_gradient_scale_averages_out_step_to_step_noise_but_not_a_bias(tmp_path):
    """precision: per-step norms that swing +-45% around the reference pass, a constant 1.6x fails."""
    ref = load_signals(str(write_run(tmp_path / "ref", CURVE)))
    swing = {"layers.0.attn": lambda step: 1.45 if step % 4 else 0.55}
    result = compare(load_signals(str(write_run(tmp_path / "swing", CURVE, layer_scale=swing))), ref,
                     get_profile("precision"))
    assert result.layer_errors["layers.0.attn"] == pytest.approx(0.45)
    assert result.layer_scale_errors["layers.0.attn"] < 0.15 and result.passed
    biased = compare(load_signals(str(write_run(tmp_path / "bias", CURVE, layer_scale={"embed": 1.6}))), ref,
                     get_profile("precision"))
    assert biased.layer_scale_errors["embed"] == pytest.approx(0.6)
    assert {c.measure for c in biased.checks if c.status == "FAIL"} == {"layer_grad_norm_rel_err",
                                                                        "layer_grad_scale_rel_err"}


def test_groups_below_the_floor_are_judged_by_absolute_error(tmp_path):
    """A group carrying <1% of the gradient, 2x off: a 100% relative error, but small against the floor."""
    ref = load_signals(str(write_run(tmp_path / "ref", CURVE, layer_scale={"layers.0.ffn": 0.01})))
    run = load_signals(str(write_run(tmp_path / "run", CURVE, layer_scale={"layers.0.ffn": 0.02})))
    floored = compare(run, ref, get_profile("precision"))
    assert floored.passed and floored.layer_errors["layers.0.ffn"] < 0.15
    assert compare(run, ref, get_profile("layout")).layer_errors["layers.0.ffn"] == pytest.approx(1.0)


def test_probe_kl_is_zero_for_equal_fingerprints_and_grows_with_the_difference():
    ids, logp = [1, 2, 3], [math.log(0.6), math.log(0.3), math.log(0.05)]
    assert position_kl(ids, logp, ids, logp) == 0
    closer = position_kl(ids, logp, ids, [math.log(0.55), math.log(0.35), math.log(0.05)])
    farther = position_kl(ids, logp, ids, [math.log(0.3), math.log(0.6), math.log(0.05)])
    assert 0 < closer < farther
    # exact KL of the 4-bucket distributions when the top-k sets agree
    p, q = [0.6, 0.3, 0.05, 0.05], [0.3, 0.6, 0.05, 0.05]
    assert farther == pytest.approx(sum(a * math.log(a / b) for a, b in zip(p, q)))
    # a token the run does not rank in its top-k counts as at most its k-th probability
    assert position_kl(ids, logp, [1, 2, 4], [math.log(0.6), math.log(0.3), math.log(0.01)]) > 0


def test_prefix_runs_need_the_prefix_flag_and_gaps_always_fail(tmp_path):
    ref = load_signals(str(write_run(tmp_path / "ref", CURVE)))
    short = load_signals(str(write_run(tmp_path / "short", CURVE[:8])))
    assert not compare(short, ref, get_profile("bitwise")).passed
    result = compare(short, ref, get_profile("bitwise"), allow_prefix=True)
    assert result.passed and len(result.not_reached) == 12
    gap = tmp_path / "gap"
    write_run(gap, CURVE)
    lines = (gap / "metrics.jsonl").read_text().splitlines()
    (gap / "metrics.jsonl").write_text("\n".join(lines[:4] + lines[6:]) + "\n")
    result = compare(load_signals(str(gap)), ref, get_profile("bitwise"))
    assert result.missing_in_run == [5, 6] and not result.passed


def test_nonfinite_and_skipped_steps_are_counted(tmp_path):
    ref = load_signals(str(write_run(tmp_path / "ref", CURVE)))
    bad = list(CURVE)
    bad[7] = float("nan")
    result = compare(load_signals(str(write_run(tmp_path / "run", bad, skipped=2))), ref, get_profile("precision"))
    values = {c.measure: (c.value, c.status) for c in result.checks}
    assert values["nonfinite_losses"] == (1.0, "FAIL")
    assert values["extra_skipped_steps"] == (2.0, "PASS")  # precision allows a few loss-scaler skips
    assert values["loss_mean_rel_err"][1] == "PASS"  # the other steps are identical


def test_nonfinite_steps_are_compared_per_window_of_50_steps(tmp_path):
    def with_skips(name, at):  # 120 steps; a skipped (non-finite) step at each of ``at``
        path = write_run(tmp_path / name, [3.0 - 0.01 * i for i in range(120)])
        rows = [json.loads(line) for line in open(path / "metrics.jsonl")]
        for r in rows:
            r["skipped_steps"] = sum(s <= r["step"] for s in at)
        (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return load_signals(str(path))

    from trex.fidelity.compare import skips_per_window

    ref = with_skips("ref", [60, 70])
    assert skips_per_window(ref) == {1: 2}
    same = compare(with_skips("same", [55, 90]), ref, get_profile("precision"))
    moved = compare(with_skips("moved", [3, 7]), ref, get_profile("layout").with_overrides({"extra_skipped_steps": 0}))
    v = {c.measure: (c.value, c.status, c.detail) for c in moved.checks}
    assert v["extra_skipped_steps"][:2] == (0.0, "PASS")  # as many in total ...
    assert v["nonfinite_window_excess"][:2] == (2.0, "FAIL")  # ... but clustered in steps 1-50
    assert "steps 1-50: run 2, reference 0" in v["nonfinite_window_excess"][2]
    assert next(c for c in same.checks if c.measure == "nonfinite_window_excess").value == 0.0


def test_rl_trainer_sampler_parity_is_judged_step_by_step_against_the_reference(tmp_path):
    def with_parity(name, k3, pearson):
        path = write_run(tmp_path / name, CURVE)
        rows = [json.loads(line) for line in open(path / "metrics.jsonl")]
        for r in rows:
            r.update({"rollout/k3_kl": k3(r["step"]), "rollout/pearson": pearson(r["step"]),
                      "rollout/prob_gap_mean": k3(r["step"]) * 10})
        (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return load_signals(str(path))

    ref = with_parity("ref", lambda s: 1e-5, lambda s: 0.9999)
    good = compare(with_parity("good", lambda s: 2e-5, lambda s: 0.9995), ref, get_profile("precision"))
    drift = compare(with_parity("drift", lambda s: 1e-5 if s < 15 else 5e-3, lambda s: 0.98 if s == 7 else 0.9999),
                    ref, get_profile("precision"))
    v = {c.measure: (c.value, c.status, c.detail) for c in good.checks}
    assert v["rollout_k3_kl_excess"][0] == pytest.approx(1e-5) and v["rollout_k3_kl_excess"][1] == "PASS"
    assert v["rollout_pearson_drop"][0] == pytest.approx(4e-4) and good.passed
    d = {c.measure: (c.value, c.status, c.detail) for c in drift.checks}
    assert d["rollout_k3_kl_excess"][1] == "FAIL" and d["rollout_k3_kl_excess"][2].startswith("worst step 15")
    assert d["rollout_pearson_drop"][0] == pytest.approx(0.0199) and "worst step 7" in d["rollout_pearson_drop"][2]
    assert d["rollout_prob_gap_excess"][1] == "FAIL" and not drift.passed
    sft = compare(load_signals(str(write_run(tmp_path / "sft", CURVE))), load_signals(str(tmp_path / "sft")),
                  get_profile("layout"))
    assert {c.measure: c.status for c in sft.checks}["rollout_k3_kl_excess"] == "n/a" and sft.passed
    missing = compare(load_signals(str(tmp_path / "sft")), ref, get_profile("layout"))
    assert {c.measure: c.status for c in missing.checks}["rollout_k3_kl_excess"] == "FAIL"  # the run lost it


def test_overrides_change_one_threshold_and_reject_unknown_names():
    profile = get_profile("layout").with_overrides(parse_overrides(["loss_mean_rel_err=0.5", "probe_kl=off"]))
    assert profile.thresholds["loss_mean_rel_err"] == 0.5 and profile.thresholds["probe_kl"] is None
    assert profile.thresholds["grad_norm_mean_rel_err"] == get_profile("layout").thresholds["grad_norm_mean_rel_err"]
    for bad in (["loss_mean=0.1"], ["probe_kl=abc"], ["probe_kl"], ["probe_kl=-1"]):
        with pytest.raises(ValueError, match="--set"):
            parse_overrides(bad)
    with pytest.raises(ValueError, match="unknown fidelity profile"):
        get_profile("close-enough")


def test_missing_signals_fail_unless_switched_off(tmp_path):
    ref = load_signals(str(write_run(tmp_path / "ref", CURVE)))
    bare = write_run(tmp_path / "bare", CURVE)
    (bare / "grad_norms.jsonl").unlink()
    (bare / "probe.jsonl").unlink()
    result = compare(load_signals(str(bare)), ref, get_profile("layout"))
    assert {c.measure for c in result.checks if c.status == "FAIL"} == {"layer_grad_norm_rel_err", "probe_kl",
                                                                        "probe_loss_rel_err"}
    off = get_profile("layout").with_overrides(parse_overrides(
        ["layer_grad_norm_rel_err=off", "probe_kl=off", "probe_loss_rel_err=off"]))
    assert compare(load_signals(str(bare)), ref, off).passed


@pytest.mark.parametrize("damage, message", [
    (lambda d: (d / "metrics.jsonl").write_text(""), "empty"),
    (lambda d: (d / "metrics.jsonl").write_text('{"step": 1, "loss": 2}\n{"step": 1, "loss": 2}\n'),
     "metrics.jsonl:2: step 1 after step 1"),
    (lambda d: (d / "metrics.jsonl").write_text('{"step": 1, "loss": 2}\n{oops\n'), "metrics.jsonl:2: invalid JSON"),
    (lambda d: (d / "metrics.jsonl").write_text('{"loss": 2}\n'), "metrics.jsonl:1: expected a JSON object"),
    (lambda d: (d / "metrics.jsonl").unlink(), "not a run directory"),
])
def test_bad_run_directories_name_the_file_and_line(tmp_path, damage, message):
    run = write_run(tmp_path / "run", CURVE)
    damage(run)
    with pytest.raises(FidelityInputError, match=message):
        load_signals(str(run))


def test_bad_comparisons_say_what_is_wrong(tmp_path):
    ref_dir = write_run(tmp_path / "ref", CURVE)
    run = load_signals(str(write_run(tmp_path / "run", CURVE)))
    renamed = tmp_path / "renamed"
    renamed.mkdir()
    (renamed / "metrics.jsonl").write_text("".join(json.dumps({"step": i, "train_loss": 1.0}) + "\n"
                                                   for i in range(1, 4)))
    with pytest.raises(FidelityInputError, match="logs no `loss`.*train_loss"):
        compare(load_signals(str(renamed)), load_signals(str(ref_dir)), get_profile("layout"))
    nan_ref = list(CURVE)
    nan_ref[3] = float("nan")
    with pytest.raises(FidelityInputError, match="non-finite loss at step.*4"):
        compare(run, load_signals(str(write_run(tmp_path / "nanref", nan_ref))), get_profile("layout"))
    other = write_run(tmp_path / "other", CURVE)
    (other / "grad_norms.jsonl").write_text(json.dumps({"step": 2, "norms": {"embed": 1.0}}) + "\n")
    with pytest.raises(FidelityInputError, match="different layer groups"):
        compare(load_signals(str(other)), load_signals(str(ref_dir)), get_profile("layout"))
    with pytest.raises(FidelityInputError, match="no such run directory"):
        load_signals(str(tmp_path / "nowhere"))


def test_golden_export_round_trips_and_rejects_runs_without_signals(tmp_path):
    run_dir = write_run(tmp_path / "run", CURVE)
    export(str(run_dir), str(tmp_path / "golden.json"))
    golden = load_signals(str(tmp_path / "golden.json"))
    run = load_signals(str(run_dir))
    assert golden.series("loss") == run.series("loss") and golden.grad_norms == run.grad_norms
    assert compare(run, golden, get_profile("bitwise")).passed
    (run_dir / "probe.jsonl").unlink()
    with pytest.raises(FidelityInputError, match="every > 0"):
        export(str(run_dir), str(tmp_path / "g2.json"))
    (tmp_path / "not_golden.json").write_text('{"metrics": []}')
    with pytest.raises(FidelityInputError, match="not a golden reference"):
        load_signals(str(tmp_path / "not_golden.json"))


def test_cli_exit_codes_table_json_and_png(tmp_path, capsys):
    ref = write_run(tmp_path / "ref", CURVE)
    same = write_run(tmp_path / "same", CURVE)
    drifted = write_run(tmp_path / "drifted", [v * 1.05 for v in CURVE])
    assert main(["fidelity", "compare", str(same), str(ref), "--profile", "bitwise"]) == 0
    assert "verdict: PASS" in capsys.readouterr().out
    assert (same / "fidelity" / "bitwise_vs_ref.json").exists() and (same / "fidelity" / "bitwise_vs_ref.png").exists()
    assert main(["fidelity", "compare", str(drifted), str(ref), "--profile", "vendor", "--format", "json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["verdict"] == "FAIL" and report["first_step_outside_band"] is not None
    assert main(["fidelity", "compare", str(drifted), str(ref), "--set", "nope=1"]) == 2
    assert "--set" in capsys.readouterr().err
    assert main(["fidelity", "profiles"]) == 0
    assert "Ascend" in capsys.readouterr().out


def test_cli_json_is_strict_with_a_non_finite_loss(tmp_path, capsys):
    """A run with a NaN loss: `--format json` writes its non-finite measures as null, never a bare NaN."""
    ref = write_run(tmp_path / "ref", CURVE)
    bad = write_run(tmp_path / "bad", [math.nan if i == 5 else v for i, v in enumerate(CURVE)])
    assert main(["fidelity", "compare", str(bad), str(ref), "--format", "json"]) == 1
    report = json.loads(capsys.readouterr().out, parse_constant=lambda name: pytest.fail(f"bare {name} in JSON"))
    assert report["verdict"] == "FAIL" and None in [c["value"] for c in report["checks"]]


def test_layer_groups_follow_blocks_and_submodules():
    assert layer_group("embed.weight") == "embed"
    assert layer_group("layers.3.attn.wq_a.weight") == "layers.3.attn"
    assert layer_group("layers.3.ffn.experts.w1") == "layers.3.ffn"
    assert layer_group("layers.3.hc_attn.fn") == "layers.3.hc"
    assert layer_group("layers.0.attn_norm.weight") == "layers.0.norm"
    assert layer_group("mtp.0.e_proj.weight") == "mtp.0.proj"
    assert layer_group("hc_head.base") == "hc_head"


def test_the_plotted_band_agrees_with_the_verdict(tmp_path):
    """The plot draws the run's EMA inside the band at exactly the steps the band check accepts."""
    from trex.fidelity.report import band_series

    ref = load_signals(str(write_run(tmp_path / "ref", CURVE)))
    noisy = [v * (1 + (0.02 if i % 2 else -0.02)) for i, v in enumerate(CURVE)]  # raw curve zig-zags
    drift = [v * (1 + 0.01 * max(0, i - 9)) for i, v in enumerate(CURVE)]
    profile = get_profile("precision").with_overrides({"loss_band_rel": 0.03, "loss_mean_rel_err": 1.0,
                                                       "final_loss_rel_delta": 1.0})
    for name, losses in (("noisy", noisy), ("drift", drift)):
        result = compare(load_signals(str(write_run(tmp_path / name, losses))), ref, profile)
        s = band_series(result)
        outside = [step for step, lo, run, hi in zip(result.steps, s["lo"], s["run"], s["hi"]) if not lo <= run <= hi]
        band_ok = next(c for c in result.checks if c.measure == "loss_band_rel").status == "PASS"
        assert band_ok == (not outside) == (name == "noisy"), name  # one of each
        assert (outside[0] if outside else None) == result.first_step_outside_band, name
        raw_outside = any(not lo <= raw <= hi for lo, raw, hi in zip(s["lo"], result.curves["run"], s["hi"]))
        assert raw_outside or name != "noisy"  # the raw curve leaves the band where the EMA does not


def test_the_matrix_refuses_an_out_that_holds_a_matrix_before_training(tmp_path, capsys, monkeypatch):
    from trex.fidelity import matrix

    monkeypatch.setattr(matrix, "_run_inline", lambda *a: pytest.fail("trained into a used directory"))
    (tmp_path / "m" / "control-fp32").mkdir(parents=True)
    recipe = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes", "fidelity_default.toml")
    assert main(["fidelity", "matrix", recipe, "--out", str(tmp_path / "m")]) == 2
    err = capsys.readouterr().err
    assert "already holds a matrix (control-fp32)" in err and "--overwrite" in err and "--resume" not in err


def test_the_matrix_with_an_out_it_cannot_create_is_one_line(tmp_path, capsys, monkeypatch):
    from trex.fidelity import matrix

    (tmp_path / "a_file").write_text("")
    monkeypatch.setattr(matrix, "_run_inline", lambda recipe, out, overrides, env=None: os.makedirs(out))
    recipe = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes", "fidelity_default.toml")
    assert main(["fidelity", "matrix", recipe, "--out", str(tmp_path / "a_file" / "m")]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("trex fidelity matrix:")]
    assert len(lines) == 1 and "a_file" in lines[0] and "Not a directory" in lines[0]


def test_the_switches_matrix_judges_each_switch_against_bf16_eager_within_the_controls_own_spread(tmp_path, monkeypatch):
    """`trex fidelity matrix --switches`: every accelerator switch runs against the CPU bf16 eager control
    (vendor); correct bf16 reorderings (the batch split in 2 and 4, the reference kernels) measure the
    control's spread per layer group first (the worst of them, x SPREAD_MARGIN: compile's 0.55 passes only by
    the second's 0.3 x 2; the quiet group's 0.5 fails at the vendor threshold). A switch inside a noisy group's spread passes; one that moves a quiet group fails there; a
    kernel the CPU lacks (FlexAttention's backward) is not available, with its reason."""
    from trex.fidelity import matrix

    ran = {}

    def fake_run(recipe, out, overrides, env=None):
        name = os.path.basename(out)
        ran[name] = (overrides, env or {})
        if "sparse_attention=flex" in (env or {}).get("TREX_KERNELS", ""):
            raise NotImplementedError("flex_sparse_attention: FlexAttention has no backward on CPU (torch x); use ...")
        scale = {"bf16-reorder-2": {"layers.0.ffn": 1.2}, "bf16-reorder-4": {"layers.0.ffn": 1.3},
                 "compile": {"layers.0.ffn": 1.55},
                 "muon-ns-bf16": {"layers.0.attn": 1.5}}.get(name, {})
        write_run(tmp_path / "m" / name, CURVE, layer_scale=scale)

    monkeypatch.setattr(matrix, "_run_inline", fake_run)
    recipe = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes", "fidelity_default.toml")
    report = matrix.run_matrix(recipe, str(tmp_path / "m"), steps=4, switches=True,
                               only=["compile", "muon-ns-bf16", "rms-norm-fused", "flex-attention"])
    rows = {r["variant"]: r for r in report["variants"]}
    control_overrides, control_env = ran["control-bf16-eager"]
    assert 'precision.dtype="bf16"' in control_overrides and "train.compile=false" in control_overrides
    assert control_env == {"TREX_KERNELS": "auto"}
    assert "train.compile=true" in ran["compile"][0] and ran["rms-norm-fused"][1] == {"TREX_KERNELS": "rms_norm=fused"}
    assert [r["variant"] for r in report["variants"]][:3] == ["bf16-reorder-2", "bf16-reorder-4", "kernels-reference"]
    assert {rows[n]["verdict"] for n in matrix.NOISE} == {"spread"} and not rows["bf16-reorder-4"]["note"] and ran["kernels-reference"][1] == {"TREX_KERNELS": "reference"}
    assert "data.micro_batch_size=1" in ran["bf16-reorder-4"][0] and "train.grad_accum=4" in ran["bf16-reorder-4"][0]
    assert rows["compile"]["verdict"] == "PASS" and rows["rms-norm-fused"]["verdict"] == "PASS"
    assert rows["muon-ns-bf16"]["verdict"] == "FAIL" and "layer_grad_norm_rel_err" in rows["muon-ns-bf16"]["note"]
    judged = json.load(open(rows["muon-ns-bf16"]["report"]))
    check = next(c for c in judged["checks"] if c["measure"] == "layer_grad_norm_rel_err")
    assert "layers.0.attn" in check["detail"] and check["threshold"] == 0.2
    assert rows["flex-attention"]["verdict"] == matrix.UNAVAILABLE and "no backward on CPU" in rows["flex-attention"]["note"]
    assert report["verdict"] == "FAIL"
    with pytest.raises(ValueError, match="unknown variant"):
        matrix.run_matrix(recipe, str(tmp_path / "n"), switches=True, only=["bf16"])


# Issue 53, measured on recipes/fidelity_default.toml (20 steps, docs/fidelity.md): relative error of
# layers.0.hc's gradient norm against the bf16 eager control at the recorded steps 5 / 10 / 15 / 20.
# After the loss spike at step 15 every run's groups scatter; the noise runs reach 0.28 there, 0.14 before.
MEASURED_HC = {"bf16-reorder-2": (0.021, 0.050, 0.069, 0.193), "bf16-reorder-4": (0.000, 0.141, 0.047, 0.147),
               "kernels-reference": (0.014, 0.022, 0.104, 0.279), "accelerator-set": (0.031, 0.084, 0.125, 0.628)}


def test_the_switches_matrix_bounds_each_step_by_the_noise_at_that_step(tmp_path, monkeypatch):
    """The no-defect run that failed on one late step (`accelerator-set`: inside the noise runs' range
    up to step 15, 0.63 at step 20 where they reach 0.28; its mean 0.217 against 2 x the worst noise
    run's mean 0.105) passes when each step is judged by the noise at that step; a switch that moves
    the same noisy group by 50% at every step, or a quiet group by 30%, still fails in that group."""
    from trex.fidelity import matrix

    def fake_run(recipe, out, overrides, env=None):
        name = os.path.basename(out)
        errors = dict(zip((5, 10, 15, 20), MEASURED_HC.get(name, (0.0,) * 4)))
        scale = {"layers.0.ffn": lambda step: 1 + errors[step]}  # the noisy group (layers.0.hc on the recipe)
        if name == "compile":  # a defect in the noisy group: 50% at every step
            scale = {"layers.0.ffn": 1.5}
        elif name == "muon-ns-bf16":  # a defect in a quiet group, inside the threshold's reach of the noise
            scale = {**scale, "layers.0.attn": 1.3}
        write_run(tmp_path / "m" / name, CURVE, layer_scale=scale, every=5)

    monkeypatch.setattr(matrix, "_run_inline", fake_run)
    recipe = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes", "fidelity_default.toml")
    report = matrix.run_matrix(recipe, str(tmp_path / "m"), switches=True,
                               only=["accelerator-set", "compile", "muon-ns-bf16"])
    rows = {r["variant"]: r for r in report["variants"]}

    def check(name):
        judged = json.load(open(rows[name]["report"]))
        return next(c for c in judged["checks"] if c["measure"] == "layer_grad_norm_rel_err")

    no_defect = check("accelerator-set")
    assert rows["accelerator-set"]["verdict"] == "PASS", no_defect
    assert no_defect["value"] == pytest.approx(0.217, abs=1e-3) and "layers.0.ffn" in no_defect["detail"]
    assert no_defect["value"] < no_defect["threshold"] < 0.5  # bounded, by the steps' own spreads
    per_step = json.load(open(rows["accelerator-set"]["report"]))["layer_grad_norm_rel_err_per_step"]
    assert per_step["layers.0.ffn"]["20"] == pytest.approx(0.628)
    for name, group in (("compile", "layers.0.ffn"), ("muon-ns-bf16", "layers.0.attn")):
        assert rows[name]["verdict"] == "FAIL" and "layer_grad_norm_rel_err" in rows[name]["note"], name
        assert group in check(name)["detail"], name
    assert report["verdict"] == "FAIL"
