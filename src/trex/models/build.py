"""Build a freshly initialised model of any architecture from its config (loading a checkpoint:
trex.checkpoint.load); the config's architecture names the class (trex.models.registry)."""

from __future__ import annotations

import torch
from torch import nn

from trex.models.registry import AnyConfig, model_class


def build_model(cfg: AnyConfig, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
                seed: int | None = None) -> nn.Module:
    """A freshly initialised model of the config's architecture (DeepSeek-V4, V4.1 or the V3 family).
    device="meta" builds the structure without memory."""
    with torch.device(device):
        model = model_class(cfg)(cfg)
        if seed is not None:
            model.init_weights(seed=seed)
    if dtype is not None:
        model.to(dtype=dtype)
    return model
