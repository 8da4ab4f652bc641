"""The live progress bar: step, ETA and the key metrics; plain periodic lines when not a terminal."""

from __future__ import annotations

import sys
import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


def format_metrics(m: dict) -> str:
    parts = [f"loss {m['loss']:.4f}", f"gnorm {m['grad_norm']:.2f}", f"lr {m['lr']:.2e}",
             f"{m['tokens_per_s']:.0f} tok/s"]
    if m.get("mfu") is not None:
        parts.append(f"mfu {100 * m['mfu']:.1f}%")
    if m.get("eval_loss") is not None:
        parts.append(f"eval {m['eval_loss']:.4f}")
    if m.get("skipped_steps"):
        parts.append(f"skipped {m['skipped_steps']}")
    return "  ".join(parts)


class StepProgress:
    """A live bar on a terminal; elsewhere one line every ``every`` steps (the run's log_every), at
    the last step, and at every step with a held-out evaluation. Silent when not ``enabled`` (ranks
    other than 0, ``train.progress = false``)."""

    def __init__(self, total: int, enabled: bool = True, label: str = "train", every: int = 1):
        self.total = total
        self.label = label
        self.enabled = enabled
        self.console = Console(stderr=True)
        self.live = enabled and self.console.is_terminal
        self.every = max(1, every)
        self.start = time.perf_counter()
        self._bar = None
        if self.live:
            self._bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(),
                                 TextColumn("{task.fields[metrics]}"), console=self.console)
            self._task = self._bar.add_task(label, total=total, metrics="")
            self._bar.start()

    def update(self, step: int, metrics: dict, evaluated: bool = False) -> None:
        if not self.enabled:
            return
        text = format_metrics(metrics)
        if self._bar is not None:
            self._bar.update(self._task, completed=step, metrics=text)
        elif step % self.every == 0 or step == self.total or evaluated:
            elapsed = time.perf_counter() - self.start
            eta = elapsed / step * (self.total - step)
            print(f"{self.label} {step}/{self.total}  {text}  eta {eta:.0f}s", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
