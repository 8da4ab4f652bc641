"""Compare a run with its reference: align steps, measure, check each measure against a profile.

    result = compare(load_signals("runs/x"), load_signals("fidelity/golden/default_cpu_fp32.json"),
                     get_profile("layout"))
    result.passed, result.checks, result.to_dict()

Relative errors divide by the reference value. The probe KL is computed on the reference's top-k
next-token probabilities plus one remainder bucket (1 - their sum); a reference token missing from
the run's top-k is given the run's k-th probability, an upper bound, so the KL is then a lower
bound (the top-1 agreement is reported next to it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from trex import device, logs
from trex.fidelity.profiles import MEASURES, ROLLOUT_MEASURES, Profile
from trex.fidelity.runs import FidelityInputError, RunSignals, check_reference

_TINY = 1e-12


@dataclass
class Check:
    measure: str
    value: float | None
    """None: the data to measure it is missing."""
    threshold: float | None
    """None: the check is off."""
    detail: str = ""

    applies: bool = True
    """False: the runs carry nothing this measure judges (an RL measure of an SFT run): n/a."""
    spread: float | None = None
    """The reference's own run-to-run spread of this measure (a calibrated golden file), or None."""

    @property
    def status(self) -> str:
        if self.threshold is None:
            return "off"
        if not self.applies:
            return "n/a"
        if self.value is None:
            return "FAIL"
        return "PASS" if self.value <= self.threshold else "FAIL"


@dataclass
class Comparison:
    run: str
    reference: str
    profile: Profile
    metric: str
    steps: list[int]
    """Steps both logged, ascending."""
    missing_in_run: list[int]
    not_reached: list[int]
    """Reference steps after the run's last step."""
    first_step_outside_band: int | None
    checks: list[Check]
    layer_errors: dict[str, float] = field(default_factory=dict)
    layer_scale_errors: dict[str, float] = field(default_factory=dict)
    layer_step_errors: dict[str, dict[int, float]] = field(default_factory=dict)
    """Per layer group and recorded step: the relative error of its gradient norm (``layer_errors`` is
    their mean)."""
    curves: dict[str, list[float]] = field(default_factory=dict)
    """ref, run, ema_ref, ema_run, rel_err: per aligned step (for the plot)."""
    counts: dict[str, dict[str, int]] = field(default_factory=dict)
    probe_top1_agreement: float | None = None
    notes: list[str] = field(default_factory=list)
    """Thresholds tighter than the reference's calibrated spread."""
    devices: dict[str, dict] = field(default_factory=dict)
    """run, reference: where each was measured (trex.device.identity), for reports that attribute evidence."""

    @property
    def passed(self) -> bool:
        return all(c.status != "FAIL" for c in self.checks)

    @property
    def verdict(self) -> str:
        return "PASS" if self.passed else "FAIL"

    def to_dict(self) -> dict:
        return {
            "verdict": self.verdict, "run": self.run, "reference": self.reference, "metric": self.metric,
            "profile": {"name": self.profile.name, "ema": self.profile.ema, "thresholds": self.profile.thresholds,
                        "rationale": self.profile.rationale},
            "steps": {"aligned": len(self.steps), "first": self.steps[0], "last": self.steps[-1],
                      "missing_in_run": self.missing_in_run, "not_reached": self.not_reached},
            "first_step_outside_band": self.first_step_outside_band,
            "checks": [{"measure": c.measure, "value": c.value, "threshold": c.threshold, "status": c.status,
                        "spread": c.spread, "detail": c.detail, "meaning": MEASURES[c.measure]} for c in self.checks],
            "notes": self.notes,
            "devices": self.devices,
            "layer_grad_norm_rel_err": self.layer_errors,
            "layer_grad_scale_rel_err": self.layer_scale_errors,
            "layer_grad_norm_rel_err_per_step": self.layer_step_errors,
            "probe_top1_agreement": self.probe_top1_agreement,
            "counts": self.counts,
            "curves": {"steps": self.steps, **self.curves},
        }


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), _TINY)


def _ema(values: list[float], weight: float) -> list[float]:
    """EMA with ``weight`` on the newest value; a non-finite value holds the previous average."""
    out, avg = [], None
    for v in values:
        if math.isfinite(v):
            avg = v if avg is None else avg + weight * (v - avg)
        out.append(avg if avg is not None else math.nan)
    return out


def _skipped(signals: RunSignals) -> int:
    last = signals.metrics[signals.steps[-1]]
    return int(last.get("skipped_steps", signals.summary.get("skipped_steps", 0)) or 0)


NONFINITE_WINDOW = 50  # steps per window of the non-finite counts (Ascend msprobe compares per 50 steps)


def skips_per_window(signals: RunSignals, window: int = NONFINITE_WINDOW) -> dict[int, int]:
    """Skipped (non-finite) steps per window of ``window`` steps (window w holds steps w*window+1 ..
    (w+1)*window), from the cumulative ``skipped_steps`` of the metric lines."""
    counts: dict[int, int] = {}
    before = 0
    for step in signals.steps:
        total = int(signals.metrics[step].get("skipped_steps", before) or 0)
        if total > before:
            counts[(step - 1) // window] = counts.get((step - 1) // window, 0) + total - before
        before = total
    return counts


def _layer_errors(run: RunSignals, ref: RunSignals,
                  floor: float) -> tuple[dict[str, dict[int, float]], dict[str, float]] | None:
    """Per layer group: (its relative error at each common recorded step, relative error of its norm
    averaged over those steps). A group's reference norm below ``floor`` x the reference's
    global norm (the root of the groups' squared norms, at that step or averaged) is replaced by
    that floor in the denominator."""
    steps = sorted(set(run.grad_norms) & set(ref.grad_norms))
    if not steps:
        return None
    per_step: dict[str, dict[int, float]] = {}
    sums: dict[str, list[float]] = {}
    global_sum = 0.0
    for step in steps:
        a, b = run.grad_norms[step], ref.grad_norms[step]
        if set(a) != set(b):
            raise FidelityInputError(
                f"per-layer gradient norms at step {step} cover different layer groups: only in {run.source}: "
                f"{sorted(set(a) - set(b))[:6]}, only in {ref.source}: {sorted(set(b) - set(a))[:6]} "
                "(different models?)")
        global_ref = math.sqrt(sum(v * v for v in b.values()))
        global_sum += global_ref
        for group, ref_norm in b.items():
            scale = max(abs(ref_norm), floor * global_ref, _TINY)
            per_step.setdefault(group, {})[step] = abs(a[group] - ref_norm) / scale if math.isfinite(a[group]) else math.inf
            total = sums.setdefault(group, [0.0, 0.0])
            total[0] += a[group]
            total[1] += ref_norm
    n = len(steps)
    averaged = {g: abs(r - f) / n / max(abs(f) / n, floor * global_sum / n, _TINY) if math.isfinite(r) else math.inf
                for g, (r, f) in sums.items()}
    return per_step, averaged


def position_kl(ref_ids: list[int], ref_logp: list[float], run_ids: list[int], run_logp: list[float]) -> float:
    """KL(ref || run) over the reference's top-k tokens plus a remainder bucket (see module docstring)."""
    run_map = dict(zip(run_ids, run_logp))
    floor = min(run_logp)
    kl, p_sum, q_sum = 0.0, 0.0, 0.0
    for token, lp in zip(ref_ids, ref_logp):
        lq = run_map.get(token, floor)
        p = math.exp(lp)
        kl += p * (lp - lq)
        p_sum += p
        q_sum += math.exp(lq)
    rest_p, rest_q = max(1.0 - p_sum, _TINY), max(1.0 - q_sum, _TINY)
    return kl + rest_p * math.log(rest_p / rest_q)


def _probe(run: RunSignals, ref: RunSignals) -> tuple[float, float, float] | None:
    """(max mean KL, max probe-loss relative error, top-1 agreement) over common probe steps."""
    steps = sorted(set(run.probe) & set(ref.probe))
    if not steps:
        return None
    kls, loss_errors, agree, total = [], [], 0, 0
    for step in steps:
        a, b = run.probe[step], ref.probe[step]
        if a.get("positions") != b.get("positions"):
            raise FidelityInputError(f"probe positions at step {step} differ between {run.source} and {ref.source}: "
                                     "the runs used different probe data or [fidelity] settings")
        per_position = [position_kl(ri, rl, ui, ul) for ri, rl, ui, ul in zip(b["ids"], b["logprobs"], a["ids"],
                                                                             a["logprobs"])]
        kls.append(sum(per_position) / max(1, len(per_position)))
        loss_errors.append(_rel(a["loss"], b["loss"]) if math.isfinite(a["loss"]) else math.inf)
        agree += sum(ri[0] == ui[0] for ri, ui in zip(b["ids"], a["ids"]))
        total += len(b["ids"])
    return max(kls), max(loss_errors), agree / max(1, total)


ENVELOPE_MODES = ("note", "widen")


def compare(run: RunSignals, ref: RunSignals, profile: Profile, metric: str = "loss",
            allow_prefix: bool = False, envelope: str = "note") -> Comparison:
    """Measure ``run`` against ``ref`` and check every measure against ``profile``.

    ``allow_prefix``: the run may stop before the reference (a short re-run of a longer golden run);
    only the reference steps up to the run's last step must be present. When the reference carries
    a calibrated envelope (trex.fidelity.calibrate), every check records the reference's own spread;
    ``envelope="note"`` says where a threshold is tighter than it, ``"widen"`` judges by
    max(threshold, spread); per-layer measures calibrated per group (``group_spread``) are judged
    group by group, each by max(threshold, its own spread), and the per-step one, where the envelope
    keeps its spread per recorded step too (``group_step_spread``), step by step (`_step_bound`).
    """
    if envelope not in ENVELOPE_MODES:
        raise FidelityInputError(f"envelope {envelope!r}: expected one of {', '.join(ENVELOPE_MODES)}")
    result = _compare(run, ref, profile, metric, allow_prefix)
    result.devices = {"run": device.identity(run.environment), "reference": device.identity(ref.environment)}
    bounds = ref.envelope.get("loss", {}) if metric == "loss" else {}
    if bounds:  # the reference's run-to-run loss envelope, for the plot
        lo, hi = dict(zip(bounds["steps"], bounds["min"])), dict(zip(bounds["steps"], bounds["max"]))
        result.curves["envelope_lo"] = [lo.get(s, math.nan) for s in result.steps]
        result.curves["envelope_hi"] = [hi.get(s, math.nan) for s in result.steps]
    spread = ref.envelope.get("spread", {}).get(profile.name, {})
    group_spread = ref.envelope.get("group_spread", {}).get(profile.name, {})
    step_spread = ref.envelope.get("group_step_spread", {}).get(profile.name, {})
    for check in result.checks:
        per_group = group_spread.get(check.measure)
        if per_group and check.threshold is not None and check.value is not None:
            _judge_by_group(check, result, per_group, envelope,
                            step_spread if check.measure == "layer_grad_norm_rel_err" else {})
            continue
        check.spread = spread.get(check.measure)
        if check.spread is None or check.threshold is None or check.threshold >= check.spread:
            continue
        if envelope == "widen":
            check.detail += f"{'; ' if check.detail else ''}threshold {check.threshold:g} widened to the reference's spread"
            check.threshold = check.spread
        else:
            result.notes.append(f"{check.measure}: the threshold {check.threshold:g} is tighter than the reference's "
                                f"own spread {check.spread:.3g} (--envelope widen judges by the spread)")
    return result


def _judge_by_group(check: Check, result: Comparison, per_group: dict[str, float], envelope: str,
                    per_step: dict[str, dict[str, float]]) -> None:
    """A per-layer check against a reference calibrated per layer group: each group's bound is
    max(threshold, its own spread) under ``widen`` (the threshold under ``note``, which names the
    groups whose spread exceeds it); with ``per_step`` (group -> recorded step -> spread) the bound
    of the per-step measure comes from the spread at each step (`_step_bound`). The check then holds
    the group worst by error / bound: its error, its bound, its spread."""
    errors = result.layer_errors if check.measure == "layer_grad_norm_rel_err" else result.layer_scale_errors
    t = check.threshold
    bound = {g: max(t, per_group.get(g, 0.0)) if envelope == "widen" else t for g in errors}
    by_step = envelope == "widen" and bool(per_step)
    if by_step:
        bound = {g: _step_bound(result.layer_step_errors[g], per_step.get(g, {}), t, bound[g]) for g in errors}
    worst = max(errors, key=lambda g: errors[g] / max(bound[g], _TINY))
    check.value, check.threshold, check.spread = errors[worst], bound[worst], per_group.get(worst)
    check.detail = f"worst group {worst} (its spread {per_group.get(worst, 0.0):.3g}" + (
        f", bound {bound[worst]:.3g}{' from its spread at each step' if by_step else ''})" if envelope == "widen" else ")")
    noisy = sorted(g for g, v in per_group.items() if v > t)
    if noisy and envelope != "widen":
        result.notes.append(f"{check.measure}: the threshold {t:g} is tighter than the reference's own spread in "
                            f"{', '.join(noisy)} (--envelope widen judges each group by its spread)")


def _step_bound(errors: dict[int, float], spread: dict[str, float], threshold: float, fallback: float) -> float:
    """The bound of a group's per-step error judged step by step: each recorded step's error in units
    of that step's bound, max(``threshold``, the spread at that step; ``fallback`` where the reference
    kept none for it), averaged over the steps, must be <= 1. Returned as the bound of the group's mean
    error that this amounts to (mean error / mean units: the error-weighted harmonic mean of the step
    bounds), so that error <= bound is the verdict. A chaotic late step then counts against the noise
    at that step, not against the noise averaged over a run whose early steps are quiet."""
    bounds = {s: max(threshold, spread[str(s)]) if str(s) in spread else fallback for s in errors}
    units = sum(e / max(bounds[s], _TINY) for s, e in errors.items()) / len(errors)
    if not math.isfinite(units):
        return fallback
    return sum(errors.values()) / len(errors) / units if units > 0 else sum(bounds.values()) / len(bounds)


def _compare(run: RunSignals, ref: RunSignals, profile: Profile, metric: str, allow_prefix: bool) -> Comparison:
    for signals in (run, ref):
        if metric not in signals.metric_names():
            raise FidelityInputError(f"{signals.source} logs no `{metric}`; run metrics: {run.metric_names()}, "
                                     f"reference metrics: {ref.metric_names()}")
    check_reference(ref, metric)
    run_series, ref_series = run.series(metric), ref.series(metric)
    steps = sorted(set(run_series) & set(ref_series))
    if not steps:
        raise FidelityInputError(f"no common steps: {run.source} logs steps {run.steps[0]}..{run.steps[-1]}, "
                                 f"{ref.source} logs {ref.steps[0]}..{ref.steps[-1]}")
    last_run = max(run_series)
    missing = [s for s in ref_series if s <= last_run and s not in run_series]
    not_reached = [s for s in ref_series if s > last_run]
    t = profile.thresholds

    a = [run_series[s] for s in steps]
    b = [ref_series[s] for s in steps]
    finite = [(x, y) for x, y in zip(a, b) if math.isfinite(x)]
    rel = [_rel(x, y) if math.isfinite(x) else math.nan for x, y in zip(a, b)]
    ema_a, ema_b = _ema(a, profile.ema), _ema(b, profile.ema)
    band = [_rel(x, y) if math.isfinite(x) and math.isfinite(y) else math.inf for x, y in zip(ema_a, ema_b)]
    band_limit = t.get("loss_band_rel")
    outside = [s for s, dev in zip(steps, band) if band_limit is not None and dev > band_limit]
    nonfinite = sum(not math.isfinite(v) for v in run_series.values())

    first = steps[0]
    mean_a, mean_b = (sum(v) / len(v) for v in (a, b))
    checks = [
        Check("steps_short", float(max(0, profile.min_steps - len(steps))), t.get("steps_short"),
              f"{len(steps)} aligned steps; the profile asks for {profile.min_steps}"),
        Check("first_loss_err", abs(a[0] - b[0]) / max(abs(b[0]), 1.0) if math.isfinite(a[0]) else None,
              t.get("first_loss_err"), f"step {first}: run {a[0]:.6g}, reference {b[0]:.6g}"),
        Check("loss_mean_delta", abs(mean_a - mean_b) / max(abs(mean_b), 1.0) if math.isfinite(mean_a) else None,
              t.get("loss_mean_delta"), f"means over {logs.plural(len(steps), 'step')}: run {mean_a:.6g}, "
              f"reference {mean_b:.6g}"),
        Check("missing_steps", float(len(missing) + (0 if allow_prefix else len(not_reached))),
              t.get("missing_steps"), f"{len(missing)} missing inside the run, {len(not_reached)} after its end"
              + (" (prefix run)" if allow_prefix else "")),
        Check("loss_mean_rel_err", sum(_rel(x, y) for x, y in finite) / len(finite) if finite else None,
              t.get("loss_mean_rel_err"), f"over {logs.plural(len(finite), 'step')}"),
        Check("loss_band_rel", max(band), band_limit,
              f"EMA weight {profile.ema}; first step outside: {outside[0] if outside else 'none'}"),
        Check("final_loss_rel_delta", rel[-1] if math.isfinite(rel[-1]) else None, t.get("final_loss_rel_delta"),
              f"step {steps[-1]}: run {a[-1]:.6g}, reference {b[-1]:.6g}"),
    ]
    gn_run, gn_ref = run.series("grad_norm"), ref.series("grad_norm")
    gn_steps = [s for s in steps if s in gn_run and s in gn_ref and math.isfinite(gn_run[s])]
    checks.append(Check("grad_norm_mean_rel_err",
                        sum(_rel(gn_run[s], gn_ref[s]) for s in gn_steps) / len(gn_steps) if gn_steps else None,
                        t.get("grad_norm_mean_rel_err"),
                        f"over {logs.plural(len(gn_steps), 'step')}" if gn_steps else "no common grad_norm steps"))
    per_step, scales = _layer_errors(run, ref, profile.layer_norm_floor) or ({}, {})
    layers = {g: sum(e.values()) / len(e) for g, e in per_step.items()}
    for measure, errors in (("layer_grad_norm_rel_err", layers), ("layer_grad_scale_rel_err", scales)):
        worst = max(errors, key=errors.get) if errors else None
        checks.append(Check(measure, errors[worst] if errors else None, t.get(measure),
                            f"worst group {worst}" if errors else "no common grad_norms.jsonl steps ([fidelity] every)"))
    probe = _probe(run, ref)
    checks.append(Check("probe_kl", probe[0] if probe else None, t.get("probe_kl"),
                        f"top-1 agreement {probe[2]:.1%}" if probe else "no common probe.jsonl steps"))
    checks.append(Check("probe_loss_rel_err", probe[1] if probe else None, t.get("probe_loss_rel_err")))
    counts = {"run": {"nonfinite_losses": nonfinite, "skipped_steps": _skipped(run)},
              "reference": {"nonfinite_losses": 0, "skipped_steps": _skipped(ref)}}
    checks.append(Check("nonfinite_losses", float(nonfinite), t.get("nonfinite_losses")))
    checks.append(Check("extra_skipped_steps", float(counts["run"]["skipped_steps"] - counts["reference"]["skipped_steps"]),
                        t.get("extra_skipped_steps"),
                        f"run {counts['run']['skipped_steps']}, reference {counts['reference']['skipped_steps']}"))
    run_w, ref_w = skips_per_window(run), skips_per_window(ref)
    excess = {w: run_w.get(w, 0) - ref_w.get(w, 0) for w in run_w}
    worst = max(excess, key=excess.get) if excess else None
    checks.append(Check("nonfinite_window_excess", float(max(0, excess[worst])) if excess else 0.0,
                        t.get("nonfinite_window_excess"),
                        f"worst window steps {worst * NONFINITE_WINDOW + 1}-{(worst + 1) * NONFINITE_WINDOW}: run "
                        f"{run_w[worst]}, reference {ref_w.get(worst, 0)}" if excess else "no skipped steps in the run"))
    checks += _rollout_checks(run, ref, steps, t)
    return Comparison(run=run.source, reference=ref.source, profile=profile, metric=metric, steps=steps,
                      missing_in_run=missing, not_reached=not_reached,
                      first_step_outside_band=outside[0] if outside else None, checks=checks,
                      layer_errors=layers, layer_scale_errors=scales, layer_step_errors=per_step,
                      curves={"ref": b, "run": a, "ema_ref": ema_b, "ema_run": ema_a, "rel_err": rel},
                      counts=counts, probe_top1_agreement=probe[2] if probe else None)


def _rollout_checks(run: RunSignals, ref: RunSignals, steps: list[int], t: dict) -> list[Check]:
    """RL trainer-vs-sampler parity, step by step against the reference (ROLLOUT_MEASURES): the
    largest excess of the run's mismatch over the reference's at the same step."""
    checks = []
    for measure, metric in ROLLOUT_MEASURES.items():
        a, b = run.series(metric), ref.series(metric)
        if not b:
            checks.append(Check(measure, None, t.get(measure), f"the reference logs no {metric}" +
                                (" (the run does)" if a else ""), applies=False))
            continue
        common = [s for s in steps if s in b and math.isfinite(b[s])]
        sign = -1.0 if metric == "rollout/pearson" else 1.0  # a drop in correlation, a rise in the others
        excess = [sign * (a[s] - b[s]) if s in a and math.isfinite(a[s]) else math.inf for s in common]
        worst = max(range(len(excess)), key=excess.__getitem__) if excess else None
        checks.append(Check(measure, max(0.0, excess[worst]) if excess else None, t.get(measure),
                            f"worst step {common[worst]}: run {a.get(common[worst], math.nan):.3g}, reference "
                            f"{b[common[worst]]:.3g}" if excess else f"no common steps with {metric}"))
    return checks
