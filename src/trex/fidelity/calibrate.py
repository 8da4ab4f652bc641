"""`trex fidelity calibrate RECIPE`: how far does the reference drift from itself?

The reference configuration is trained ``runs`` times, each a separate ``trex train`` process, with
the nondeterminism the target will have: the intra-op thread count cycles through ``threads``
(CPU matmuls and reductions split their sums by thread, so the rounding differs), and run k >= 1
may add one set of ``vary`` overrides (a reduction order: another grad-accum split, activation
checkpointing, another kernel set). Every run k >= 1 is compared with run 0 under every profile;
the largest value of each measure over those comparisons is the reference's own **spread** (per
profile: the band measure depends on the profile's EMA). The report shows the chosen profile's.

The envelope (spread, the per-step loss minimum and maximum over the runs, what varied) is written
into the golden file exported from run 0, and ``trex fidelity compare`` reads it from there: it says
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
    the profile's EMA, the per-layer ones on its floor) and measure, and the per-step loss bounds."""
    spread: dict[str, dict[str, float]] = {}
    for profile in PROFILES.values():
        measured = spread.setdefault(profile.name, {})
        for other in signals[1:]:
            for check in compare(other, signals[0], profile).checks:
                if check.value is not None and check.applies:
                    measured[check.measure] = max(measured.get(check.measure, 0.0), check.value)
    series = [s.series("loss") for s in signals]
    steps = sorted(set.intersection(*(set(s) for s in series)))
    return {"spread": spread, "loss": {"steps": steps, "min": [min(s[t] for s in series) for t in steps],
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
