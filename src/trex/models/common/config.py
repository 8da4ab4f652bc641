"""Configuration helpers every DeepSeek family's config uses (no torch: ``trex --help`` and ``trex plan``'s
registration read the presets).

ConfigError and ``need`` (an invalid field, named), ``read_config_json``, the fields transformers writes
for every model (GENERIC_FIELDS), YaRN's frequency scaling (YarnScaling) and the RoPE fields of a
config.json (``rope_fields``), the MoE layer kinds (HASH_MOE, MOE) and a preset table's lookup.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass

HASH_MOE, MOE = "hash_moe", "moe"  # a layer's MoE: routed by a token-id hash table, or by its scores

# What ``transformers.PretrainedConfig.to_dict()`` writes for every model (4.x and 5.x): task heads,
# output switches, generation defaults, serialisation flags. None changes the architecture.
GENERIC_FIELDS = {
    "id2label", "label2id", "problem_type", "finetuning_task", "num_labels", "return_dict", "output_attentions",
    "output_hidden_states", "output_scores", "return_dict_in_generate", "use_return_dict", "torchscript",
    "use_bfloat16", "tf_legacy_loss", "pruned_heads", "chunk_size_feed_forward", "is_encoder_decoder",
    "is_decoder", "add_cross_attention", "cross_attention_hidden_size", "tie_encoder_decoder",
    "tokenizer_class", "prefix", "task_specific_params", "sep_token_id", "decoder_start_token_id",
    "max_length", "min_length", "do_sample", "early_stopping", "num_beams",
    "num_beam_groups", "diversity_penalty", "temperature", "top_k", "top_p", "typical_p", "repetition_penalty",
    "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids",
    "num_return_sequences", "forced_bos_token_id", "forced_eos_token_id", "remove_invalid_values",
    "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens",
}


class ConfigError(ValueError):
    """An invalid model configuration; the message names the field."""


def need(cond: bool, fld: str, msg: str) -> None:
    """ConfigError naming config field ``fld`` unless ``cond``."""
    if not cond:
        raise ConfigError(f"config field `{fld}`: {msg}")


@dataclass(frozen=True)
class YarnScaling:
    """YaRN: RoPE frequencies blended between interpolation and extrapolation (``common.rope.rope_inv_freq``;
    V4 applies it on compressed layers). No attention scaling: V4's reference applies no mscale."""

    factor: float = 16.0
    original_max_position_embeddings: int = 65536
    beta_fast: float = 32.0
    beta_slow: float = 1.0


def read_config_json(path: str) -> tuple[dict, str]:
    """(the JSON object, its file) of a config.json or of a directory's; a missing or invalid file is a
    ConfigError naming it."""
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    try:
        with open(path) as f:
            return json.load(f), path
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: line {e.lineno}: invalid JSON ({e.msg})") from None


def rope_fields(d: dict) -> dict:
    """The RoPE fields of a config dict (HF or official names): nested HF ``rope_parameters``
    {"main", "compress"}, a flat ``rope_scaling``, or the official ``rope_factor`` / ``original_seq_len``
    -> the ``rope_theta``, ``compress_rope_theta`` and ``rope_scaling`` (YarnScaling or None) they set."""
    kw: dict = {}
    rp = d.get("rope_parameters") or {}
    yarn_src = None
    if isinstance(rp.get("compress"), dict):
        compress = rp["compress"]
        if "rope_theta" in compress:
            kw["compress_rope_theta"] = compress["rope_theta"]
        if isinstance(rp.get("main"), dict) and "rope_theta" in rp["main"]:
            kw["rope_theta"] = rp["main"]["rope_theta"]
        yarn_src = compress if compress.get("rope_type", compress.get("type")) == "yarn" else None
        if yarn_src is None:
            kw["rope_scaling"] = None
    elif d.get("rope_scaling") or rp:
        src = d.get("rope_scaling") or rp
        yarn_src = src if src.get("type", src.get("rope_type")) == "yarn" else None
        if yarn_src is None:
            kw["rope_scaling"] = None
    elif "rope_factor" in d:
        yarn_src = {"factor": d["rope_factor"], "original_max_position_embeddings": d.get("original_seq_len", 65536),
                    "beta_fast": d.get("beta_fast", 32), "beta_slow": d.get("beta_slow", 1)}
    if yarn_src is not None:
        kw["rope_scaling"] = YarnScaling(
            factor=float(yarn_src.get("factor", 16.0)),
            original_max_position_embeddings=int(yarn_src.get("original_max_position_embeddings", 65536)),
            beta_fast=float(yarn_src.get("beta_fast") or 32.0),
            beta_slow=float(yarn_src.get("beta_slow") or 1.0),
        )
    return kw


def lookup_preset(presets: dict[str, Callable[[], object]], name: str):
    """The config of preset ``name`` of ``presets`` (name -> a function building it); a ConfigError naming
    the choices otherwise."""
    if name not in presets:
        raise ConfigError(f"unknown model preset {name!r}; choose one of {sorted(presets)} or a config.json path")
    return presets[name]()
