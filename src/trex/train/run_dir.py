"""A run directory: config.toml, metrics.jsonl, TensorBoard events, summary.json and loss.png.

Only rank 0 writes. Every file that is rewritten (summary, plot, config) is written to a temporary
name and renamed, so a crash never leaves a half-written file; metrics.jsonl is appended line by
line and flushed, so it is complete up to the last logged step.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

from trex import recipe as recipe_io


def _atomic_write_text(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


class RunDir:
    def __init__(self, path: str, enabled: bool = True):
        self.path = path
        self.enabled = enabled
        self._metrics = None
        self._tb = None
        if enabled:
            os.makedirs(path, exist_ok=True)

    def file(self, name: str) -> str:
        return os.path.join(self.path, name)

    def save_config(self, config: Any) -> None:
        if self.enabled:
            recipe_io.save(config, self.file("config.toml"))

    def log(self, step: int, metrics: dict[str, Any], tb_extra: dict[str, float] | None = None) -> None:
        """One JSON line per logged step, mirrored to TensorBoard (plus ``tb_extra`` scalars)."""
        if not self.enabled:
            return
        if self._metrics is None:
            self._metrics = open(self.file("metrics.jsonl"), "a")
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(self.file("tensorboard"))
        record = {"step": step, **metrics}
        self._metrics.write(json.dumps(record, default=_json_default) + "\n")
        self._metrics.flush()
        for key, value in {**metrics, **(tb_extra or {})}.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                self._tb.add_scalar(key, value, step)

    def write_summary(self, summary: dict) -> None:
        if self.enabled:
            _atomic_write_text(self.file("summary.json"), json.dumps(summary, indent=2, default=_json_default))

    def plot_loss(self) -> None:
        """loss.png: training loss (and eval loss when logged) against step."""
        if not self.enabled or not os.path.exists(self.file("metrics.jsonl")):
            return
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        rows = [json.loads(line) for line in open(self.file("metrics.jsonl")) if line.strip()]
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
        tmp = self.file("loss.tmp.png")
        fig.savefig(tmp, dpi=100)
        plt.close(fig)
        os.replace(tmp, self.file("loss.png"))

    def close(self) -> None:
        if self._metrics is not None:
            self._metrics.close()
            self._tb.close()
            self._metrics = self._tb = None


def _json_default(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    return str(value)
