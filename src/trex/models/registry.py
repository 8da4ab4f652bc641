"""Every architecture trex builds, by name, without torch: the union of their presets, a preset's config,
which architecture's config a config.json describes, and the model class and decode cache of a config.

It sits above each architecture's config module (no module of trex.models below it imports it:
tests/test_models_layering.py), so that a family's config never has to know the others: a new family
joins here. Today: DeepSeek-V4 (``trex.models.deepseek_v4.config``), V4.1 (``deepseek_v4.config_v41``) and
the DeepSeek-V3 family (``trex.models.deepseek_v3.config``: V3, R1, V3.1, V3.2, Kimi-K2, Moonlight).
``config_from_dict`` asks the V3 family first (its model_type, or fields only it has), then the V4
family's own dispatch (config_v41 tells V4.1 from V4: V4.1 derives from V4). Model classes and decode caches
are named by string and imported on use (``model_class``, ``decode_cache``), so the registry stays torch-free.
"""

from __future__ import annotations

import dataclasses
import importlib

from trex.models.common.config import ConfigError, lookup_preset, read_config_json
from trex.models.deepseek_v3.config import V3_PRESETS, V3Config, is_v3
from trex.models.deepseek_v4.config import PRESETS as V4_PRESETS
from trex.models.deepseek_v4.config import ModelConfig
from trex.models.deepseek_v4.config_v41 import V41_PRESETS, V41Config, is_v41
from trex.models.deepseek_v4.config_v41 import config_from_dict as v4_family_config

__all__ = ["ARCHITECTURES", "DECODE_CACHES", "PRESETS", "check_shardable", "config_from_dict", "config_from_file",
           "decode_cache", "drafter_kind", "get_preset", "is_v3", "is_v41", "model_class", "shardable_length"]

PRESETS = {**V4_PRESETS, **V41_PRESETS, **V3_PRESETS}

# a config's ``architecture`` -> "module:class" of its model
ARCHITECTURES = {
    "deepseek_v4": "trex.models.deepseek_v4.model:DeepseekV4",
    "deepseek_v41": "trex.models.deepseek_v4.model_v41:DeepseekV41",
    "deepseek_v3": "trex.models.deepseek_v3.model:DeepseekV3",
}

# a config's ``architecture`` -> "module:class" of its decode cache (the sampler's incremental generation)
DECODE_CACHES = {
    "deepseek_v4": "trex.models.deepseek_v4.decode:DecodeCache",
    "deepseek_v41": "trex.models.deepseek_v4.decode_v41:V41DecodeCache",
    "deepseek_v3": "trex.models.deepseek_v3.decode:V3DecodeCache",
}

AnyConfig = ModelConfig | V41Config | V3Config

# a config's ``architecture`` -> the module of its context-parallel split rule (check_shardable, shardable_length)
SPLIT_RULES = {
    "deepseek_v4": "trex.models.deepseek_v4.config",
    "deepseek_v41": "trex.models.deepseek_v4.config",
    "deepseek_v3": "trex.models.deepseek_v3.config",
}

# a config's ``architecture`` -> the module of its tensor-parallel plan (``TP_PLAN``: trex.parallel.tensor_parallel)
TP_PLANS = {
    "deepseek_v4": "trex.models.deepseek_v4.tp_plan",
    "deepseek_v3": "trex.models.deepseek_v3.tp_plan",
}


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
    return _load(ARCHITECTURES[cfg.architecture])


def _load(target: str) -> type:
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def decode_cache(cfg: AnyConfig, max_new_tokens: int):
    """An empty decode cache of ``cfg``'s architecture for at most ``max_new_tokens`` decode steps (imports
    torch and the cache's module)."""
    return _load(DECODE_CACHES[cfg.architecture])(max_new_tokens)


def check_shardable(cfg: AnyConfig, seq_len: int, shards: int) -> None:
    """ValueError unless a sequence of ``seq_len`` splits into ``shards`` context-parallel shards, by the rule of
    ``cfg``'s architecture (V4's compression windows and halos; the V3 family's equal shards); the message names
    lengths that would work."""
    if shards > 1:
        importlib.import_module(SPLIT_RULES[cfg.architecture]).check_shardable(cfg, seq_len, shards)


def shardable_length(cfg: AnyConfig, length: int, shards: int) -> int:
    """The shortest sequence length >= ``length`` that ``check_shardable`` accepts."""
    if shards == 1:
        return length
    return importlib.import_module(SPLIT_RULES[cfg.architecture]).shardable_length(cfg, length, shards)


def drafter_kind(cfg: AnyConfig) -> str | None:
    """Which drafter a config's model has for speculative decoding: "dspark" (DeepSeek-V4.1's DSpark stages,
    ``trex.models.deepseek_v4.dspark``), "mtp" (the multi-token prediction modules of DeepSeek-V4 and the V3 family, one
    token drafted per module) or None (a V4.1 config without DSpark stages, or no modules)."""
    if cfg.architecture == "deepseek_v41":
        return "dspark" if cfg.num_nextn_predict_layers and cfg.dspark_target_layer_ids else None
    return "mtp" if cfg.num_nextn_predict_layers else None
