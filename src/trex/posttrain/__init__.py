"""Training objectives beyond next-token prediction, one module per `[train] mode`.

    sft      trex.posttrain.sft      continued pretraining / SFT: next-token cross-entropy (+ MTP)
    dpo      trex.posttrain.dpo      direct preference optimisation on chosen/rejected pairs
    grpo     trex.posttrain.grpo     group-relative policy optimisation with verifiable rewards
    distill  trex.posttrain.distill  on-policy distillation from frozen teachers

Each module has ``build(ctx: TrainContext) -> Objective``; the interface is in
trex.posttrain.objective.
"""

from __future__ import annotations

import importlib
import typing
from typing import Literal

from trex.posttrain.objective import Objective, StepResult, TrainContext, load_frozen, token_logprobs

TrainMode = Literal["sft", "dpo", "grpo", "distill"]  # the modules above, by `[train] mode`
TRAIN_MODES = typing.get_args(TrainMode)

__all__ = ["TRAIN_MODES", "Objective", "StepResult", "TrainContext", "TrainMode", "build_objective", "load_frozen",
           "token_logprobs"]


def build_objective(mode: str, ctx: TrainContext) -> Objective:
    """The objective of ``mode`` (one of TRAIN_MODES) for this run."""
    if mode not in TRAIN_MODES:
        raise ValueError(f"train.mode = {mode!r}; expected one of {', '.join(TRAIN_MODES)}")
    try:
        module = importlib.import_module(f"trex.posttrain.{mode}")
    except ModuleNotFoundError as e:
        if e.name != f"trex.posttrain.{mode}":
            raise
        raise ValueError(f"train.mode = {mode!r} is not available in this version of trex") from None
    return module.build(ctx)
