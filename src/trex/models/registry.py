"""Every architecture trex builds, by name, without torch: the union of their presets, a preset's config,
and which architecture's config a config.json describes.

It sits above each architecture's config module (no module of trex.models below it imports it:
tests/test_models_layering.py), so that a family's config never has to know the others: a new family
joins here. Today: DeepSeek-V4 (``trex.models.config``) and V4.1 (``trex.models.config_v41``).
``config_from_dict`` and ``config_from_file`` are the V4 family's (config_v41 tells V4.1 from V4: V4.1
derives from V4); a family outside it adds its own test here, before them.
"""

from __future__ import annotations

from trex.models.common.config import lookup_preset
from trex.models.config import PRESETS as V4_PRESETS
from trex.models.config import ModelConfig
from trex.models.config_v41 import V41_PRESETS, V41Config, config_from_dict, config_from_file, is_v41

__all__ = ["PRESETS", "config_from_dict", "config_from_file", "get_preset", "is_v41"]

PRESETS = {**V4_PRESETS, **V41_PRESETS}


def get_preset(name: str) -> ModelConfig | V41Config:
    """A preset's config, of any architecture (PRESETS: DeepSeek-V4's and V4.1's)."""
    return lookup_preset(PRESETS, name)
