"""A comparison as a readable table, a JSON file and a PNG (both curves, the band, the relative error)."""

from __future__ import annotations

import math
import os

from trex import atomic
from trex.fidelity.compare import Comparison


def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    if value == 0 or (math.isfinite(value) and value == int(value) and abs(value) < 1e6):
        return f"{value:g}"
    return f"{value:.3e}"


def table(result: Comparison) -> str:
    lines = [f"run:        {result.run}", f"reference:  {result.reference}",
             f"profile:    {result.profile.name}   metric: {result.metric}   aligned steps: {len(result.steps)} "
             f"({result.steps[0]}..{result.steps[-1]})"]
    if result.missing_in_run:
        lines.append(f"missing in run: {result.missing_in_run[:10]}{' ...' if len(result.missing_in_run) > 10 else ''}")
    if result.not_reached:
        lines.append(f"reference steps after the run's end: {len(result.not_reached)}")
    lines.append("")
    spread = any(c.spread is not None for c in result.checks)
    lines.append(f"{'measure':<26} {'value':>11} {'threshold':>11}" + (f" {'ref spread':>11}" if spread else "")
                 + "  status  detail")
    for c in result.checks:
        lines.append(f"{c.measure:<26} {_fmt(c.value):>11} {_fmt(c.threshold):>11}"
                     + (f" {_fmt(c.spread):>11}" if spread else "") + f"  {c.status:<6}  {c.detail}")
    lines.append("")
    lines += [f"note: {n}" for n in result.notes]
    lines.append(f"verdict: {result.verdict}")
    return "\n".join(lines)


def write_json(result: Comparison, path: str) -> None:
    atomic.write_json(path, result.to_dict())


def band_series(result: Comparison) -> dict[str, list[float]]:
    """What the top panel draws against what the verdict checks: the band (``lo``, ``hi``) around the
    reference's EMA, and the run's EMA (``run``), which stays inside it exactly when the band check
    passes (the raw curves are drawn faded behind, for reading individual steps)."""
    band = result.profile.thresholds.get("loss_band_rel")
    ref, run = result.curves["ema_ref"], result.curves["ema_run"]
    if band is None:
        return {"ref": ref, "run": run}
    # the check is |ema_run - ema_ref| / |ema_ref| <= band (trex.fidelity.compare), hence |ema_ref| here
    return {"ref": ref, "run": run, "lo": [v - band * abs(v) for v in ref], "hi": [v + band * abs(v) for v in ref]}


def plot(result: Comparison, path: str) -> None:
    """Top: the reference's and the run's EMA (the curves the verdict compares) with the profile's
    band around the reference's, over the raw curves, faded. Bottom: the per-step relative error with
    the mean-error threshold."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps, curves = result.steps, result.curves
    band = result.profile.thresholds.get("loss_band_rel")
    series = band_series(result)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True, gridspec_kw={"height_ratios": [2, 1]})
    top.plot(steps, curves["ref"], "-", color="0.4", lw=0.6, alpha=0.35, label="reference (raw)")
    top.plot(steps, curves["run"], "-", color="tab:blue", lw=0.6, alpha=0.35, label="run (raw)")
    top.plot(steps, series["ref"], "-", color="0.2", lw=1.5, label=f"reference EMA {result.profile.ema:g}")
    top.plot(steps, series["run"], "-", color="tab:blue", lw=1.5, label=f"run EMA {result.profile.ema:g}")
    if "envelope_lo" in curves:
        top.fill_between(steps, curves["envelope_lo"], curves["envelope_hi"], color="0.5", alpha=0.3,
                         label="reference's run-to-run envelope (raw)")
    if band is not None:
        top.fill_between(steps, series["lo"], series["hi"], color="tab:green", alpha=0.25,
                         label=f"band ±{band:g} around the reference EMA")
    if result.first_step_outside_band is not None:
        top.axvline(result.first_step_outside_band, color="tab:red", ls="--", lw=1, label="first step outside")
    top.set_ylabel(result.metric)
    top.set_title(f"{result.profile.name}: {result.verdict}")
    top.legend(fontsize=8)
    top.grid(alpha=0.3)
    bottom.plot(steps, curves["rel_err"], ".-", color="tab:blue", lw=1, markersize=3)
    limit = result.profile.thresholds.get("loss_mean_rel_err")
    if limit:
        bottom.axhline(limit, color="tab:red", ls="--", lw=1, label="mean-error threshold")
        bottom.legend(fontsize=8)
    bottom.set_ylabel("relative error")
    bottom.set_xlabel("step")
    bottom.grid(alpha=0.3)
    fig.tight_layout()
    with atomic.replacing(path, suffix=os.path.splitext(path)[1]) as tmp:
        fig.savefig(tmp, dpi=100)
    plt.close(fig)


def write_all(result: Comparison, out_dir: str, name: str) -> dict[str, str]:
    """``<out_dir>/<name>.json`` and ``.png``; returns their paths."""
    os.makedirs(out_dir, exist_ok=True)
    paths = {"json": os.path.join(out_dir, f"{name}.json"), "png": os.path.join(out_dir, f"{name}.png")}
    write_json(result, paths["json"])
    plot(result, paths["png"])
    return paths
