"""Typed DeepSeek-V3 family configuration: DeepSeek-V3 / R1 / V3.1, V3.2 (DeepSeek Sparse Attention's
indexer fields), Kimi-K2 and Moonlight, which share V3's architecture and differ in sizes.

Reads a Hugging Face ``config.json`` (``DeepseekV3Config`` field names: the released ``rope_scaling``
with ``"type": "yarn"`` and a top-level ``rope_theta``, or transformers 5's ``rope_parameters``) and
DeepSeek's ``inference/config_671B.json`` names (``dim``, ``n_dense_layers``, ``n_expert_groups`` ...).
No torch: ``trex --help`` and the registry read the presets.

YaRN carries two mscale fields (``YarnMScale``, a subclass of the shared ``YarnScaling``, so that V4.1's
written config.json does not change): the attention's softmax scale is qk_head_dim^-0.5 x m(mscale_all_dim)^2
and the RoPE cos/sin are scaled by m(mscale) / m(mscale_all_dim), with m(x) = 0.1 x ln(factor) + 1 (1
for factor <= 1). That is transformers' split; DeepSeek's code scales the softmax by m(mscale)^2, the
same whenever the two fields are equal (every released config: 1.0 and 1.0); DeepSeek's inference config
names one ``mscale`` (its softmax's), which sets both. A YaRN config that names
neither field reads as DeepSeek's code reads it (1.0 each); transformers would then scale cos/sin by
m(1) instead (reference trap). YaRN applies at every length (DeepSeek's code only past its cache length
``max_seq_len > original_seq_len``: reference trap 1).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from trex.models.common.config import GENERIC_FIELDS, ConfigError, YarnScaling, lookup_preset, need, read_config_json

V3, V32, KIMI_K2 = "deepseek_v3", "deepseek_v32", "kimi_k2"
MODEL_TYPES = (V3, V32, KIMI_K2)  # config.json model_type values this family reads (and writes back)
# fields no V4-family config has: a config.json without a model_type that has one of them is a V3's
MARKERS = ("qk_nope_head_dim", "v_head_dim", "first_k_dense_replace")

# DeepSeek's inference/config.json names -> HF names.
_OFFICIAL_NAMES = {
    "dim": "hidden_size", "inter_dim": "intermediate_size", "moe_inter_dim": "moe_intermediate_size",
    "n_layers": "num_hidden_layers", "n_dense_layers": "first_k_dense_replace", "n_heads": "num_attention_heads",
    "n_activated_experts": "num_experts_per_tok", "n_expert_groups": "n_group", "n_limited_groups": "topk_group",
    "score_func": "scoring_func", "route_scale": "routed_scaling_factor", "norm_eps": "rms_norm_eps",
    "num_mtp_layers": "num_nextn_predict_layers",  # transformers 5's alias
}
# Fields real config files carry that change nothing trex builds (each checked one is in _REQUIRED).
_IGNORED_FIELDS = {
    "architectures", "torch_dtype", "dtype", "transformers_version", "quantization_config", "use_cache",
    "attention_dropout", "pad_token_id", "num_key_value_heads", "_name_or_path", "auto_map", "ep_size",
    "pretraining_tp", "aux_loss_alpha", "seq_aux", "output_router_logits", "router_aux_loss_coef",
    "keys_to_ignore_at_inference", "scale_fmt", "head_dim", "qk_head_dim", "max_seq_len", "max_batch_size",
    "layer_types", "mlp_layer_types", "mlp_bias", "num_local_experts", "rope_theta", "rope_scaling",
    "rope_parameters", "rope_factor", "original_seq_len", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
}
# Fields whose other values describe an architecture trex does not build: field -> (allowed values, why).
_REQUIRED = {
    "hidden_act": (("silu",), "the experts and dense MLPs are SwiGLU"),
    "topk_method": (("noaux_tc",), "routing is V3's aux-loss-free top-k (sigmoid scores plus a bias)"),
    "scoring_func": (("sigmoid",), "V3 routes by sigmoid scores"),
    "moe_layer_freq": ((1,), "every layer after first_k_dense_replace is MoE"),
    "attention_bias": ((False,), "the attention projections have no bias"),
    "rope_interleave": ((True,), "checkpoints with rope_interleave false store the RoPE rows permuted "
                                 "(half-split); trex reads the interleaved layout only"),
}


def yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN's attention magnitude m = 0.1 x mscale x ln(factor) + 1 (1 when factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclass(frozen=True)
class YarnMScale(YarnScaling):
    """YaRN as DeepSeek-V3 configures it: the shared frequency blend (common.rope.rope_inv_freq) and the
    attention magnitude (``softmax_scale``, ``rope_scale``). Defaults: DeepSeek-V3's."""

    factor: float = 40.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 1.0

    @property
    def softmax_scale(self) -> float:
        """What the softmax scale qk_head_dim^-0.5 is multiplied by: m(mscale_all_dim)^2."""
        return yarn_mscale(self.factor, self.mscale_all_dim) ** 2

    @property
    def rope_scale(self) -> float:
        """What RoPE's cos and sin are multiplied by: m(mscale) / m(mscale_all_dim) (1 when equal)."""
        return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)


def _yarn(src: dict) -> YarnMScale:
    return YarnMScale(
        factor=float(src.get("factor", 40.0)),
        original_max_position_embeddings=int(src.get("original_max_position_embeddings", 4096)),
        beta_fast=float(src.get("beta_fast") or 32.0), beta_slow=float(src.get("beta_slow") or 1.0),
        mscale=float(src.get("mscale") or 1.0), mscale_all_dim=float(src.get("mscale_all_dim") or 1.0))


def rope_fields(d: dict, source: str) -> dict:
    """``rope_theta`` and ``rope_scaling`` (YarnMScale or None) of a config dict: transformers 5's flat
    ``rope_parameters`` (its own ``rope_theta``), the released ``rope_scaling`` with a top-level
    ``rope_theta``, or DeepSeek's ``rope_factor`` / ``original_seq_len`` / ``mscale``."""
    kw: dict = {}
    if "rope_theta" in d:
        kw["rope_theta"] = float(d["rope_theta"])
    src = d.get("rope_parameters") or d.get("rope_scaling")
    if isinstance(src, dict):
        if "rope_theta" in src:
            kw["rope_theta"] = float(src["rope_theta"])
        kind = src.get("rope_type", src.get("type", "default"))
        if kind not in ("yarn", "default"):
            raise ConfigError(f"{source}: config field `rope_scaling`: RoPE type {kind!r}; DeepSeek-V3 uses yarn or none")
        kw["rope_scaling"] = _yarn(src) if kind == "yarn" else None
    elif "rope_factor" in d:  # DeepSeek's one ``mscale`` scales the softmax by m(mscale)^2 and not cos/sin:
        # both fields equal (mscale_all_dim alone would leave a cos/sin factor m(mscale) / m(1))
        kw["rope_scaling"] = _yarn({"factor": d["rope_factor"], "beta_fast": d.get("beta_fast"),
                                    "beta_slow": d.get("beta_slow"), "mscale": d.get("mscale"),
                                    "mscale_all_dim": d.get("mscale"),
                                    "original_max_position_embeddings": d.get("original_seq_len", 4096)})
    elif "rope_scaling" in d or "rope_parameters" in d:  # written as null
        kw["rope_scaling"] = None
    return kw


@dataclass
class V3Config:
    """DeepSeek-V3 family architecture. Field names follow transformers' ``DeepseekV3Config``; defaults are
    DeepSeek-V3's (= R1, V3-0324, V3.1). ``q_lora_rank`` 0: queries by one projection (Moonlight);
    ``index_topk`` 0: dense attention (V3.2's DeepSeek Sparse Attention sets index_n_heads, index_head_dim
    and index_topk); ``model_type`` is written back as read (Kimi-K2's ``kimi_k2`` lets engines tell it apart)."""

    vocab_size: int = 129280
    hidden_size: int = 7168
    intermediate_size: int = 18432
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 61
    num_attention_heads: int = 128
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    num_experts_per_tok: int = 8
    n_group: int = 8
    topk_group: int = 4
    routed_scaling_factor: float = 2.5
    norm_topk_prob: bool = True
    first_k_dense_replace: int = 3
    num_nextn_predict_layers: int = 1
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: YarnMScale | None = field(default_factory=YarnMScale)
    max_position_embeddings: int = 163840
    index_n_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 0
    eos_token_id: int | None = 1
    initializer_range: float = 0.02
    model_type: str = V3

    architecture = "deepseek_v3"
    fp8_block = 128  # the released FP8 linears' block scales (128 x 128, fp32 weight_scale_inv)
    scoring_func = "sigmoid"  # the router (common.moe.Gate)
    swiglu_limit = 0.0  # no clamp in the experts' SwiGLU

    def __post_init__(self) -> None:
        if self.q_lora_rank is None:  # transformers writes null for "none"
            self.q_lora_rank = 0
        if isinstance(self.rope_scaling, YarnScaling) and not isinstance(self.rope_scaling, YarnMScale):
            self.rope_scaling = YarnMScale(**dataclasses.asdict(self.rope_scaling))
        self.validate()

    # ------------------------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def sparse(self) -> bool:
        """DeepSeek Sparse Attention (V3.2): an indexer picks each query's index_topk keys."""
        return self.index_topk > 0

    def moe_layers(self) -> int:
        """Layers of the main model with routed experts (the first first_k_dense_replace are dense)."""
        return self.num_hidden_layers - self.first_k_dense_replace

    def validate(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                     "n_routed_experts", "num_experts_per_tok", "n_group", "topk_group", "max_position_embeddings"):
            value = getattr(self, name)
            need(isinstance(value, int) and not isinstance(value, bool) and value > 0, name,
                 f"must be a positive integer, got {value!r}")
        for name in ("q_lora_rank", "n_shared_experts", "first_k_dense_replace", "num_nextn_predict_layers",
                     "index_n_heads", "index_head_dim", "index_topk"):
            value = getattr(self, name)
            need(isinstance(value, int) and not isinstance(value, bool) and value >= 0, name,
                 f"must be a non-negative integer, got {value!r}")
        need(self.qk_rope_head_dim % 2 == 0, "qk_rope_head_dim",
             f"must be even (RoPE rotates pairs), got {self.qk_rope_head_dim}")
        need(self.num_experts_per_tok <= self.n_routed_experts, "num_experts_per_tok",
             f"({self.num_experts_per_tok}) exceeds n_routed_experts ({self.n_routed_experts})")
        need(self.n_routed_experts % self.n_group == 0, "n_group",
             f"({self.n_group}) must divide n_routed_experts ({self.n_routed_experts})")
        need(self.topk_group <= self.n_group, "topk_group", f"({self.topk_group}) exceeds n_group ({self.n_group})")
        per_group = self.n_routed_experts // self.n_group
        need(self.n_group == 1 or per_group >= 2, "n_group",
             f"groups score by their top two experts: {self.n_routed_experts} experts in {self.n_group} groups "
             f"leaves {per_group} per group")
        need(self.n_group == 1 or self.topk_group * per_group >= self.num_experts_per_tok, "topk_group",
             f"{self.topk_group} groups of {per_group} experts hold fewer than num_experts_per_tok "
             f"({self.num_experts_per_tok})")
        need(self.first_k_dense_replace <= self.num_hidden_layers, "first_k_dense_replace",
             f"({self.first_k_dense_replace}) exceeds num_hidden_layers ({self.num_hidden_layers})")
        need(not self.tie_word_embeddings, "tie_word_embeddings", "the DeepSeek-V3 family's head is untied")
        need(self.rms_norm_eps > 0, "rms_norm_eps", f"must be positive, got {self.rms_norm_eps!r}")
        need(self.routed_scaling_factor > 0, "routed_scaling_factor",
             f"must be positive, got {self.routed_scaling_factor!r}")
        need(self.model_type in MODEL_TYPES, "model_type",
             f"{self.model_type!r} is not of the DeepSeek-V3 family ({', '.join(MODEL_TYPES)})")
        sparse_fields = (self.index_n_heads, self.index_head_dim, self.index_topk)
        need(all(sparse_fields) or not any(sparse_fields), "index_topk",
             f"index_n_heads, index_head_dim and index_topk are all set (V3.2) or all 0, got {sparse_fields}")
        need(self.sparse == (self.model_type == V32), "model_type",
             f"{self.model_type!r} with index_topk {self.index_topk}: DeepSeek Sparse Attention's indexer is "
             f"model_type {V32!r}'s, and {V32!r} has one")
        if self.sparse:
            need(self.q_lora_rank > 0, "q_lora_rank", "V3.2's indexer reads the query latent: needs q_lora_rank > 0")
            need(self.qk_rope_head_dim <= self.index_head_dim, "index_head_dim",
                 f"({self.index_head_dim}) must be at least qk_rope_head_dim ({self.qk_rope_head_dim})")
        if self.rope_scaling is not None:
            y = self.rope_scaling
            need(y.factor > 0 and y.original_max_position_embeddings > 0, "rope_scaling",
                 f"factor and original_max_position_embeddings must be positive, got {y.factor}, "
                 f"{y.original_max_position_embeddings}")

    # ------------------------------------------------------------------------------------
    def to_hf_dict(self) -> dict:
        """A ``config.json`` as released, which transformers, vLLM and SGLang read: ``DeepseekV3ForCausalLM``
        (V3.2: ``DeepseekV32ForCausalLM``), SwiGLU (``hidden_act``), sigmoid routing with the bias
        (``topk_method noaux_tc``, ``scoring_func sigmoid``: vLLM's defaults differ), ``rope_scaling`` with
        both mscale fields, ``num_nextn_predict_layers``; the indexer's fields only for V3.2 (vLLM builds
        sparse attention whenever ``index_topk`` is present)."""
        d = dataclasses.asdict(self)
        yarn = d.pop("rope_scaling")
        for name in ("index_n_heads", "index_head_dim", "index_topk"):
            if not self.sparse:
                d.pop(name)
        d["q_lora_rank"] = self.q_lora_rank or None
        arch = "DeepseekV32ForCausalLM" if self.model_type == V32 else "DeepseekV3ForCausalLM"
        out = {"architectures": [arch], **d, "num_key_value_heads": self.num_attention_heads, "hidden_act": "silu",
               "topk_method": "noaux_tc", "scoring_func": "sigmoid", "moe_layer_freq": 1, "attention_bias": False,
               "rope_interleave": True}
        out["rope_scaling"] = None if yarn is None else {"type": "yarn", **yarn}
        return out

    @classmethod
    def from_dict(cls, raw: dict, source: str = "<dict>") -> V3Config:
        """Build from HF or DeepSeek config names. Unknown fields, and values of a field that describe
        another architecture (``hidden_act``, ``topk_method``, ``rope_interleave`` ...), are an error
        naming them."""
        d = {_OFFICIAL_NAMES.get(k, k): v for k, v in raw.items()}
        for name, (allowed, why) in _REQUIRED.items():
            if name in d and d[name] not in allowed:
                raise ConfigError(f"{source}: config field `{name}`: {d[name]!r} is not supported "
                                  f"(expected {' or '.join(map(repr, allowed))}: {why})")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(k for k in d if k not in known and k not in _IGNORED_FIELDS | GENERIC_FIELDS | set(_REQUIRED))
        if unknown:
            raise ConfigError(f"{source}: unknown config field(s) {unknown}")
        kw = {k: v for k, v in d.items() if k in known and k != "rope_scaling"}
        kw.update(rope_fields(d, source))
        for name in ("q_lora_rank", "index_n_heads", "index_head_dim", "index_topk", "n_group", "topk_group",
                     "first_k_dense_replace"):
            if name in kw and kw[name] is None:
                kw[name] = 0 if name.startswith(("q_", "index_", "first_")) else 1
        if isinstance(kw.get("eos_token_id"), list):
            kw["eos_token_id"] = kw["eos_token_id"][0]
        if "model_type" not in kw and kw.get("index_topk"):
            kw["model_type"] = V32
        # no field, no MTP layer: transformers' DeepseekV32Config and DeepSeek's inference ModelArgs have no such
        # field and their checkpoints no MTP tensors (the dataclass's 1 is V3's released value, for presets)
        kw.setdefault("num_nextn_predict_layers", 0)
        try:
            return cls(**kw)
        except (ConfigError, TypeError) as e:
            raise ConfigError(f"{source}: {e}") from None

    @classmethod
    def from_file(cls, path: str) -> V3Config:
        raw, path = read_config_json(path)
        return cls.from_dict(raw, source=path)


def is_v3(raw: dict) -> bool:
    """Whether a config.json dict describes the DeepSeek-V3 family: its model_type (deepseek_v3, deepseek_v32,
    kimi_k2), or, without one, a field only V3 has (``qk_nope_head_dim``, ``v_head_dim``,
    ``first_k_dense_replace``: DeepSeek's inference/config.json has no model_type)."""
    model_type = raw.get("model_type")
    if model_type is not None:
        return model_type in MODEL_TYPES
    return any(k in raw for k in MARKERS)


# ---- context parallelism's split (trex.models.registry.check_shardable) ------------------------------
def shardable_length(cfg: V3Config, length: int, shards: int) -> int:
    """The shortest sequence length >= ``length`` that splits into ``shards`` context-parallel shards: MLA
    attends to the gathered whole rows, so any equal split does (no window, halo or compression unit)."""
    return -(-length // shards) * shards


def check_shardable(cfg: V3Config, seq_len: int, shards: int) -> None:
    """ValueError unless ``seq_len`` splits into ``shards`` equal shards; the message names lengths that work."""
    if seq_len % shards:
        near = sorted({max(shards, seq_len // shards * shards), shardable_length(cfg, seq_len, shards)})
        raise ValueError(f"a sequence of {seq_len} tokens does not split into cp = {shards} equal shards: seq_len "
                         f"must be a multiple of {shards}; {' or '.join(map(str, near))} would work")


# ---- presets -------------------------------------------------------------------------------------
def deepseek_v3() -> V3Config:
    """DeepSeek-V3 (and R1, V3-0324, V3.1: the same shapes): 671B parameters, 37B active."""
    return V3Config()


def deepseek_v32() -> V3Config:
    """DeepSeek-V3.2: V3.1's shapes plus DeepSeek Sparse Attention's indexer (64 heads x 128, top 2048)."""
    return V3Config(index_n_heads=64, index_head_dim=128, index_topk=2048, model_type=V32)


def kimi_k2() -> V3Config:
    """Moonshot's Kimi-K2 (-Instruct, -Base): 384 experts, 64 heads, one dense layer, no group limit,
    theta 5e4 with YaRN x32 over 4096 (beta 1/1), no MTP."""
    return V3Config(vocab_size=163840, num_attention_heads=64, n_routed_experts=384, n_group=1, topk_group=1,
                    routed_scaling_factor=2.827, first_k_dense_replace=1, num_nextn_predict_layers=0,
                    rope_theta=50000.0, rope_scaling=YarnMScale(factor=32.0, original_max_position_embeddings=4096,
                                                                beta_fast=1.0, beta_slow=1.0),
                    max_position_embeddings=131072, bos_token_id=163584, eos_token_id=163585, model_type=KIMI_K2)


def moonlight() -> V3Config:
    """Moonshot's Moonlight-16B-A3B: queries by one projection (q_lora_rank 0), 64 experts (6 active, 2
    shared), 27 layers, eps 1e-5, theta 5e4 without YaRN, no MTP, bf16 weights."""
    return V3Config(vocab_size=163840, hidden_size=2048, intermediate_size=11264, moe_intermediate_size=1408,
                    num_hidden_layers=27, num_attention_heads=16, q_lora_rank=0, n_routed_experts=64,
                    n_shared_experts=2, num_experts_per_tok=6, n_group=1, topk_group=1, routed_scaling_factor=2.446,
                    first_k_dense_replace=1, num_nextn_predict_layers=0, rms_norm_eps=1e-5, rope_theta=50000.0,
                    rope_scaling=None, max_position_embeddings=8192, bos_token_id=None, eos_token_id=163586)


def tiny_v3(**overrides) -> V3Config:
    """DeepSeek-V3 at toy sizes with every feature: the query latent, group-limited routing (4 groups of 2,
    top 2 groups), a dense first layer, MTP, YaRN with mscale (factor 4 over 64 positions)."""
    base = dict(vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
                num_attention_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                v_head_dim=16, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=4, topk_group=2,
                routed_scaling_factor=2.5, first_k_dense_replace=1, num_nextn_predict_layers=1,
                rope_scaling=YarnMScale(factor=4.0, original_max_position_embeddings=64), max_position_embeddings=256)
    base.update(overrides)
    return V3Config(**base)


def tiny_moonlight(**overrides) -> V3Config:
    """Moonlight at toy sizes: no query latent, two shared experts, no group limit, eps 1e-5, no YaRN, no MTP."""
    base = dict(vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=24, num_hidden_layers=3,
                num_attention_heads=4, q_lora_rank=0, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                v_head_dim=16, n_routed_experts=8, n_shared_experts=2, num_experts_per_tok=3, n_group=1, topk_group=1,
                routed_scaling_factor=2.446, first_k_dense_replace=1, num_nextn_predict_layers=0, rms_norm_eps=1e-5,
                rope_theta=50000.0, rope_scaling=None, max_position_embeddings=4096)
    base.update(overrides)
    return V3Config(**base)


def tiny_v32(**overrides) -> V3Config:
    """DeepSeek-V3.2 at toy sizes: tiny-v3 (a dense layer then MoE layers, 4 expert groups, MTP, YaRN) plus
    the indexer (8 heads of 16 over the 8 rope dims) keeping 8 keys per query, fewer than a test's
    sequence: the attention is really sparse."""
    base = dict(index_n_heads=8, index_head_dim=16, index_topk=8, model_type=V32)
    base.update(overrides)
    return tiny_v3(**base)


V3_PRESETS = {"deepseek-v3": deepseek_v3, "deepseek-v3.2": deepseek_v32, "kimi-k2": kimi_k2, "moonlight": moonlight,
              "tiny-v3": tiny_v3, "tiny-v3.2": tiny_v32, "tiny-moonlight": tiny_moonlight}


def get_preset(name: str) -> V3Config:
    """A DeepSeek-V3 family preset's config (V3_PRESETS); every architecture's: trex.models.registry.get_preset."""
    return lookup_preset(V3_PRESETS, name)
