"""The live progress bar: step, ETA and the key metrics; plain periodic lines when not a terminal.

At any console width the bar keeps the step count, elapsed time and ETA whole: the bar shrinks
(40 down to 10 characters) and the metrics that do not fit are left out, least important first
(loss, eval, skipped steps, tokens/s, grad norm, lr, MFU)."""

from __future__ import annotations

import sys
import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


def metric_parts(m: dict) -> list[str]:
    """The metrics of a step as display parts, most important first."""
    parts = [f"loss {m['loss']:.4f}"]
    if m.get("eval_loss") is not None:
        parts.append(f"eval {m['eval_loss']:.4f}")
    if m.get("skipped_steps"):
        parts.append(f"skipped {m['skipped_steps']}")
    parts += [f"{m['tokens_per_s']:.0f} tok/s", f"gnorm {m['grad_norm']:.2f}", f"lr {m['lr']:.2e}"]
    if m.get("mfu") is not None:
        parts.append(f"mfu {100 * m['mfu']:.1f}%")
    return parts


def format_metrics(m: dict, width: int | None = None) -> str:
    """The parts that fit in ``width`` characters (all when None), dropping the least important."""
    kept: list[str] = []
    for part in metric_parts(m):
        if width is None or len("  ".join([*kept, part])) <= width:
            kept.append(part)
    return "  ".join(kept)


class StepProgress:
    """A live bar on a terminal; elsewhere one line every ``every`` steps (the run's log_every), at
    the last step, and at every step with a held-out evaluation. Silent when not ``enabled`` (ranks
    other than 0, ``train.progress = false``)."""

    def __init__(self, total: int, enabled: bool = True, label: str = "train", every: int = 1,
                 console: Console | None = None):
        self.total = total
        self.label = label
        self.enabled = enabled
        self.console = console or Console(stderr=True)
        self.live = enabled and self.console.is_terminal
        self.every = max(1, every)
        self.start = time.perf_counter()
        self._bar = None
        if self.live:
            self._bar_column = BarColumn(bar_width=40)
            self._bar = Progress(TextColumn("[bold]{task.description}"), self._bar_column, MofNCompleteColumn(),
                                 TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(),
                                 TextColumn("{task.fields[metrics]}"), console=self.console)
            self._task = self._bar.add_task(label, total=total, metrics="")
            self._bar.start()

    def _metrics_width(self, full: int) -> int:
        """Characters left for the metrics at the console's current width: label, bar, step/total,
        elapsed, "eta", remaining (h:mm:ss each) and a space between take the rest; the bar gives
        up its width (40 down to 10) before a metric is dropped. ``full``: the length of all metrics."""
        digits = len(str(self.total))
        fixed = len(self.label) + (2 * digits + 1) + 7 + 3 + 7 + 6
        room = self.console.width - 1 - fixed
        self._bar_column.bar_width = max(10, min(40, room - full))
        return max(0, room - self._bar_column.bar_width)

    def update(self, step: int, metrics: dict, evaluated: bool = False) -> None:
        if not self.enabled:
            return
        text = format_metrics(metrics)
        if self._bar is not None:
            width = self._metrics_width(len(text))
            self._bar.update(self._task, completed=step,
                             metrics=text if len(text) <= width else format_metrics(metrics, width))
            return
        if step % self.every == 0 or step == self.total or evaluated:
            elapsed = time.perf_counter() - self.start
            eta = elapsed / step * (self.total - step)
            print(f"{self.label} {step}/{self.total}  {text}  eta {eta:.0f}s", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
