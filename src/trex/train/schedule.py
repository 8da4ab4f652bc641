"""Learning-rate schedules: linear warmup, then cosine, linear or constant decay.

The schedule is a multiplier on each parameter group's base lr, applied through
``torch.optim.lr_scheduler.LambdaLR`` so that its position is saved with the checkpoint.
Step s (0-based) is the s-th optimizer step: warmup ramps (s + 1) / warmup_steps up to 1, then
decay runs from 1 at s = warmup_steps to ``min_lr_ratio`` at the last step, s = total_steps - 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from trex.recipe import check_choices

Decay = Literal["cosine", "linear", "constant"]


@dataclass
class ScheduleSection:
    """The ``[schedule]`` section of a recipe."""

    warmup_steps: int = 0
    """Optimizer steps of linear warmup; step s uses lr * (s + 1) / warmup_steps."""
    decay: Decay = "cosine"
    """Shape after warmup: "cosine", "linear" or "constant"."""
    min_lr_ratio: float = 0.1
    """Final lr as a fraction of the peak lr (cosine and linear); V4 pretraining decays to 0.1."""

    def __post_init__(self) -> None:
        check_choices(self, "schedule")
        if not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ValueError(f"schedule.warmup_steps: expected an integer >= 0, got {self.warmup_steps!r}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"schedule.min_lr_ratio: expected a value in [0, 1], got {self.min_lr_ratio!r}")


def lr_multiplier(step: int, total_steps: int, cfg: ScheduleSection) -> float:
    """The factor on the peak lr at 0-based optimizer step ``step`` of ``total_steps``."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.decay == "constant":
        return 1.0
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps - 1))
    if cfg.decay == "linear":
        shape = 1.0 - progress
    else:
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * shape


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: ScheduleSection,
                    total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR over every parameter group; call ``.step()`` once after each optimizer step."""
    if total_steps < 1:
        raise ValueError(f"schedule: total_steps must be >= 1, got {total_steps}")
    if cfg.warmup_steps > total_steps:
        raise ValueError(f"schedule.warmup_steps ({cfg.warmup_steps}) exceeds the run's total steps ({total_steps})")
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_multiplier(step, total_steps, cfg))
