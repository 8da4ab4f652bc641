"""`trex fidelity seam RUN`: did a run that moved (trex.checkpoint.migration) keep converging like
it would have without the move?

For a move recorded in ``RUN/migrations.jsonl`` at step s (the last one, or ``at``), the first
``steps`` steps after it, s+1 .. s+steps, are compared with a reference for the same steps under the
profile that fits the change (the move's ``profile``, or ``profile``):

- by default, a **continuation on the old configuration**: the run's recipe (RUN/config.toml) with
  the old device, precision and layout, resumed from the move's checkpoint for ``steps`` steps into
  ``RUN/seams/step_<s>/`` (torchrun when the old layout had several processes). When the old device
  type is not here, this is refused with the reason;
- or ``reference``: a run directory or golden file holding those steps (a continuation made on the
  old cluster, or the calibrated golden file; its envelope is used as in `compare`), or a record of
  `trex fidelity record --from-checkpoint` made on the old cluster from the move's checkpoint.

Per-layer and probe checks are switched off when neither side recorded them inside the window
(``[fidelity] every`` longer than it), and the report says so. The verdict is logged (and
appended to ``RUN/train.log``), kept in ``RUN/seams.json`` and written into ``RUN/summary.json``
(``seams``); the compare report lands in ``RUN/fidelity/seam_step_<s>.{json,png}``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys

from trex import atomic, logs
from trex.checkpoint.migration import describe, read
from trex.fidelity.compare import Comparison, compare
from trex.fidelity.matrix import failure_line, train_args
from trex.fidelity.profiles import Profile, get_profile
from trex.fidelity.report import write_all
from trex.fidelity.runs import FidelityInputError, RunSignals, load_signals

SEAMS_FILE = "seams.json"
log = logging.getLogger(__name__)
WINDOW_SIGNALS = ("layer_grad_norm_rel_err", "layer_grad_scale_rel_err", "probe_kl", "probe_loss_rel_err")


def window(signals: RunSignals, first: int, last: int) -> RunSignals:
    """``signals`` cut to steps first .. last (metrics, per-layer norms, probe records)."""
    def cut(records: dict) -> dict:
        return {s: r for s, r in records.items() if first <= s <= last}

    return dataclasses.replace(signals, metrics=cut(signals.metrics), grad_norms=cut(signals.grad_norms),
                               probe=cut(signals.probe))


def old_configuration(move: dict) -> list[str]:
    """Recipe overrides that put a run back on the configuration it moved from."""
    old = move["from"]
    overrides = [f"train.device={json.dumps(old['device'])}", f"precision.dtype={json.dumps(old['precision'])}"]
    overrides += [f"parallel.{k}={old[k]}" for k in ("dp_replicate", "ep", "cp")]
    overrides += [f"{section}.{k}={old[k]}" for section, k in (("data", "micro_batch_size"), ("train", "grad_accum"))
                  if old.get(k) is not None]
    return [*overrides, "parallel.dp_shard=-1"]


def continue_old(run: str, move: dict, steps: int) -> str:
    """Train the old configuration from the move's checkpoint for ``steps`` steps; returns its run
    directory. ValueError when it cannot run here (its device type is absent, the launch fails)."""
    from trex import device as device_layer

    try:
        device_layer.detect(move["from"]["device"])
    except (ValueError, RuntimeError) as e:
        raise ValueError(f"the old configuration ({move['from']['device']}) cannot run here ({e}); pass --reference: "
                         "a continuation trained on the old cluster, or a calibrated golden file") from None
    if not os.path.isdir(move["checkpoint"]):
        raise ValueError(f"the checkpoint the run moved from, {move['checkpoint']}, is gone (pruned by "
                         "checkpoint.keep_last?): pass --reference, or keep more checkpoints")
    out = os.path.join(run, "seams", f"step_{move['step']}")
    overrides = [*old_configuration(move), f"checkpoint.resume={json.dumps(move['checkpoint'])}",
                 f"train.steps={move['step'] + steps}", "checkpoint.save_every=0", "train.progress=false",
                 "train.overwrite=true"]
    args = train_args(os.path.join(run, "config.toml"), out, overrides)
    world = int(move["from"]["world_size"])
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world), "--standalone"] \
        if world > 1 else [sys.executable]
    proc = subprocess.run([*launch, *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise ValueError(f"the continuation on the old configuration failed: {failure_line(proc, proc.stderr)}")
    return out


def judge(run: str, move: dict, steps: int, reference: str, profile: Profile,
          envelope: str = "note") -> tuple[Comparison, list[str]]:
    """Compare steps s+1 .. s+steps of ``run`` with ``reference``; returns the comparison and notes."""
    first, last = move["step"] + 1, move["step"] + steps
    mine, theirs = window(load_signals(run), first, last), window(load_signals(reference), first, last)
    if not mine.metrics:
        raise FidelityInputError(f"{run}: no steps after the move at step {move['step']} (it ended there)")
    notes = []
    if not (set(mine.grad_norms) & set(theirs.grad_norms)) or not (set(mine.probe) & set(theirs.probe)):
        profile = profile.with_overrides({m: None for m in WINDOW_SIGNALS})
        notes.append(f"per-layer and probe checks off: no common records in steps {first}-{last} "
                     "([fidelity] every is longer than the window)")
    return compare(mine, theirs, profile, allow_prefix=True, envelope=envelope), notes


def seam(run: str, steps: int = 3, reference: str | None = None, at: int | None = None,
         profile: str | None = None, envelope: str = "note") -> dict:
    """Judge one move of ``run``; returns the seam record (also written to the run directory)."""
    moves = read(run)
    if not moves:
        raise FidelityInputError(f"{run}: the run never moved (no migrations.jsonl); a seam needs a resume under "
                                 "another device, precision or layout")
    chosen = [m for m in moves if at is None or m["step"] == at]
    if not chosen:
        raise FidelityInputError(f"{run}: no move at step {at}; moves at steps {[m['step'] for m in moves]}")
    move = chosen[-1]
    prof = get_profile(profile or move["profile"])
    if reference and os.path.isfile(os.path.join(reference, "record.json")):  # `trex fidelity record --from-checkpoint`
        from trex.fidelity.record import continuation_of

        reference = continuation_of(reference, move["step"])
    print(f"[seam] {describe(move)}; profile {prof.name}", file=sys.stderr)
    ref = reference or continue_old(run, move, steps)
    result, notes = judge(run, move, steps, ref, prof, envelope)
    paths = write_all(result, os.path.join(run, "fidelity"), f"seam_step_{move['step']}")
    entry = {"step": move["step"], "move": describe(move), "profile": prof.name, "reference": ref,
             "steps": [move["step"] + 1, move["step"] + len(result.steps)], "verdict": result.verdict,
             "failed": [c.measure for c in result.checks if c.status == "FAIL"], "notes": notes + result.notes,
             "report": paths["json"], "plot": paths["png"], "devices": result.devices}
    handler = logs.to_file(os.path.join(run, "train.log")) if os.path.isfile(os.path.join(run, "train.log")) else None
    try:  # the run's log says it too
        log.info("seam at step %d (%s): %s under %s, steps %d-%d against %s", move["step"], describe(move),
                 result.verdict, prof.name, entry["steps"][0], entry["steps"][1], ref)
    finally:
        if handler is not None:
            logs.remove(handler)
    seams = [s for s in _read_json(os.path.join(run, SEAMS_FILE), []) if s["step"] != move["step"]] + [entry]
    atomic.write_json(os.path.join(run, SEAMS_FILE), sorted(seams, key=lambda s: s["step"]))
    summary_path = os.path.join(run, "summary.json")
    summary = _read_json(summary_path, None)
    if summary is not None:
        atomic.write_json(summary_path, {**summary, "seams": sorted(seams, key=lambda s: s["step"])})
    return {"entry": entry, "result": result}


def _read_json(path: str, default):
    if not os.path.exists(path):
        return default
    with open(path) as f:
        return json.load(f)
