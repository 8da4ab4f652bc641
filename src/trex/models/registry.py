"""Every architecture trex builds, by name, without torch: the union of their presets, a preset's config,
which architecture's config a config.json describes, and each architecture's :class:`Architecture` (the
interface its family fills: trex.models.common.architecture), through which code outside the families reaches
them.

It sits above each family (no module of trex.models below it imports it: tests/test_models_layering.py), so that
a family never has to know the others: a new family joins here, with its presets, its config.json test and its
Architectures. Today: DeepSeek-V4 and V4.1 (``trex.models.deepseek_v4.spec``) and the DeepSeek-V3 family
(``trex.models.deepseek_v3.spec``: V3, R1, V3.1, V3.2, Kimi-K2, Moonlight). ``config_from_dict`` asks the V3
family first (its model_type, or fields only it has), then the V4 family's own dispatch (config_v41 tells V4.1
from V4: V4.1 derives from V4).
"""

from __future__ import annotations

import dataclasses

from trex.models.common.architecture import Architecture
from trex.models.common.config import ConfigError, lookup_preset, read_config_json
from trex.models.deepseek_v3 import spec as v3_spec
from trex.models.deepseek_v3.config import V3_PRESETS, V3Config, is_v3
from trex.models.deepseek_v4 import spec as v4_spec
from trex.models.deepseek_v4.config import PRESETS as V4_PRESETS
from trex.models.deepseek_v4.config import ModelConfig
from trex.models.deepseek_v4.config_v41 import V41_PRESETS, V41Config
from trex.models.deepseek_v4.config_v41 import config_from_dict as v4_family_config

__all__ = ["ARCHITECTURES", "AnyConfig", "PRESETS", "architecture", "check_shardable", "config_from_dict",
           "config_from_file", "decode_cache", "drafter_kind", "get_preset", "model_class", "shardable_length",
           "with_overrides"]

PRESETS = {**V4_PRESETS, **V41_PRESETS, **V3_PRESETS}

# a config's ``architecture`` -> its Architecture
ARCHITECTURES: dict[str, Architecture] = {a.name: a for a in (v4_spec.V4, v4_spec.V41, v3_spec.V3)}

AnyConfig = ModelConfig | V41Config | V3Config


def architecture(cfg: AnyConfig) -> Architecture:
    """The Architecture of ``cfg`` (by its ``architecture`` field)."""
    return ARCHITECTURES[cfg.architecture]


def get_preset(name: str) -> AnyConfig:
    """A preset's config, of any architecture (PRESETS: DeepSeek-V4's, V4.1's and the V3 family's)."""
    return lookup_preset(PRESETS, name)


def config_from_dict(raw: dict, source: str = "<dict>") -> AnyConfig:
    """The config of the architecture ``raw`` (a config.json's object) describes: V3Config for the DeepSeek-V3
    family, V41Config for DeepSeek-V4.1, else ModelConfig (DeepSeek-V4)."""
    if is_v3(raw):
        return V3Config.from_dict(raw, source)
    return v4_family_config(raw, source)


def config_from_file(path: str) -> AnyConfig:
    """``config_from_dict`` of a config.json (or of a directory's); a missing or invalid file is a
    ConfigError naming it."""
    raw, path = read_config_json(path)
    return config_from_dict(raw, source=path)


def with_overrides(cfg: AnyConfig, overrides: dict, source: str = "model.overrides") -> AnyConfig:
    """``cfg`` with the fields ``overrides`` names set (checked as the config checks its fields): a recipe's
    ``model.overrides`` on a preset or on a checkpoint's config.json. A field the config lacks, or a value it
    refuses, is a ConfigError naming ``source``."""
    if not overrides:
        return cfg
    try:
        return dataclasses.replace(cfg, **overrides)
    except (TypeError, ConfigError) as e:
        raise ConfigError(f"{source}: {e}") from None


def model_class(cfg: AnyConfig) -> type:
    """The model class of ``cfg``'s architecture (imports torch and the model's module)."""
    return architecture(cfg).load("model")


def decode_cache(cfg: AnyConfig, max_new_tokens: int):
    """An empty decode cache of ``cfg``'s architecture for at most ``max_new_tokens`` decode steps (imports
    torch and the cache's module)."""
    return architecture(cfg).load("decode_cache")(max_new_tokens)


def check_shardable(cfg: AnyConfig, seq_len: int, shards: int) -> None:
    """ValueError unless a sequence of ``seq_len`` splits into ``shards`` context-parallel shards, by the rule of
    ``cfg``'s architecture (V4's compression windows and halos; the V3 family's equal shards); the message names
    lengths that would work."""
    if shards > 1:
        architecture(cfg).load("split_rule").check_shardable(cfg, seq_len, shards)


def shardable_length(cfg: AnyConfig, length: int, shards: int) -> int:
    """The shortest sequence length >= ``length`` that ``check_shardable`` accepts."""
    if shards == 1:
        return length
    return architecture(cfg).load("split_rule").shardable_length(cfg, length, shards)


def drafter_kind(cfg: AnyConfig) -> str | None:
    """Which drafter a config's model has for speculative decoding: "dspark" (DeepSeek-V4.1's DSpark stages),
    "mtp" (the multi-token prediction modules of DeepSeek-V4 and the V3 family, one token drafted per module) or
    None (a V4.1 config without DSpark stages, or no modules)."""
    return architecture(cfg).drafter_kind(cfg)
