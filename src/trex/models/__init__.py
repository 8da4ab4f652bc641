"""DeepSeek-V4 model, configuration and presets (checkpoints on disk: trex.checkpoint).

The names load on first use (trex.lazy): what needs only configurations does not import torch.
"""

from trex.lazy import lazy_exports

__all__ = ["ConfigError", "DeepseekV4", "ModelConfig", "ModelOutput", "build_model", "count_parameters", "evaluating",
           "get_preset"]
__getattr__ = lazy_exports(__name__, {
    "ConfigError": "config", "ModelConfig": "config", "get_preset": "config", "DeepseekV4": "deepseek_v4",
    "ModelOutput": "deepseek_v4", "build_model": "build", "evaluating": "modes", "count_parameters": "params"})
