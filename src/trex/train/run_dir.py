"""A run directory: config.toml, metrics.jsonl, TensorBoard events, summary.json, loss.png and
train.log (every trex message of the run, trex.logs).

Only rank 0 writes. Every file that is rewritten (summary, plot, config) is written to a temporary
name and renamed, so a crash never leaves a half-written file; metrics.jsonl is appended line by
line and flushed, so it is complete up to the last logged step.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import shutil
from typing import Any

from trex import atomic, logs
from trex import recipe as recipe_io
from trex.checkpoint.manifest import MANIFEST
from trex.checkpoint.training import list_checkpoints

log = logging.getLogger(__name__)


METRICS_FILE = "metrics.jsonl"


class RunDir:
    def __init__(self, path: str, enabled: bool = True):
        self.path = path
        self.enabled = enabled
        self._metrics = None
        self._tb = None
        self._log = None
        self._purge_step: int | None = None
        self.trackers = None  # trex.train.trackers.Trackers: every scalar TensorBoard gets, they get
        if enabled:
            os.makedirs(path, exist_ok=True)
            self._log = logs.to_file(self.file("train.log"))

    def file(self, name: str) -> str:
        return os.path.join(self.path, name)

    def check_room(self, steps: int) -> None:
        """Before step 1: the run directory's file system has room for what the run logs (a margin of
        64 MiB for the plot, logs and TensorBoard, plus 16 KiB per step for metrics, fidelity signals
        and events); raises OSError naming the directory."""
        if not self.enabled:
            return
        need = 64 * 2**20 + 16 * 2**10 * steps
        free = shutil.disk_usage(self.path).free
        if free < need:
            raise OSError(errno.ENOSPC, f"run directory: {free / 2**20:.1f} MiB free, the run's logs need up to "
                                        f"{need / 2**20:.1f} MiB; free space or set train.out", self.path)

    def begin(self, resumed_step: int | None, overwrite: bool, step_files: list[str], checkpoints: str) -> None:
        """Make the directory hold this run only, before its first step; every rank checks, rank 0 writes.

        ``step_files`` (names in the directory) hold one JSON line per step, ``checkpoints`` is the run's
        checkpoint directory. Resumed at step K: lines past K (written after the checkpoint, before a
        kill, or by the run that went on from an older checkpoint ``--resume PATH`` named) are dropped,
        with a warning that names the newer checkpoint holding them if there is one, and TensorBoard purges its events past K, so each step appears
        once; K = 0 continues a run that was stopped before its first checkpoint (all its steps). A fresh
        run into a directory that holds an earlier run raises ValueError naming the choices, or with
        ``overwrite`` removes the earlier run's files and checkpoints first."""
        if resumed_step is not None:
            if self.enabled:
                keep = resumed_step if resumed_step else -1  # from step 0 the start-of-run evaluation reruns too
                dropped = max(_keep_steps_up_to(self.file(name), keep) for name in step_files)
                if dropped:
                    log.warning("%s", _retrained(self.path, resumed_step, dropped, checkpoints))
            self._purge_step = resumed_step + 1
            return
        earlier = [n for n in step_files if os.path.exists(self.file(n)) and os.path.getsize(self.file(n))]
        old_ckpts = sorted(n for n in (os.listdir(checkpoints) if os.path.isdir(checkpoints) else [])
                           if n.startswith("step_"))
        if not earlier and not old_ckpts:
            return
        if not overwrite:
            what = ", ".join(earlier + ([f"checkpoints {', '.join(old_ckpts)}"] if old_ckpts else []))
            raise ValueError(f"{self.path} already holds a run ({what}): pass --resume auto to continue it, "
                             "--overwrite (train.overwrite) to replace it, or another --out")
        if self.enabled:
            for name in [*step_files, "summary.json", "loss.png"]:
                if os.path.exists(self.file(name)):
                    os.remove(self.file(name))
            for path in [self.file("tensorboard"), *(os.path.join(checkpoints, n) for n in old_ckpts)]:
                shutil.rmtree(path, ignore_errors=True)

    def save_config(self, config: Any) -> None:
        if self.enabled:
            recipe_io.save(config, self.file("config.toml"))

    def log(self, step: int, metrics: dict[str, Any], tb_extra: dict[str, float] | None = None) -> None:
        """One JSON line per logged step, mirrored to TensorBoard (plus ``tb_extra`` scalars)."""
        if not self.enabled:
            return
        if self._metrics is None:
            self._metrics = open(self.file(METRICS_FILE), "a")
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(self.file("tensorboard"), purge_step=self._purge_step)
        record = {"step": step, **metrics}
        self._metrics.write(json.dumps(record, default=_json_default) + "\n")
        self._metrics.flush()
        for key, value in {**metrics, **(tb_extra or {})}.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                self._tb.add_scalar(key, value, step)
        if self.trackers is not None:
            self.trackers.log(step, {**metrics, **(tb_extra or {})})

    def write_summary(self, summary: dict) -> None:
        if self.enabled:
            atomic.write_json(self.file("summary.json"), summary, default=_json_default)

    def plot_loss(self) -> None:
        """loss.png: training loss (and eval loss when logged) against step."""
        if not self.enabled or not os.path.exists(self.file(METRICS_FILE)):
            return
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        rows = [json.loads(line) for line in open(self.file(METRICS_FILE)) if line.strip()]
        fig, ax = plt.subplots(figsize=(7, 4))
        for key, style in (("loss", "-"), ("eval_loss", "o-")):
            pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
            if pts:
                ax.plot(*zip(*pts), style, label=key, markersize=3)
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        with atomic.replacing(self.file("loss.png"), suffix=".png") as tmp:
            fig.savefig(tmp, dpi=100)
        plt.close(fig)

    def close(self) -> None:
        if self._metrics is not None:
            self._metrics.close()
            self._tb.close()
            self._metrics = self._tb = None
        if self._log is not None:
            logs.remove(self._log)
            self._log = None


def _retrained(path: str, resumed_step: int, dropped: int, checkpoints: str) -> str:
    """The warning of a resume at ``resumed_step`` that drops ``dropped`` logged lines: the steps were
    logged after the newest checkpoint (a kill), or a complete newer checkpoint holds them (the run
    was resumed from an older one on purpose: it names the newest)."""
    newer = [(s, p) for s, p in list_checkpoints(checkpoints)
             if s > resumed_step and os.path.exists(os.path.join(p, MANIFEST))]
    replaced = f"{dropped} logged line{'s' if dropped != 1 else ''} replaced"
    if not newer:
        return (f"{path}: the steps after {resumed_step} were logged but no checkpoint holds them: they are "
                f"trained again ({replaced})")
    step, newest = newer[-1]
    return (f"{path}: resumed from step {resumed_step}: the logged steps after it are trained again ({replaced}), "
            f"although {os.path.basename(newest)} holds the run up to step {step} (--resume {newest} keeps "
            "those steps; this run's saves replace the newer checkpoints of the same steps)")


def _keep_steps_up_to(path: str, step: int) -> int:
    """Rewrite a JSON-lines file keeping the lines whose "step" is <= ``step`` (atomically); returns
    how many lines were dropped."""
    if not os.path.exists(path):
        return 0
    with open(path) as f:
        lines = [line for line in f if line.strip()]
    kept = [line for line in lines if json.loads(line).get("step", 0) <= step]
    if len(kept) < len(lines):
        atomic.write_text(path, "".join(kept))
    return len(lines) - len(kept)


def _json_default(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    return str(value)
