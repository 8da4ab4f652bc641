"""Typed DeepSeek-V4.1 model configuration (CSA2 attention, single-pass mHC, Engram, DSpark stages).

Reads the released ``config.json`` (its ``text_config``, or a flat one; the field names of NeMo
Automodel's and vLLM's V4.1 configs, which are the Hugging Face names) and DeepSeek's
``inference/config.json`` names (``dim``, ``kv_source_layers``, ``engram_pad_id`` ...). Presets:
``deepseek-v4.1-flash`` (the released shapes) and ``tiny-v4.1`` (every V4.1 layer kind, Engram and an
active candidate pool at toy sizes).

Layers by ``compress_ratios[i]``: 0 attends over its sliding window only; r > 0 also attends over
compressed entries of r tokens each (non-overlapping, no ``ape``), which only the KV-source layers
compute; every later layer of that ratio reads the latest source's entries, and the picks of the
latest index-source layer. The list's tail past ``num_hidden_layers`` belongs to the DSpark stages.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field

from trex.models.common.config import GENERIC_FIELDS, MOE, ConfigError, YarnScaling, need, read_config_json, rope_fields
from trex.models.deepseek_v4.config import SLIDING, ModelConfig, validate_shared
from trex.models.deepseek_v4.engram_layout import EngramLayout

CSA2 = "csa2"  # the layer type of every compressed V4.1 layer; its rate is the layer's own ratio

_OFFICIAL_NAMES = {
    "dim": "hidden_size", "n_layers": "num_hidden_layers", "n_heads": "num_attention_heads",
    "moe_inter_dim": "moe_intermediate_size", "n_activated_experts": "num_experts_per_tok",
    "score_func": "scoring_func", "route_scale": "routed_scaling_factor", "rope_head_dim": "qk_rope_head_dim",
    "window_size": "sliding_window", "norm_eps": "rms_norm_eps", "n_mtp_layers": "num_nextn_predict_layers",
    "max_seq_len": "max_position_embeddings", "kv_source_layers": "kv_source_layer_ids",
    "index_source_layers": "index_source_layer_ids", "candidate_source_layer": "candidate_source_layer_id",
    "engram_pad_id": "engram_pad_token_id", "dspark_n_activated_experts": "dspark_num_experts_per_tok",
}
_IGNORED_FIELDS = {
    "architectures", "model_type", "torch_dtype", "dtype", "transformers_version", "quantization_config",
    "expert_dtype", "scale_fmt", "use_cache", "attention_bias", "attention_dropout", "hidden_act", "topk_method",
    "pad_token_id", "num_key_value_heads", "_name_or_path", "max_batch_size", "temperature", "gate_temp",
    "rope_scaling", "rope_parameters", "original_seq_len", "rope_factor", "beta_fast", "beta_slow", "auto_map",
    "num_hash_layers", "image_token_id", "vision_config", "partial_rotary_factor", "n_dense_layers",
}
_VISION_PREFIX = "vision_"  # official flat names of the vision tower: passed through, not part of the text model
# checkpoint tensors of a V4.1 checkpoint that trex carries through untrained: the vision tower (``vision.``,
# ``aligner.``, the image-span embeddings, each router's bias for image tokens) and the DSpark drafter's
# stages (``mtp.N.``)
PASSTHROUGH = re.compile(r"^(mtp\.\d+\.|vision\.|aligner\.|image_(start|end|newline)$)|\.gate\.bias_vl$")


@dataclass
class V41Config:
    """DeepSeek-V4.1 text model. Field names follow the released config.json's ``text_config``."""

    vocab_size: int = 129280
    hidden_size: int = 5120
    num_hidden_layers: int = 40
    num_attention_heads: int = 64
    head_dim: int = 512
    qk_rope_head_dim: int = 64
    q_lora_rank: int = 1280
    o_groups: int = 8
    o_lora_rank: int = 1024
    sliding_window: int = 128
    compress_ratios: list[int] = field(default_factory=lambda: [0, 0] + [2] * 18 + [1] * 20 + [0] * 3)
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_scaling: YarnScaling | None = field(default_factory=YarnScaling)
    max_position_embeddings: int = 1048576
    kv_source_layer_ids: list[int] = field(default_factory=lambda: [2, 8, 14, 20])
    index_source_layer_ids: list[int] = field(default_factory=lambda: [2, 8, 14, 20, 24, 28, 32, 36])
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 512
    candidate_source_layer_id: int = 20  # -1: no candidate pool
    candidate_topk_blocks: int = 2048
    candidate_block_size: int = 8
    n_routed_experts: int = 384
    n_shared_experts: int = 1
    num_experts_per_tok: int = 6
    moe_intermediate_size: int = 2304
    scoring_func: str = "sqrtsoftplus"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    rms_norm_eps: float = 1e-20
    engram_layer_ids: list[int] = field(default_factory=lambda: [1, 14])
    engram_num_embeddings: list[int] = field(default_factory=lambda: [384006168, 384016682])
    engram_max_ngram_size: int = 4
    engram_vocab_size: int = 16000000
    engram_n_heads: int = 8
    engram_head_dim: int = 256
    engram_pad_token_id: int = 2
    engram_compressed_vocab_size: int = 99092
    num_nextn_predict_layers: int = 3  # DSpark stages (mtp.*), carried through checkpoints as loaded
    dspark_block_size: int = 5
    dspark_noise_token_id: int = 128799
    dspark_target_layer_ids: list[int] = field(default_factory=lambda: [37, 38, 39])
    dspark_markov_rank: int = 256
    dspark_n_routed_experts: int = 128
    dspark_num_experts_per_tok: int = 3
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 0
    eos_token_id: int | None = 1
    initializer_range: float = 0.02

    architecture = "deepseek_v41"
    mtp_layer_type = SLIDING  # the DSpark stages attend over their window only
    fp8_block = 32  # the released FP8 linears' block scales (32 x 32) and activations' (1 x 32)

    def __post_init__(self) -> None:
        self.validate()

    # ------------------------------------------------------------------------------------
    def validate(self) -> None:
        validate_shared(self)
        for name in ("index_n_heads", "index_head_dim", "index_topk"):
            need(isinstance(getattr(self, name), int) and getattr(self, name) > 0, name,
                 f"must be a positive integer, got {getattr(self, name)!r}")
        n = self.num_hidden_layers
        need(len(self.compress_ratios) in (n, n + self.num_nextn_predict_layers), "compress_ratios",
             f"has {len(self.compress_ratios)} entries; expected num_hidden_layers ({n}), or that plus "
             f"num_nextn_predict_layers ({self.num_nextn_predict_layers})")
        need(all(isinstance(r, int) and r >= 0 for r in self.compress_ratios), "compress_ratios",
             f"entries must be integers >= 0, got {self.compress_ratios}")
        need(all(r == 0 for r in self.compress_ratios[n:]), "compress_ratios",
             "the DSpark stages' entries (past num_hidden_layers) must be 0")
        for name in ("kv_source_layer_ids", "index_source_layer_ids", "engram_layer_ids"):
            ids = getattr(self, name)
            need(all(isinstance(i, int) and 0 <= i < n for i in ids) and list(ids) == sorted(set(ids)), name,
                 f"must be increasing layer ids below {n}, got {ids}")
        ratios = self.layer_ratios
        need(all(ratios[i] > 0 for i in self.kv_source_layer_ids), "kv_source_layer_ids",
             "every KV-source layer must compress (compress_ratios > 0)")
        need(set(self.kv_source_layer_ids) <= set(self.index_source_layer_ids), "index_source_layer_ids",
             "every KV-source layer must also be an index source (its indexer owns the index keys)")
        for i, r in enumerate(ratios):
            if r == 0:
                continue
            kv, index = self.kv_source_of(i), self.index_source_of(i)
            need(kv is not None and ratios[kv] == r, "kv_source_layer_ids",
                 f"layer {i} (ratio {r}) has no earlier KV-source layer of ratio {r}")
            need(index is not None and index >= kv, "index_source_layer_ids",
                 f"layer {i} reads the picks of no index source at or after its KV source (layer {kv})")
        need(0 < self.qk_rope_head_dim <= min(self.head_dim, self.index_head_dim) and self.qk_rope_head_dim % 2 == 0,
             "qk_rope_head_dim", f"must be even and at most head_dim and index_head_dim, got {self.qk_rope_head_dim}")
        if self.candidate_source_layer_id >= 0:
            need(self.candidate_source_layer_id in self.index_source_layer_ids, "candidate_source_layer_id",
                 f"must be an index-source layer, got {self.candidate_source_layer_id}")
            need(self.candidate_topk_blocks > 0 and self.candidate_block_size > 0, "candidate_topk_blocks",
                 "the candidate pool's sizes must be positive")
            pool_ratio = ratios[self.candidate_source_layer_id]
            need(all(ratios[i] == pool_ratio for i in self.index_source_layer_ids if i > self.candidate_source_layer_id),
                 "index_source_layer_ids", f"the index sources after the candidate source (layer "
                 f"{self.candidate_source_layer_id}) pick inside its pool, so they need its ratio {pool_ratio}")
        if self.engram_layer_ids:
            need(len(self.engram_num_embeddings) == len(self.engram_layer_ids), "engram_num_embeddings",
                 f"needs one table size per Engram layer ({len(self.engram_layer_ids)}), got {self.engram_num_embeddings}")
            need(self.engram_max_ngram_size >= 2 and self.engram_n_heads > 0 and self.engram_head_dim > 0,
                 "engram_max_ngram_size", "Engram needs n-grams of 2 or more tokens, heads and a head size")
            need(0 < self.engram_compressed_vocab_size, "engram_compressed_vocab_size", "must be positive")
            rows = self.engram_layout().rows
            need(tuple(self.engram_num_embeddings) == rows, "engram_num_embeddings",
                 f"{self.engram_num_embeddings} are not the tables the hashing addresses: the primes drawn from "
                 f"engram_vocab_size {self.engram_vocab_size} give {list(rows)} rows")

    # ------------------------------------------------------------------------------------
    @property
    def layer_ratios(self) -> list[int]:
        """The backbone's compression ratio per layer."""
        return list(self.compress_ratios[: self.num_hidden_layers])

    @property
    def layer_types(self) -> list[str]:
        return [CSA2 if r else SLIDING for r in self.layer_ratios]

    @property
    def mlp_layer_types(self) -> list[str]:
        return [MOE] * self.num_hidden_layers  # no hash-routed layers

    def compress_rate(self, layer_type: str) -> int:
        """The largest ratio of a layer type (0 for window-only): what a context-parallel shard's halo
        must cover (trex.models.deepseek_v4.config.shard_halo)."""
        return 0 if layer_type == SLIDING else max(self.layer_ratios)

    def layer_rates(self) -> list[int]:
        """Every compression rate a forward uses (backbone layers, then the MTP layer type's)."""
        return [*self.layer_ratios, 0]

    def kv_source_of(self, layer: int) -> int | None:
        """The KV-source layer whose compressed entries ``layer`` attends over (the latest at or before it)."""
        return max((i for i in self.kv_source_layer_ids if i <= layer), default=None)

    def index_source_of(self, layer: int) -> int | None:
        """The index-source layer whose picks ``layer`` uses (the latest at or before it)."""
        return max((i for i in self.index_source_layer_ids if i <= layer), default=None)

    def engram_layout(self):
        """The Engram tables' bucket layout (trex.models.deepseek_v4.engram_layout.EngramLayout)."""
        return EngramLayout.build(self.engram_layer_ids, self.engram_max_ngram_size, self.engram_n_heads,
                                  self.engram_vocab_size)

    def to_hf_dict(self) -> dict:
        """The ``text_config`` of a released-style config.json."""
        d = dataclasses.asdict(self)
        yarn = d.pop("rope_scaling")
        out = {"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41", **d,
               "hidden_act": "silu", "topk_method": "noaux_tc", "num_key_value_heads": 1}
        if yarn is not None:
            out["rope_scaling"] = {"type": "yarn", **yarn}
        return out

    # ------------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict, source: str = "<dict>") -> "V41Config":
        """Build from a released config.json (``text_config`` nested or flat) or the official
        inference names. Unknown fields are an error naming them."""
        if isinstance(raw.get("text_config"), dict):
            raw = {**{k: v for k, v in raw.items() if k != "text_config"}, **raw["text_config"]}
        d = {_OFFICIAL_NAMES.get(k, k): v for k, v in raw.items() if not k.startswith(_VISION_PREFIX)}
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(k for k in d if k not in known and k not in _IGNORED_FIELDS | GENERIC_FIELDS)
        if unknown:
            raise ConfigError(f"{source}: unknown config field(s) {unknown}")
        kw = {k: v for k, v in d.items() if k in known and k != "rope_scaling"}
        kw.update(rope_fields(d))
        if isinstance(kw.get("eos_token_id"), list):
            kw["eos_token_id"] = kw["eos_token_id"][0]
        for name in ("compress_ratios", "kv_source_layer_ids", "index_source_layer_ids", "engram_layer_ids",
                     "engram_num_embeddings", "dspark_target_layer_ids"):
            if name in kw:
                kw[name] = list(kw[name])
        try:
            return cls(**kw)
        except (ConfigError, TypeError) as e:
            raise ConfigError(f"{source}: {e}") from None


# ---- presets -------------------------------------------------------------------------------------
def v41_flash() -> V41Config:
    return V41Config()


def tiny_v41(**overrides) -> V41Config:
    """Every V4.1 layer kind at toy sizes: window-only layers, a ratio-2 run with two KV sources, a
    ratio-1 run with an index source that feeds a candidate pool to a later index source, Engram at two
    layers (one a KV source), no DSpark stages."""
    base = dict(
        vocab_size=256, hidden_size=64, num_hidden_layers=7, num_attention_heads=4, head_dim=32,
        qk_rope_head_dim=8, q_lora_rank=32, o_groups=2, o_lora_rank=16, sliding_window=8,
        compress_ratios=[0, 2, 2, 2, 1, 1, 1], rope_scaling=YarnScaling(factor=4.0, original_max_position_embeddings=64),
        max_position_embeddings=4096, kv_source_layer_ids=[1, 3, 4], index_source_layer_ids=[1, 3, 4, 6],
        index_n_heads=8, index_head_dim=16, index_topk=6, candidate_source_layer_id=4, candidate_topk_blocks=3,
        candidate_block_size=4, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        engram_layer_ids=[0, 3], engram_num_embeddings=[0, 0], engram_max_ngram_size=3, engram_vocab_size=31,
        engram_n_heads=2, engram_head_dim=16, engram_compressed_vocab_size=256, num_nextn_predict_layers=0,
        dspark_target_layer_ids=[], hc_mult=4,
    )
    base.update(overrides)
    if base.get("engram_layer_ids") and not any(base["engram_num_embeddings"]):
        layout = EngramLayout.build(base["engram_layer_ids"], base["engram_max_ngram_size"], base["engram_n_heads"],
                                    base["engram_vocab_size"])
        base["engram_num_embeddings"] = list(layout.rows)
    return V41Config(**base)


V41_PRESETS = {"deepseek-v4.1-flash": v41_flash, "tiny-v4.1": tiny_v41}


# ---- which architecture a config.json describes ---------------------------------------------------
_V41_MARKERS = ("kv_source_layers", "kv_source_layer_ids", "index_source_layers", "index_source_layer_ids",
                "engram_layer_ids")


def is_v41(raw: dict) -> bool:
    """Whether a config.json dict describes DeepSeek-V4.1 (its model_type, or its layer-sharing and
    Engram fields, top level or in ``text_config``)."""
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else {}
    return "deepseek_v41" in (raw.get("model_type"), text.get("model_type")) or any(
        k in raw or k in text for k in _V41_MARKERS)


def config_from_dict(raw: dict, source: str = "<dict>"):
    """The config of the architecture ``raw`` describes: V41Config for DeepSeek-V4.1, else ModelConfig
    (DeepSeek-V4, which names the variants it cannot train, such as V4-Flash-0731's DSpark drafter). The
    V4 family's dispatch; every architecture's: trex.models.registry.config_from_dict."""
    return V41Config.from_dict(raw, source) if is_v41(raw) else ModelConfig.from_dict(raw, source)


def config_from_file(path: str):
    """``config_from_dict`` of a config.json (or of a directory's); a missing or invalid file is a
    ConfigError naming it."""
    raw, path = read_config_json(path)
    return config_from_dict(raw, source=path)
