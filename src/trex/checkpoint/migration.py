"""A run that moves: resuming a checkpoint written under another device type, precision, world size
or parallel layout continues the same run (its step counter, data order, optimizer state; DCP
reshards the tensors, and a loss scaler enters or leaves fp16 at its initial state), and says so.

The configuration a checkpoint was written under is in its trainer state (``device``,
``precision``, ``world_size``, the recipe's ``[parallel]``). When it differs from the resuming
run's, the loop logs the move and records it in the run directory's ``migrations.jsonl``, one line
per move::

    {"step": 4, "checkpoint": ".../step_4", "changed": ["precision"], "profile": "precision",
     "from": {"device": "cpu", "precision": "fp32", "world_size": 1, "dp_replicate": 1, "ep": 1, "cp": 1,
              "micro_batch_size": 4, "grad_accum": 1},
     "to": {...}, "versions": {"from": {"trex": ..., "torch": ...}, "to": {...}}, "time": "..."}

``profile`` is the fidelity profile that fits the change (the loosest of its parts: a device
change is judged like another vendor, a precision change like bf16 against fp32, a layout change
like another layout); `trex fidelity seam RUN` judges the first steps after the move with it. A
checkpoint older than these fields has unknown parts, which are not compared.
"""

from __future__ import annotations

import json
import os
import time

import torch

import trex
from trex import atomic

MIGRATIONS_FILE = "migrations.jsonl"
LAYOUT_KEYS = ("world_size", "dp_replicate", "ep", "cp", "tp", "micro_batch_size", "grad_accum")
PROFILE_OF = {"device": "vendor", "precision": "precision", **{k: "layout" for k in LAYOUT_KEYS}}
_LOOSENESS = ("layout", "precision", "vendor")


def versions() -> dict[str, str]:
    return {"trex": trex.__version__, "torch": torch.__version__}


def _layout(recipe: dict, default) -> dict:
    """The layout part of a configuration, from a recipe as a dict (``default`` for sizes it lacks)."""
    parallel = recipe.get("parallel") or {}
    return {**{k: parallel.get(k, default) for k in ("dp_replicate", "ep", "cp", "tp")},
            "micro_batch_size": (recipe.get("data") or {}).get("micro_batch_size"),
            "grad_accum": (recipe.get("train") or {}).get("grad_accum")}


def configuration(device: str, precision: str, world_size: int, recipe: dict) -> dict:
    """What a move is measured over: device type, precision policy name, world size, the layout
    (``recipe``: the recipe as a dict; its [parallel] sizes, micro-batch size and grad-accum split)."""
    return {"device": device, "precision": precision, "world_size": int(world_size), **_layout(recipe, 1)}


def saved_configuration(trainer: dict) -> dict:
    """The configuration a checkpoint's trainer state was written under (None: not recorded)."""
    return {"device": trainer.get("device"), "precision": (trainer.get("precision") or {}).get("name"),
            "world_size": trainer.get("world_size"), **_layout(trainer.get("config") or {}, None)}


def migration(before: dict, after: dict, step: int, checkpoint: str, saved_versions: dict | None = None) -> dict | None:
    """The record of a move from ``before`` to ``after`` at ``step``, or None when nothing changed."""
    changed = [k for k in after if before.get(k) is not None and before[k] != after[k]]
    if not changed:
        return None
    profile = max((PROFILE_OF[k] for k in changed), key=_LOOSENESS.index)
    return {"step": step, "checkpoint": os.path.abspath(checkpoint), "changed": changed, "profile": profile,
            "from": before, "to": after, "versions": {"from": saved_versions or {}, "to": versions()},
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def describe(record: dict) -> str:
    """One line: ``device cpu -> vdev, precision fp32 -> bf16 at step 4``."""
    parts = [f"{k} {record['from'][k]} -> {record['to'][k]}" for k in record["changed"]]
    return f"{', '.join(parts)} at step {record['step']}"


def read(run_path: str) -> list[dict]:
    """The run's moves, oldest first ([] when it never moved)."""
    path = os.path.join(run_path, MIGRATIONS_FILE)
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def record(run_path: str, resumed_step: int, entry: dict | None) -> list[dict]:
    """Rewrite ``migrations.jsonl`` for a run resumed at ``resumed_step``: moves at later or equal
    steps belong to a history that resume discards; ``entry`` (this resume's move) is appended.
    Returns the run's moves."""
    kept = [m for m in read(run_path) if m["step"] < resumed_step]
    moves = kept + ([entry] if entry else [])
    path = os.path.join(run_path, MIGRATIONS_FILE)
    if moves or os.path.exists(path):
        atomic.write_text(path, "".join(json.dumps(m) + "\n" for m in moves))
    return moves
