"""DeepSeek-V4 model, configuration and presets (checkpoints on disk: trex.checkpoint)."""

from trex.models.config import ConfigError, ModelConfig, get_preset
from trex.models.deepseek_v4 import DeepseekV4, ModelOutput
from trex.models.build import build_model
from trex.models.modes import evaluating
from trex.models.params import count_parameters

__all__ = ["ConfigError", "DeepseekV4", "ModelConfig", "ModelOutput", "build_model", "count_parameters", "evaluating",
           "get_preset"]
