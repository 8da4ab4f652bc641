"""`trex fidelity calibrate RECIPE`: how far does the reference drift from itself?

The reference configuration is trained ``runs`` times, each a separate ``trex train`` process, with
the nondeterminism the target will have: the intra-op thread count cycles through ``threads``
(CPU matmuls and reductions split their sums by thread, so the rounding differs), and run k >= 1
may add one set of ``vary`` overrides (a reduction order: another grad-accum split, activation
checkpointing, another kernel set). Every run k >= 1 is compared with run 0 under every profile;
the largest value of each measure over those comparisons is the reference's own **spread** (per
profile: the band measure depends on the profile's EMA). The report shows the chosen profile's.

The envelope (spread, the per-step loss minimum and maximum over the runs, what varied) is written
into the golden file exported from run 0 (``--merge`` joins the envelopes of golden files calibrated
on several machines into one, naming the machine each spread came from), and ``trex fidelity compare`` reads it from there: it says
where a threshold is tighter than the spread, and ``--envelope widen`` judges each measure by
max(threshold, spread). Output in ``out``: ``run-<k>/`` run directories, ``calibration.json`` and
``calibration.md`` (per measure: spread, threshold, tighter or not).
"""

from __future__ import annotations

import os
import subprocess
import sys

from trex import atomic
from trex.fidelity.compare import compare
from trex.fidelity.golden import export
from trex.fidelity.matrix import CONTROL, claim_out, failure_line, signal_overrides, train_args
from trex.fidelity.profiles import MEASURES, PROFILES, Profile
from trex.fidelity.runs import load_signals
from trex.recipe import load
from trex.train.config import TrainRecipe


def run_plan(runs: int, threads: list[int], vary: list[list[str]]) -> list[dict]:
    """What run k changes: ``{"threads": n, "overrides": [...]}`` (run 0: no overrides)."""
    if runs < 2:
        raise ValueError(f"--runs {runs}: a spread needs at least 2 runs")
    if not threads or any(t < 1 for t in threads):
        raise ValueError(f"--threads {threads}: expected thread counts >= 1")
    return [{"threads": threads[k % len(threads)], "overrides": vary[(k - 1) % len(vary)] if vary and k else []}
            for k in range(runs)]


def envelope(signals: list) -> dict:
    """The spread of ``signals[1:]`` around ``signals[0]``, per profile (the band measure depends on
    the profile's EMA, the per-layer ones on its floor) and measure, and the per-step loss bounds.
    ``group_spread`` keeps the per-layer measures per layer group (profile -> measure -> group ->
    worst error over the runs), so that `compare` can judge each group by its own spread: a group
    that is noisy by construction (mHC mixers, norm gains) does not widen the bound of a quiet one.
    ``group_step_spread`` keeps the per-step gradient-norm error per group and recorded step too
    (profile -> group -> step -> worst error; steps as strings, as in JSON), so that `compare` judges a
    step by the spread at that step: a chaotic run's late steps scatter far more than its early ones."""
    spread: dict[str, dict[str, float]] = {}
    groups: dict[str, dict[str, dict[str, float]]] = {}
    step_groups: dict[str, dict[str, dict[str, float]]] = {}
    for profile in PROFILES.values():
        measured = spread.setdefault(profile.name, {})
        per_group = groups.setdefault(profile.name, {})
        per_step = step_groups.setdefault(profile.name, {})
        for other in signals[1:]:
            result = compare(other, signals[0], profile)
            for group, by_step in result.layer_step_errors.items():
                worst = per_step.setdefault(group, {})
                for step, value in by_step.items():
                    worst[str(step)] = max(worst.get(str(step), 0.0), value)
            for check in result.checks:
                if check.value is not None and check.applies:
                    measured[check.measure] = max(measured.get(check.measure, 0.0), check.value)
            for measure, errors in (("layer_grad_norm_rel_err", result.layer_errors),
                                    ("layer_grad_scale_rel_err", result.layer_scale_errors)):
                worst = per_group.setdefault(measure, {})
                for group, value in errors.items():
                    worst[group] = max(worst.get(group, 0.0), value)
    series = [s.series("loss") for s in signals]
    steps = sorted(set.intersection(*(set(s) for s in series)))
    return {"spread": spread, "group_spread": groups, "group_step_spread": step_groups,
            "loss": {"steps": steps, "min": [min(s[t] for s in series) for t in steps],
                     "max": [max(s[t] for s in series) for t in steps]}}


def calibrate(recipe_path: str, out: str, golden: str, profile: Profile, runs: int = 3, threads: list[int] | None = None,
              vary: list[list[str]] | None = None, overrides: list[str] | None = None,
              overwrite: bool = False) -> dict:
    """Train the runs, measure the envelope, write the golden file; returns the calibration report."""
    plan = run_plan(runs, threads or [1, 2], vary or [])
    claim_out(out, "a calibration", overwrite)
    settings = [*(c for c in CONTROL if not c.startswith("precision.")), *(overrides or [])]  # one process
    settings += signal_overrides(load(TrainRecipe, recipe_path, settings))
    dirs = []
    for k, run in enumerate(plan):
        run_dir = os.path.join(out, f"run-{k}")
        print(f"[run {k}] {run['threads']} thread(s) {' '.join(run['overrides'])}".rstrip() + f" -> {run_dir}",
              file=sys.stderr)
        env = {**os.environ, "OMP_NUM_THREADS": str(run["threads"])}
        proc = subprocess.run([sys.executable, *train_args(recipe_path, run_dir, [*settings, *run["overrides"]])],
                              capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            raise ValueError(f"run {k} failed: {failure_line(proc, proc.stderr)}")
        dirs.append(run_dir)
    signals = [load_signals(d) for d in dirs]
    env = {**envelope(signals), "runs": len(plan), "variation": plan}
    data = export(dirs[0], golden)
    data["envelope"] = env
    atomic.write_json(golden, data, indent=1)
    spread = env["spread"][profile.name]
    report = {"recipe": recipe_path, "golden": golden, "profile": profile.name, **env,
              "thresholds": {m: profile.thresholds.get(m) for m in spread},
              "tighter_than_spread": sorted(m for m, v in spread.items()
                                            if profile.thresholds.get(m) is not None and profile.thresholds[m] < v)}
    atomic.write_json(os.path.join(out, "calibration.json"), report)
    atomic.write_text(os.path.join(out, "calibration.md"), markdown(report) + "\n")
    return report


SAME_SECTIONS = ("model", "data", "optim", "schedule")  # what every merged calibration must share


def _machine(golden: dict, path: str) -> str:
    """A golden file's machine, as a report names it: its device and host, and the file."""
    env = golden.get("environment", {})
    device = env.get("device_name") or env.get("device") or env.get("device_type") or "unknown device"
    host = env.get("host") or ""
    return f"{device}{f' on {host}' if host else ''} ({os.path.basename(path)})"


def merge(goldens: list[str], out: str) -> dict:
    """One golden file from calibrations made on several machines: the first file's reference run,
    and an envelope whose spread is, per profile and measure, the largest of the files' (with
    ``spread_from`` naming the machine it came from) and whose loss bounds span every file's. The
    files must calibrate the same configuration (model, data, optimizer, schedule; device, precision
    and layout may differ). Returns the merged golden file's content."""
    import json

    if len(goldens) < 2:
        raise ValueError(f"--merge takes at least two calibrated golden files; got {len(goldens)}")
    loaded = []
    for path in goldens:
        signals = load_signals(path)  # validates the file and its envelope
        if not signals.envelope:
            raise ValueError(f"{path}: no envelope; make it with `trex fidelity calibrate RECIPE --golden {path}`")
        with open(path, encoding="utf-8") as f:
            loaded.append((path, json.load(f)))
    first_path, first = loaded[0]
    for path, golden in loaded[1:]:
        for section in SAME_SECTIONS:
            if golden.get("config", {}).get(section) != first.get("config", {}).get(section):
                raise ValueError(f"{path}: its [{section}] differs from {first_path}'s; merge calibrations of one "
                                 "configuration (device, precision and layout may differ)")
    spread: dict[str, dict[str, float]] = {}
    spread_from: dict[str, dict[str, str]] = {}
    for path, golden in loaded:
        for profile, measured in golden["envelope"]["spread"].items():
            for measure, value in measured.items():
                if value > spread.setdefault(profile, {}).get(measure, -1.0):  # a tie: the first file's
                    spread[profile][measure] = value
                    spread_from.setdefault(profile, {})[measure] = _machine(golden, path)
    groups = _worst([g["envelope"].get("group_spread", {}) for _, g in loaded])
    step_groups = _worst([g["envelope"].get("group_step_spread", {}) for _, g in loaded])
    bounds = [g["envelope"].get("loss", {}) for _, g in loaded]
    steps = sorted(set.intersection(*(set(b.get("steps", [])) for b in bounds)))
    lo = [dict(zip(b["steps"], b["min"])) for b in bounds]
    hi = [dict(zip(b["steps"], b["max"])) for b in bounds]
    envelope = {"spread": spread, "spread_from": spread_from, "group_spread": groups, "group_step_spread": step_groups,
                "loss": {"steps": steps, "min": [min(m[t] for m in lo) for t in steps],
                         "max": [max(m[t] for m in hi) for t in steps]},
                "runs": sum(g["envelope"].get("runs", 0) for _, g in loaded),
                "machines": [{"golden": path, "machine": _machine(g, path), "runs": g["envelope"].get("runs"),
                              "variation": g["envelope"].get("variation")} for path, g in loaded]}
    merged = {**first, "envelope": envelope}
    os.makedirs(os.path.dirname(os.path.abspath(out)) or ".", exist_ok=True)
    atomic.write_json(out, merged, indent=1)
    return merged


def _worst(trees: list[dict]) -> dict:
    """Nested dicts of spreads merged key by key, each leaf the largest of the trees'."""
    out: dict = {}
    for tree in trees:
        for key, value in tree.items():
            if isinstance(value, dict):
                out[key] = _worst([out.get(key, {}), value])
            else:
                out[key] = max(out.get(key, 0.0), value)
    return out


def merge_markdown(merged: dict, profile: Profile) -> str:
    env = merged["envelope"]
    lines = [f"# Merged calibration: {len(env['machines'])} machines, {env['runs']} runs", "",
             *(f"- {m['machine']}: {m['runs']} runs" for m in env["machines"]), "",
             f"| measure ({profile.name}) | spread | from | profile threshold |", "|---|---|---|---|"]
    spread, source = env["spread"].get(profile.name, {}), env["spread_from"].get(profile.name, {})
    for measure in MEASURES:
        if measure in spread:
            t = profile.thresholds.get(measure)
            lines.append(f"| {measure} | {spread[measure]:.3g} | {source[measure]} | {'off' if t is None else f'{t:g}'} |")
    return "\n".join(lines)


def markdown(report: dict) -> str:
    varied = "; ".join(f"run {k}: {r['threads']} thread(s)" + (f" {' '.join(r['overrides'])}" if r["overrides"] else "")
                       for k, r in enumerate(report["variation"]))
    lines = [f"# Calibration: {report['recipe']}", "", f"{report['runs']} runs ({varied}); golden file "
             f"{report['golden']}; profile {report['profile']}", "",
             "| measure | spread (max over runs vs run 0) | profile threshold | |", "|---|---|---|---|"]
    spread = report["spread"][report["profile"]]
    for measure in MEASURES:
        if measure not in spread:
            continue
        t = report["thresholds"].get(measure)
        flag = "tighter than the spread" if measure in report["tighter_than_spread"] else ""
        lines.append(f"| {measure} | {spread[measure]:.3g} | {'off' if t is None else f'{t:g}'} | {flag} |")
    return "\n".join(lines)


def thread_list(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"--threads {text!r}: expected comma-separated integers, e.g. 1,2") from None


def vary_sets(items: list[str]) -> list[list[str]]:
    """``--vary "a=1;b=2"`` -> [["a=1", "b=2"]]: one run's overrides per item."""
    return [[part.strip() for part in item.split(";") if part.strip()] for item in items]
