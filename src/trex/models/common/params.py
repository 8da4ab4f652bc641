"""Parameter counts: the record (``ParamCount``) every family's count fills (trex.models.params counts a model;
a family corrects what the model alone cannot say through ``Architecture.params``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ParamCount:
    """total: every trained parameter of the main model (embedding and head included, MTP excluded);
    active: parameters touched per token (k routed experts instead of E; Engram's rows read, not its
    tables); mtp: the MTP modules (V4.1: the DSpark drafter's stages); engram: V4.1's Engram tables
    (included in total)."""

    total: int
    active: int
    mtp: int
    engram: int = 0
