"""The planner's one door to a family: the ``plan_terms`` module of a config's architecture.

Every memory and time term that depends on the model's family (bytes saved per layer kind, halos, the busiest
shard's FLOPs, context-parallel traffic, what tensor parallelism splits) lives in the family's
``plan_terms`` module; trex.models.common.plan_terms lists the functions with their contracts and units. The
planner reaches them only through :func:`terms` and sums them.
"""

from __future__ import annotations

import functools
from types import ModuleType

from trex.models.registry import ARCHITECTURES, AnyConfig


def terms(cfg: AnyConfig) -> ModuleType:
    """The ``plan_terms`` module of ``cfg``'s family (imported on first use)."""
    return _terms(cfg.architecture)


@functools.cache
def _terms(name: str) -> ModuleType:
    """Remembered per architecture: a search asks for it several times per layout, over thousands of layouts."""
    return ARCHITECTURES[name].load("plan_terms")


def forward_saved(cfg: AnyConfig, S: int, b: int) -> float:
    """Everything autograd keeps for one sequence of S tokens (the whole model, MTP included), on one process."""
    t = terms(cfg)
    total = t.model_level(cfg, S, b)
    for lt, mt in t.main_blocks(cfg):
        total += t.block(cfg, lt, mt, S, b).total + t.weight_copies(cfg, lt, b)
    for _ in range(t.mtp_blocks(cfg)):
        total += t.block(cfg, t.mtp_kind(cfg), "moe", S, b).total + t.weight_copies(cfg, t.mtp_kind(cfg), b)
    return total
