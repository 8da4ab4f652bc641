"""DeepSeek-V4 model, configuration, presets and checkpoint loading."""

from trex.models.config import ConfigError, ModelConfig, get_preset
from trex.models.deepseek_v4 import DeepseekV4, ModelOutput
from trex.models.loading import CheckpointError, build_model, load_pretrained
from trex.models.params import count_parameters
from trex.checkpoint.save import save_pretrained  # noqa: E402 - after trex.models' own modules

__all__ = [
    "CheckpointError", "ConfigError", "DeepseekV4", "ModelConfig", "ModelOutput", "build_model",
    "count_parameters", "get_preset", "load_pretrained", "save_pretrained",
]
