"""What `trex report` is built from: the files the other commands already write, read and checked.

    trex audit CODE --format json -o audit.json           -> read_audit
    trex doctor --format json > doctor.json (per cluster)  -> read_doctor
    trex plan RECIPE --hardware H --devices N --format json > plan.json   -> read_plan
    trex fidelity matrix | ladder | seam | compare outputs -> read_fidelity
    trex train RECIPE (with [drafter]) -> its run directory  -> read_drafter

Every reader returns plain dicts that keep the path they came from (``source``), so each number in
the report names its file. A file that is missing, not JSON, or not the kind its flag expects is a
:class:`ReportInputError` naming the file and what was expected.
"""

from __future__ import annotations

import json
import os


class ReportInputError(ValueError):
    """An input file `trex report` cannot use; the message names it and what was expected."""


def _load(path: str, what: str):
    if not os.path.isfile(path):
        raise ReportInputError(f"{path}: no such file (expected {what})")
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ReportInputError(f"{path}:{e.lineno}: not JSON ({e.msg}); expected {what}") from None


def _need(data, keys: tuple[str, ...], path: str, what: str) -> None:
    missing = [k for k in keys if not isinstance(data, dict) or k not in data]
    if missing:
        raise ReportInputError(f"{path}: no {', '.join(missing)}; expected {what}")


def read_audit(path: str) -> dict:
    what = "the JSON of `trex audit CODE --format json`"
    data = _load(path, what)
    _need(data, ("summary", "findings"), path, what)
    return {**data, "source": path}


def read_doctor(label: str, path: str) -> dict:
    what = "the JSON of `trex doctor --format json`"
    data = _load(path, what)
    _need(data, ("environment", "precision", "distributed"), path, what)
    return {**data, "label": label, "source": path}


def read_plan(path: str) -> dict:
    """One plan (a `trex plan --format json` object, or the first row of a --search list)."""
    what = "the JSON of `trex plan ... --format json`"
    data = _load(path, what)
    if isinstance(data, list) and data:
        data = data[0]
    _need(data, ("model", "hardware", "layout", "fits", "memory_bytes", "usable_bytes", "time_s", "mfu",
                 "seq_len", "global_batch_tokens", "tokens_per_s_per_device"), path, what)
    return {**data, "source": path}


def read_fidelity(path: str) -> dict:
    """A fidelity result: ``matrix.json``, ``ladder.json``, ``seams.json`` (or the directories that
    hold them: a matrix's or ladder's --out, a run that moved), or a `compare` report JSON. Returns
    ``{"kind": matrix | ladder | seams | compare, "data": ..., "source": file, "dir": its folder}``."""
    if os.path.isdir(path):
        for name in ("matrix.json", "ladder.json", "seams.json"):
            if os.path.isfile(os.path.join(path, name)):
                return read_fidelity(os.path.join(path, name))
        raise ReportInputError(f"{path}: no matrix.json, ladder.json or seams.json (expected the --out of `trex "
                               "fidelity matrix` or `ladder`, or a run directory that `trex fidelity seam` judged)")
    what = "matrix.json, ladder.json, seams.json or a `trex fidelity compare` report"
    data = _load(path, what)
    kind = ("seams" if isinstance(data, list) else "matrix" if "variants" in data else
            "ladder" if "rungs" in data else "compare" if "checks" in data else None) \
        if isinstance(data, (list, dict)) else None
    if kind is None:
        raise ReportInputError(f"{path}: not a fidelity result; expected {what}")
    return {"kind": kind, "data": data, "source": path, "dir": os.path.dirname(path)}


def read_drafter(path: str) -> dict:
    """A run's ``[drafter]`` re-fit: ``summary.json`` of a run directory (or the file itself) with its
    ``drafter`` section (acceptance (a) base, (b) post_trained_old, (c) refit; the re-fit's cost)."""
    what = "a `trex train` run directory (or its summary.json) of a recipe with [drafter]"
    file = os.path.join(path, "summary.json") if os.path.isdir(path) else path
    data = _load(file, what)
    _need(data, ("drafter", "mode"), file, what)
    _need(data["drafter"], ("acceptance", "steps", "time_s", "main_time_s", "peak_memory_bytes"), file, what)
    return {**data["drafter"], "mode": data["mode"], "run": path, "source": file}
