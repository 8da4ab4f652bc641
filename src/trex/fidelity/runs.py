"""A run's fidelity signals, read from a run directory or a golden reference file.

Both hold the same records: metrics.jsonl lines, grad_norms.jsonl lines and probe.jsonl lines,
plus the run's config and environment. Reading checks them: no records, a line that is not a JSON
object with an integer ``step``, or steps that do not strictly increase are errors naming the
file and line.
"""

from __future__ import annotations

import json
import math
import os
import tomllib
from dataclasses import dataclass, field

from trex.fidelity.profiles import MEASURES
from trex.train.signals import GRAD_NORMS_FILE, PROBE_FILE

GOLDEN_FORMAT = "trex-fidelity-golden/1"


class FidelityInputError(ValueError):
    """Input that cannot be compared; the message names the file (and line) and what was expected."""


@dataclass
class RunSignals:
    source: str
    """The run directory or golden file the signals came from."""
    metrics: dict[int, dict]
    """step -> the metrics.jsonl record of that step."""
    grad_norms: dict[int, dict[str, float]] = field(default_factory=dict)
    """step -> {layer group: gradient L2 norm}; empty when the run recorded none."""
    probe: dict[int, dict] = field(default_factory=dict)
    """step -> probe record (loss, positions, top-k ids and log-probs)."""
    config: dict = field(default_factory=dict)
    environment: dict = field(default_factory=dict)
    summary: dict = field(default_factory=dict)
    envelope: dict = field(default_factory=dict)
    """A calibrated golden file's run-to-run spread (trex.fidelity.calibrate): ``spread`` {profile:
    {measure: value}}, ``loss`` {steps, min, max}, ``runs``, ``variation``; empty when not calibrated."""

    def series(self, name: str) -> dict[int, float]:
        """step -> value of metric ``name`` at the steps that logged it."""
        return {s: float(r[name]) for s, r in self.metrics.items() if isinstance(r.get(name), (int, float))}

    def metric_names(self) -> list[str]:
        return sorted({k for r in self.metrics.values() for k, v in r.items()
                       if k != "step" and isinstance(v, (int, float))})

    @property
    def steps(self) -> list[int]:
        return sorted(self.metrics)


def by_step(records: list, where: str) -> dict[int, dict]:
    """Index records by their ``step``; ``where`` names the file for error messages."""
    out: dict[int, dict] = {}
    previous = None
    for line, record in enumerate(records, start=1):
        if not isinstance(record, dict) or isinstance(record.get("step"), bool) \
                or not isinstance(record.get("step"), int):
            raise FidelityInputError(f"{where}:{line}: expected a JSON object with an integer `step`, got "
                                     f"{str(record)[:80]}")
        step = record["step"]
        if previous is not None and step <= previous:
            raise FidelityInputError(f"{where}:{line}: step {step} after step {previous}; steps must strictly "
                                     "increase (a run resumed from an earlier checkpoint re-logs steps: compare "
                                     "a clean run, or cut the file at the restart)")
        out[step] = record
        previous = step
    return out


def read_jsonl(path: str) -> list:
    records = []
    with open(path) as f:
        for line, text in enumerate(f, start=1):
            if not text.strip():
                continue
            try:
                records.append(json.loads(text))
            except json.JSONDecodeError as e:
                raise FidelityInputError(f"{path}:{line}: invalid JSON ({e.msg})") from None
    return records


def _optional_jsonl(path: str) -> dict[int, dict]:
    return by_step(read_jsonl(path), path) if os.path.exists(path) else {}


def read_run_dir(path: str) -> RunSignals:
    metrics_path = os.path.join(path, "metrics.jsonl")
    if not os.path.exists(metrics_path):
        raise FidelityInputError(f"{path}: not a run directory (no metrics.jsonl) and not a golden file")
    metrics = by_step(read_jsonl(metrics_path), metrics_path)
    if not metrics:
        raise FidelityInputError(f"{metrics_path}: empty; expected one JSON line per logged step")
    config, summary = {}, {}
    if os.path.exists(os.path.join(path, "config.toml")):
        with open(os.path.join(path, "config.toml"), "rb") as f:
            config = tomllib.load(f)
    if os.path.exists(os.path.join(path, "summary.json")):
        with open(os.path.join(path, "summary.json")) as f:
            summary = json.load(f)
    grad_norms = {s: r.get("norms", {}) for s, r in _optional_jsonl(os.path.join(path, GRAD_NORMS_FILE)).items()}
    return RunSignals(source=path, metrics=metrics, grad_norms=grad_norms,
                      probe=_optional_jsonl(os.path.join(path, PROBE_FILE)), config=config,
                      environment=summary.get("device", {}), summary=summary)


def read_golden(path: str) -> RunSignals:
    try:
        with open(path) as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise FidelityInputError(f"{path}: invalid JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(data, dict) or data.get("format") != GOLDEN_FORMAT:
        raise FidelityInputError(f"{path}: not a golden reference (expected \"format\": \"{GOLDEN_FORMAT}\")")
    metrics = by_step(data.get("metrics", []), f"{path}: metrics[]")
    if not metrics:
        raise FidelityInputError(f"{path}: no metrics records")
    grad_norms = {s: r.get("norms", {}) for s, r in by_step(data.get("grad_norms", []), f"{path}: grad_norms[]").items()}
    return RunSignals(source=path, metrics=metrics, grad_norms=grad_norms,
                      probe=by_step(data.get("probe", []), f"{path}: probe[]"), config=data.get("config", {}),
                      environment=data.get("environment", {}), summary=data.get("summary", {}),
                      envelope=_envelope(data.get("envelope", {}), path))


def _envelope(envelope, path: str) -> dict:
    """A golden file's envelope, checked: known measures with numbers >= 0, loss bounds per step."""
    if not envelope:
        return {}
    spread = envelope.get("spread") if isinstance(envelope, dict) else None
    if not isinstance(spread, dict) or not all(isinstance(v, dict) for v in spread.values()):
        raise FidelityInputError(f"{path}: envelope: expected a `spread` object of {{profile: {{measure: value}}}}")
    for profile, measured in spread.items():
        for measure, value in measured.items():
            where = f"{path}: envelope.spread.{profile}.{measure}"
            if measure not in MEASURES:
                raise FidelityInputError(f"{where}: not a measure; known: {sorted(MEASURES)}")
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value >= 0:
                raise FidelityInputError(f"{where}: expected a number >= 0, got {value!r}")
    for profile, measures in envelope.get("group_spread", {}).items():
        for measure, per_group in (measures or {}).items():
            where = f"{path}: envelope.group_spread.{profile}.{measure}"
            if measure not in ("layer_grad_norm_rel_err", "layer_grad_scale_rel_err") or not isinstance(per_group, dict):
                raise FidelityInputError(f"{where}: expected layer_grad_norm_rel_err or layer_grad_scale_rel_err, "
                                         "each {group: value}")
            for group, value in per_group.items():
                if not isinstance(value, (int, float)) or isinstance(value, bool) or not value >= 0:
                    raise FidelityInputError(f"{where}.{group}: expected a number >= 0, got {value!r}")
    for profile, groups in envelope.get("group_step_spread", {}).items():
        for group, by_step in (groups or {}).items():
            where = f"{path}: envelope.group_step_spread.{profile}.{group}"
            if not isinstance(by_step, dict):
                raise FidelityInputError(f"{where}: expected {{step: value}}")
            for step, value in by_step.items():
                if not str(step).isdigit() or not isinstance(value, (int, float)) or isinstance(value, bool) \
                        or not value >= 0:
                    raise FidelityInputError(f"{where}.{step}: expected a step number and a number >= 0, got {value!r}")
    loss = envelope.get("loss", {})
    if loss and not (isinstance(loss, dict) and len(loss.get("steps", [])) == len(loss.get("min", []))
                     == len(loss.get("max", []))):
        raise FidelityInputError(f"{path}: envelope.loss: expected equally long `steps`, `min` and `max` lists")
    return envelope


def load_signals(path: str) -> RunSignals:
    """A run directory or a golden reference file."""
    if os.path.isdir(path):
        return read_run_dir(path)
    if os.path.isfile(path):
        return read_golden(path)
    raise FidelityInputError(f"{path}: no such run directory or golden file")


def check_reference(ref: RunSignals, metric: str) -> None:
    """A reference must be usable as ground truth: finite values of ``metric`` at every step."""
    bad = [s for s, v in ref.series(metric).items() if not math.isfinite(v)]
    if bad:
        raise FidelityInputError(f"{ref.source}: the reference has a non-finite {metric} at step(s) {bad[:5]}; "
                                 "a reference must be a healthy run")
