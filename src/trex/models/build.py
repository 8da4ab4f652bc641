"""Build a freshly initialised DeepSeek-V4 from its config (loading a checkpoint: trex.checkpoint.load)."""

from __future__ import annotations

import torch

from trex.models.config import ModelConfig
from trex.models.deepseek_v4 import DeepseekV4


def build_model(cfg: ModelConfig, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
                seed: int | None = None) -> DeepseekV4:
    """A freshly initialised model. device="meta" builds the structure without memory."""
    with torch.device(device):
        model = DeepseekV4(cfg) if seed is None else _seeded(cfg, seed)
    if dtype is not None:
        model.to(dtype=dtype)
    return model


def _seeded(cfg: ModelConfig, seed: int) -> DeepseekV4:
    model = DeepseekV4(cfg)
    model.init_weights(seed=seed)
    return model
