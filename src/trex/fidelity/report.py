"""A comparison as a readable table, a JSON file and a PNG (both curves, the band, the relative error)."""

from __future__ import annotations

import json
import math
import os

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
    lines.append(f"{'measure':<26} {'value':>11} {'threshold':>11}  status  detail")
    for c in result.checks:
        lines.append(f"{c.measure:<26} {_fmt(c.value):>11} {_fmt(c.threshold):>11}  {c.status:<6}  {c.detail}")
    lines.append("")
    lines.append(f"verdict: {result.verdict}")
    return "\n".join(lines)


def _atomic_replace(tmp: str, path: str) -> None:
    os.replace(tmp, path)


def write_json(result: Comparison, path: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(result.to_dict(), f, indent=2)
    _atomic_replace(tmp, path)


def plot(result: Comparison, path: str) -> None:
    """Top: reference and run loss, the EMA of the reference with the profile's band. Bottom: the
    per-step relative error with the mean-error threshold."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps, curves = result.steps, result.curves
    band = result.profile.thresholds.get("loss_band_rel")
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True, gridspec_kw={"height_ratios": [2, 1]})
    top.plot(steps, curves["ref"], "-", color="0.4", lw=1, label="reference")
    top.plot(steps, curves["run"], "-", color="tab:blue", lw=1, label="run")
    if band is not None:
        lo = [v * (1 - band) for v in curves["ema_ref"]]
        hi = [v * (1 + band) for v in curves["ema_ref"]]
        top.fill_between(steps, lo, hi, color="tab:green", alpha=0.25, label=f"band ±{band:g} (EMA {result.profile.ema:g})")
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
    root, ext = os.path.splitext(path)
    tmp = f"{root}.tmp{ext}"
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    _atomic_replace(tmp, path)


def write_all(result: Comparison, out_dir: str, name: str) -> dict[str, str]:
    """``<out_dir>/<name>.json`` and ``.png``; returns their paths."""
    os.makedirs(out_dir, exist_ok=True)
    paths = {"json": os.path.join(out_dir, f"{name}.json"), "png": os.path.join(out_dir, f"{name}.png")}
    write_json(result, paths["json"])
    plot(result, paths["png"])
    return paths
