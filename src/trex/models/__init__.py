"""The DeepSeek models (V4, V4.1): configuration, presets, the models (checkpoints on disk: trex.checkpoint).
The parts the families share are in ``trex.models.common``; every architecture's presets and config
dispatch in ``trex.models.registry``.

The names load on first use (trex.lazy): what needs only configurations does not import torch.
"""

from trex.lazy import lazy_exports

__all__ = ["ConfigError", "DeepseekV4", "ModelConfig", "ModelOutput", "build_model", "count_parameters", "evaluating",
           "get_preset"]
__getattr__ = lazy_exports(__name__, {
    "ConfigError": "common.config", "ModelConfig": "config", "get_preset": "registry", "DeepseekV4": "deepseek_v4",
    "ModelOutput": "common.heads", "build_model": "build", "evaluating": "modes", "count_parameters": "params"})
