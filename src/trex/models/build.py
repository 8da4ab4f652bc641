"""Build a freshly initialised DeepSeek-V4 or V4.1 from its config (loading a checkpoint: trex.checkpoint.load)."""

from __future__ import annotations

import torch

from trex.models.config import ModelConfig
from trex.models.config_v41 import V41Config
from trex.models.deepseek_v4 import DeepseekV4
from trex.models.deepseek_v41 import DeepseekV41


def build_model(cfg: ModelConfig | V41Config, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
                seed: int | None = None) -> DeepseekV4 | DeepseekV41:
    """A freshly initialised model of the config's architecture (V4 or V4.1). device="meta" builds the
    structure without memory."""
    with torch.device(device):
        model = DeepseekV41(cfg) if isinstance(cfg, V41Config) else DeepseekV4(cfg)
        if seed is not None:
            model.init_weights(seed=seed)
    if dtype is not None:
        model.to(dtype=dtype)
    return model
