"""Typed DeepSeek-V4 model configuration.

Reads Hugging Face ``config.json`` files (``DeepseekV4Config`` field names, including the
legacy ``compress_ratios`` / ``num_hash_layers``) and the official ``inference/config.json``
names (``dim``, ``n_layers``, ...). Presets: ``deepseek-v4-flash``, ``deepseek-v4-pro`` and
``tiny`` (a few-layer model with every layer type, for tests and the default job).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from trex.models.common.config import (GENERIC_FIELDS, HASH_MOE, MOE, ConfigError, YarnScaling, lookup_preset, need,
                                       read_config_json, rope_fields)

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)
MLP_LAYER_TYPES = (HASH_MOE, MOE)
_RATIO_TO_TYPE = {0: SLIDING, 4: CSA, 128: HCA}

# Official inference/config.json names -> HF names.
_OFFICIAL_NAMES = {
    "dim": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "moe_inter_dim": "moe_intermediate_size",
    "n_activated_experts": "num_experts_per_tok",
    "score_func": "scoring_func",
    "route_scale": "routed_scaling_factor",
    "rope_head_dim": "qk_rope_head_dim",
    "window_size": "sliding_window",
    "norm_eps": "rms_norm_eps",
    "n_hash_layers": "num_hash_layers",
    "n_mtp_layers": "num_nextn_predict_layers",
    "max_seq_len": "max_position_embeddings",
}
# Fields that appear in real config files but do not change the architecture.
_IGNORED_FIELDS = {
    "architectures", "model_type", "torch_dtype", "dtype", "transformers_version", "quantization_config",
    "expert_dtype", "scale_fmt", "use_cache", "attention_bias", "mlp_bias", "attention_dropout",
    "hidden_act", "output_router_logits", "router_aux_loss_coef", "router_jitter_noise", "pad_token_id",
    "partial_rotary_factor", "topk_method", "n_dense_layers", "max_batch_size", "auto_map",
    "num_key_value_heads", "_name_or_path", "original_seq_len", "rope_factor", "beta_fast", "beta_slow",
    "mscale", "n_expert_groups", "n_limited_groups", "compress_rate_csa", "compress_rate_hca", "rope_parameters",
    "rope_scaling", "compress_ratios", "num_hash_layers", "layer_types", "mlp_layer_types",
    "keys_to_ignore_at_inference", "intermediate_size", "num_local_experts", "kv_lora_rank",
}

# Later checkpoints trex cannot train as they are, recognised by their config fields (vLLM's DSpark
# loader, public: the drafter's stages sit under ``mtp.N`` while num_nextn_predict_layers stays 1):
# (field marker, the variant, what trex would need).
_VARIANTS = (
    ("dspark_", "a DSpark speculative-decoding drafter checkpoint (DeepSeek-V4-Flash-0731 family)",
     "its mtp.* tensors are the drafter's stages, not V4 multi-token prediction; trex would need a DSpark "
     "module to train them. Remove the dspark_* fields and the mtp.* tensors (or set num_nextn_predict_layers "
     "to 0 and drop mtp.*) to post-train the main model"),
)


def validate_shared(cfg) -> None:
    """The checks every V4-family config passes (V4's ModelConfig, V4.1's V41Config): positive sizes,
    o_groups dividing the heads, k experts of E, a known scoring function."""
    for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
                 "q_lora_rank", "o_groups", "o_lora_rank", "sliding_window", "n_routed_experts",
                 "num_experts_per_tok", "moe_intermediate_size", "hc_mult", "hc_sinkhorn_iters"):
        need(isinstance(getattr(cfg, name), int) and getattr(cfg, name) > 0, name,
             f"must be a positive integer, got {getattr(cfg, name)!r}")
    need(cfg.num_attention_heads % cfg.o_groups == 0, "o_groups",
         f"must divide num_attention_heads ({cfg.num_attention_heads}), got {cfg.o_groups}")
    need(cfg.num_experts_per_tok <= cfg.n_routed_experts, "num_experts_per_tok",
         f"({cfg.num_experts_per_tok}) exceeds n_routed_experts ({cfg.n_routed_experts})")
    need(cfg.scoring_func in ("sqrtsoftplus", "sigmoid", "softmax"), "scoring_func",
         f"unknown scoring function {cfg.scoring_func!r}")


@dataclass
class ModelConfig:
    """DeepSeek-V4 architecture. Field names follow Hugging Face ``DeepseekV4Config``."""

    vocab_size: int = 129280
    hidden_size: int = 4096
    num_hidden_layers: int = 43
    num_attention_heads: int = 64
    head_dim: int = 512
    qk_rope_head_dim: int = 64
    q_lora_rank: int = 1024
    o_groups: int = 8
    o_lora_rank: int = 1024
    sliding_window: int = 128
    layer_types: list[str] = field(default_factory=list)
    compress_rates: dict[str, int] = field(default_factory=lambda: {CSA: 4, HCA: 128})
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_scaling: YarnScaling | None = field(default_factory=YarnScaling)
    max_position_embeddings: int = 1048576
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    num_experts_per_tok: int = 6
    moe_intermediate_size: int = 2048
    mlp_layer_types: list[str] = field(default_factory=list)
    scoring_func: str = "sqrtsoftplus"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    rms_norm_eps: float = 1e-6
    num_nextn_predict_layers: int = 1
    mtp_layer_type: str = SLIDING
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 0
    eos_token_id: int | None = 1
    initializer_range: float = 0.02

    architecture = "deepseek_v4"
    fp8_block = 128  # the released FP8 linears' block scales (128 x 128) and activations' (1 x 128)

    def __post_init__(self) -> None:
        if not self.layer_types:
            self.layer_types = _default_layer_types(self.num_hidden_layers)
        if not self.mlp_layer_types:
            self.mlp_layer_types = _default_mlp_layer_types(self.num_hidden_layers, 3)
        self.validate()

    # ------------------------------------------------------------------------------------
    def validate(self) -> None:
        validate_shared(self)
        n = self.num_hidden_layers
        need(len(self.layer_types) == n, "layer_types",
             f"has {len(self.layer_types)} entries but num_hidden_layers is {n}")
        bad = sorted({t for t in self.layer_types if t not in LAYER_TYPES})
        need(not bad, "layer_types", f"unknown layer type(s) {bad}; expected one of {list(LAYER_TYPES)}")
        need(len(self.mlp_layer_types) == n, "mlp_layer_types",
             f"has {len(self.mlp_layer_types)} entries but num_hidden_layers is {n}")
        bad = sorted({t for t in self.mlp_layer_types if t not in MLP_LAYER_TYPES})
        need(not bad, "mlp_layer_types", f"unknown MLP type(s) {bad}; expected one of {list(MLP_LAYER_TYPES)}")
        need(self.mtp_layer_type in LAYER_TYPES, "mtp_layer_type", f"unknown layer type {self.mtp_layer_type!r}")
        for t in (CSA, HCA):
            need(isinstance(self.compress_rates.get(t), int) and self.compress_rates[t] > 0, "compress_rates",
                 f"needs a positive integer rate for {t!r}, got {self.compress_rates.get(t)!r}")
        need(0 < self.qk_rope_head_dim <= self.head_dim and self.qk_rope_head_dim % 2 == 0, "qk_rope_head_dim",
             f"must be even and at most head_dim ({self.head_dim}), got {self.qk_rope_head_dim}")
        if CSA in self.layer_types:
            need(self.qk_rope_head_dim <= self.index_head_dim, "index_head_dim",
                 f"({self.index_head_dim}) must be at least qk_rope_head_dim ({self.qk_rope_head_dim})")
            need(self.index_topk > 0 and self.index_n_heads > 0, "index_topk", "indexer sizes must be positive")

    # ------------------------------------------------------------------------------------
    def compress_rate(self, layer_type: str) -> int:
        """Compression rate m of a layer type (0 for sliding-only layers)."""
        return 0 if layer_type == SLIDING else self.compress_rates[layer_type]

    def layer_rates(self) -> list[int]:
        """Every compression rate a forward uses (each layer's, then the MTP layer type's)."""
        return [self.compress_rate(t) for t in (*self.layer_types, self.mtp_layer_type)]

    def to_hf_dict(self) -> dict:
        """A ``config.json`` that transformers' ``DeepseekV4Config`` reads back."""
        d = dataclasses.asdict(self)
        d.pop("rope_scaling")
        d.pop("mtp_layer_type")
        out = {"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", **d}
        yarn = self.rope_scaling
        compress = {"rope_type": "default", "rope_theta": self.compress_rope_theta,
                    "partial_rotary_factor": self.qk_rope_head_dim / self.head_dim}
        if yarn is not None:
            compress.update(rope_type="yarn", factor=yarn.factor, attention_factor=1.0,
                            original_max_position_embeddings=yarn.original_max_position_embeddings,
                            beta_fast=yarn.beta_fast, beta_slow=yarn.beta_slow)
        out["rope_parameters"] = {
            "main": {"rope_type": "default", "rope_theta": self.rope_theta,
                     "partial_rotary_factor": self.qk_rope_head_dim / self.head_dim},
            "compress": compress,
        }
        out["partial_rotary_factor"] = self.qk_rope_head_dim / self.head_dim
        out.pop("qk_rope_head_dim")
        return out

    # ------------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict, source: str = "<dict>") -> "ModelConfig":
        """Build from HF or official config names. Unknown fields are an error naming them. A field a
        transformers config.json (``model_type`` "deepseek_v4") leaves out takes transformers'
        ``DeepseekV4Config`` default (the attention schedule, RoPE without YaRN), not a trex preset's."""
        d = {_OFFICIAL_NAMES.get(k, k): v for k, v in raw.items()}
        for marker, variant, missing in _VARIANTS:
            found = sorted(k for k in d if marker in k.lower())
            if found:
                raise ConfigError(f"{source}: {variant} (fields {found[:3]}{' ...' if len(found) > 3 else ''}): {missing}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(k for k in d if k not in known and k not in _IGNORED_FIELDS | GENERIC_FIELDS)
        if unknown:
            raise ConfigError(f"{source}: unknown config field(s) {unknown}")
        kw = {k: v for k, v in d.items() if k in known and k not in ("rope_scaling", "layer_types", "mlp_layer_types")}
        n = d.get("num_hidden_layers", cls.num_hidden_layers)

        # Compression rates: dict (HF), or legacy scalar overrides.
        rates = dict(d.get("compress_rates") or {CSA: 4, HCA: 128})
        if "compress_rate_csa" in d:
            rates[CSA] = d["compress_rate_csa"]
        if "compress_rate_hca" in d:
            rates[HCA] = d["compress_rate_hca"]
        kw["compress_rates"] = rates

        # Layer types: explicit, or legacy per-layer ratios (with the trailing MTP entry).
        if d.get("layer_types"):
            kw["layer_types"] = list(d["layer_types"])
        elif d.get("compress_ratios") is not None:
            ratios = list(d["compress_ratios"])
            ratio_to_type = {0: SLIDING, rates[CSA]: CSA, rates[HCA]: HCA, **{4: CSA, 128: HCA}}
            bad = sorted({r for r in ratios if r not in ratio_to_type})
            if bad:
                raise ConfigError(f"{source}: config field `compress_ratios`: unknown ratio(s) {bad}; expected 0, "
                                  f"{rates[CSA]} or {rates[HCA]}")
            if len(ratios) not in (n, n + 1):
                raise ConfigError(f"{source}: config field `compress_ratios` has {len(ratios)} entries; expected "
                                  f"num_hidden_layers ({n}) or num_hidden_layers + 1 (with the MTP layer)")
            kw["layer_types"] = [ratio_to_type[r] for r in ratios[:n]]
            if len(ratios) == n + 1:
                kw["mtp_layer_type"] = ratio_to_type[ratios[n]]
        elif d.get("model_type") == "deepseek_v4":  # a transformers config without either: transformers' default
            kw["layer_types"] = _transformers_default_layer_types(n)
        if d.get("mlp_layer_types"):
            kw["mlp_layer_types"] = list(d["mlp_layer_types"])
        elif "num_hash_layers" in d:
            kw["mlp_layer_types"] = _default_mlp_layer_types(n, int(d["num_hash_layers"]))

        # Partial rotary: either qk_rope_head_dim or partial_rotary_factor.
        head_dim = d.get("head_dim", cls.head_dim)
        if "qk_rope_head_dim" not in d and d.get("partial_rotary_factor"):
            kw["qk_rope_head_dim"] = int(round(head_dim * d["partial_rotary_factor"]))

        kw.update(rope_fields(d))
        if d.get("model_type") == "deepseek_v4" and "rope_scaling" not in kw:
            kw["rope_scaling"] = None  # transformers' default: no YaRN on the compressed layers' RoPE
        if isinstance(kw.get("eos_token_id"), list):
            kw["eos_token_id"] = kw["eos_token_id"][0]
        try:
            return cls(**kw)
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from None
        except TypeError as e:
            raise ConfigError(f"{source}: {e}") from None

    @classmethod
    def from_file(cls, path: str) -> "ModelConfig":
        raw, path = read_config_json(path)
        return cls.from_dict(raw, source=path)


def _default_layer_types(n: int) -> list[str]:
    """V4-Flash schedule: two sliding layers, then CSA/HCA alternating starting with CSA."""
    return [SLIDING] * min(n, 2) + [CSA if i % 2 == 0 else HCA for i in range(max(n - 2, 0))]


def _transformers_default_layer_types(n: int) -> list[str]:
    """transformers' DeepseekV4Config default for a config.json without ``layer_types`` or ``compress_ratios``
    (V4-Pro's schedule): two HCA layers, then HCA/CSA alternating starting with HCA."""
    return [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]


def _default_mlp_layer_types(n: int, n_hash: int) -> list[str]:
    return [HASH_MOE] * min(n, n_hash) + [MOE] * max(0, n - n_hash)


# ---- presets -------------------------------------------------------------------------------------
def v4_flash() -> ModelConfig:
    return ModelConfig()


def v4_pro() -> ModelConfig:
    n = 61
    return ModelConfig(
        hidden_size=7168, num_hidden_layers=n, num_attention_heads=128, q_lora_rank=1536, o_groups=16,
        index_topk=1024, n_routed_experts=384, moe_intermediate_size=3072, routed_scaling_factor=2.5,
        layer_types=[HCA, HCA] + [CSA if i % 2 == 0 else HCA for i in range(n - 2)],
    )


def tiny(**overrides) -> ModelConfig:
    """A few-layer model with every V4 feature at toy sizes (tests, default job)."""
    base = dict(
        vocab_size=256, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, head_dim=32,
        qk_rope_head_dim=8, q_lora_rank=32, o_groups=2, o_lora_rank=16, sliding_window=8,
        layer_types=[SLIDING, CSA, HCA, CSA], compress_rates={CSA: 4, HCA: 8},
        rope_scaling=YarnScaling(factor=4.0, original_max_position_embeddings=64),
        max_position_embeddings=4096, index_n_heads=4, index_head_dim=16, index_topk=4,
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        mlp_layer_types=[HASH_MOE, MOE, MOE, MOE], routed_scaling_factor=1.5, hc_mult=4,
    )
    base.update(overrides)
    return ModelConfig(**base)


PRESETS = {"deepseek-v4-flash": v4_flash, "deepseek-v4-pro": v4_pro, "tiny": tiny}


def get_preset(name: str) -> ModelConfig:
    """A DeepSeek-V4 preset's config (PRESETS). Every architecture's presets: trex.models.registry.get_preset
    (``trex.models.get_preset``), which this module cannot reach: the registry imports it."""
    return lookup_preset(PRESETS, name)


def official_config(cfg: ModelConfig, out: dict) -> dict:
    """``Architecture.official_config``: the config.json of the "official" checkpoint layout from the transformers
    one (``out``: ``to_hf_dict`` and what the writer added), as DeepSeek's released config.json spells it: legacy
    ``compress_ratios`` with the MTP entry, ``num_hash_layers``, ``qk_rope_head_dim``, flat ``rope_scaling``. Reads
    back to ``cfg``."""
    out = dict(out)
    ratio = {CSA: cfg.compress_rates[CSA], HCA: cfg.compress_rates[HCA]}
    out["compress_ratios"] = [ratio.get(t, 0) for t in cfg.layer_types] + [ratio.get(cfg.mtp_layer_type, 0)]
    if cfg.compress_rates == ModelConfig().compress_rates:
        del out["compress_rates"]  # the released rates: compress_ratios says them
    n_hash = sum(t == HASH_MOE for t in cfg.mlp_layer_types)
    if cfg.mlp_layer_types == [HASH_MOE] * n_hash + ["moe"] * (cfg.num_hidden_layers - n_hash):
        out["num_hash_layers"] = n_hash
        del out["mlp_layer_types"]
    del out["layer_types"], out["rope_parameters"], out["partial_rotary_factor"]
    out["qk_rope_head_dim"] = cfg.qk_rope_head_dim
    yarn = cfg.rope_scaling
    if yarn is not None:
        out["rope_scaling"] = {"type": "yarn", "factor": yarn.factor, "beta_fast": yarn.beta_fast,
                               "beta_slow": yarn.beta_slow,
                               "original_max_position_embeddings": yarn.original_max_position_embeddings}
    else:
        out["rope_scaling"] = {"type": "default"}
    return out


# ==================================================================================================
# The context-parallel split rule (trex.models.registry.check_shardable): each shard a whole number of
# every compression window, and at least as long as the halo it lends its neighbours.
# ==================================================================================================
def shard_halo(cfg: ModelConfig, layer_type: str) -> tuple[int, int]:
    """Rows (before, after) a shard of a layer of ``layer_type`` needs from its neighbours' inputs: the
    sliding window's W - 1 keys before it (and CSA's previous window, m rows), and the m - 1 rows a
    compression window that starts in the shard reaches into the next one."""
    m = cfg.compress_rate(layer_type)
    before = max(cfg.sliding_window - 1, m if layer_type == CSA else 0)
    return before, max(m - 1, 0)


def _shard_unit(cfg: ModelConfig) -> tuple[int, int]:
    """(tokens a shard must be a multiple of: every compression rate; the longest halo it lends)."""
    types = set(cfg.layer_types) | {cfg.mtp_layer_type}
    unit = math.lcm(*[r for r in cfg.layer_rates() if r], 1)
    return unit, max(max(shard_halo(cfg, t)) for t in types)


def shardable_length(cfg: ModelConfig, length: int, shards: int) -> int:
    """The shortest sequence length >= ``length`` that splits into ``shards`` shards (check_shardable)."""
    if shards == 1:
        return length
    unit, halo = _shard_unit(cfg)
    q = shards * unit
    return max(q * -(-shards * halo // q), -(-length // q) * q)


def check_shardable(cfg: ModelConfig, seq_len: int, shards: int) -> None:
    """ValueError unless a sequence of ``seq_len`` splits into ``shards`` context-parallel shards: each
    shard a whole number of every compression window (so entries split evenly), and at least as long
    as the halo it lends its neighbours. The message names lengths that would work."""
    if shards == 1:
        return
    unit, halo = _shard_unit(cfg)
    if seq_len % (shards * unit) or seq_len // shards < halo:
        q = shards * unit
        least = shardable_length(cfg, 1, shards)
        near = sorted({max(least, seq_len // q * q), shardable_length(cfg, seq_len, shards)})
        raise ValueError(f"a sequence of {seq_len} tokens does not split into cp = {shards} shards: each shard "
                         f"must be a multiple of {unit} tokens (the compression windows) and at least {halo} "
                         f"(the halo it lends), so seq_len must be a multiple of {q} and >= {least}; "
                         f"{' or '.join(map(str, near))} would work")
