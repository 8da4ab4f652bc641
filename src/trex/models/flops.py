"""Model FLOPs per token for DeepSeek-V4, V4.1 and the DeepSeek-V3 family, the numerator of MFU (docs/mfu.md).

Counts the useful work of the architecture, not of a particular kernel: masked or padded
entries that an implementation computes and throws away are not counted. A multiply-add is
2 FLOPs; training counts each trained matmul three times (forward, input gradient, weight
gradient). The indexer has no gradient, so it counts once.

Attention keys per query are averaged over the positions t = 0..S-1 of a sequence (or document)
of length S: min(t+1, W) window keys; HCA sees floor((t+1)/m) compressed entries; CSA sees the
indexer's top-k of its floor((t+1)/4) entries.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from trex.models.deepseek_v4.config import CSA, HCA, SLIDING, ModelConfig
from trex.models.deepseek_v4.config_v41 import V41Config


@dataclass(frozen=True)
class FlopsPerToken:
    """FLOPs per token, by part (all already multiplied by 3 for trained parts when training)."""

    dense_matmuls: float  # attention projections, mHC, compressors, router, shared expert
    routed_experts: float  # k routed experts
    attention_core: float  # q.k and p.v over window and compressed entries
    indexer: float  # lightning indexer projections and scores (forward only)
    head: float  # LM head(s)
    mtp: float  # MTP block(s), excluding their LM head

    @property
    def total(self) -> float:
        return sum(getattr(self, f.name) for f in fields(self))


def _mean_window_keys(S: int, W: int) -> float:
    # sum_{t<S} min(t+1, W) / S
    if S <= W:
        return (S + 1) / 2
    return (W * (W + 1) / 2 + (S - W) * W) / S


def _floor_sum(n: int, m: int) -> int:
    """sum_{u=1..n} floor(u / m), in closed form: m q (q - 1) / 2 + q (r + 1) for n = q m + r."""
    q, r = divmod(n, m)
    return m * q * (q - 1) // 2 + q * (r + 1)


def _mean_closed_windows(S: int, m: int) -> float:
    # sum_{t<S} floor((t+1)/m) / S
    return _floor_sum(S, m) / S if S < 1 << 16 else (S + 1) / (2 * m)


def _mean_topk(S: int, m: int, k: int) -> float:
    # sum_{t<S} min(k, floor((t+1)/m)) / S: floor(u/m) below u = k m, then k
    if S >= 1 << 16:
        return float(k)  # nearly every query has more than k entries
    below = min(S, k * m - 1)
    return (_floor_sum(below, m) + k * (S - below)) / S


def _layer(cfg: ModelConfig, layer_type: str, S: int) -> tuple[float, float, float, float]:
    """(dense matmul MACs, routed MACs, attention-core MACs, indexer MACs) per token, forward."""
    d, H, c, n = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.hc_mult
    dense = 2 * (2 + n) * n * n * d  # mHC projections at the attention and FFN sites
    dense += d * cfg.q_lora_rank + cfg.q_lora_rank * H * c + d * c  # wq_a, wq_b, wkv
    dense += H * c * cfg.o_lora_rank + cfg.o_groups * cfg.o_lora_rank * d  # wo_a (grouped), wo_b
    dense += cfg.n_routed_experts * d + 3 * cfg.moe_intermediate_size * d * cfg.n_shared_experts
    routed = 3 * cfg.moe_intermediate_size * d * cfg.num_experts_per_tok
    keys = _mean_window_keys(S, cfg.sliding_window)
    indexer = 0.0
    if layer_type != SLIDING:
        m = cfg.compress_rate(layer_type)
        coff = 2 if layer_type == CSA else 1
        dense += 2 * coff * c * d  # compressor wkv, wgate
        if layer_type == HCA:
            keys += _mean_closed_windows(S, m)
        else:
            keys += _mean_topk(S, m, cfg.index_topk)
            hi, ci = cfg.index_n_heads, cfg.index_head_dim
            indexer = cfg.q_lora_rank * hi * ci + d * hi + 2 * 2 * ci * d  # wq_b, weights_proj, compressor
            indexer += hi * ci * _mean_closed_windows(S, m)  # scores against every visible entry
    attention = 2 * H * c * keys  # q.k and p.v
    return dense, routed, attention, indexer


def _layer_v41(cfg: V41Config, layer: int, S: int) -> tuple[float, float, float, float]:
    """``_layer`` for DeepSeek-V4.1's layer ``layer``: no q head norm; the compressor only on KV sources
    (two projections at ratio > 1, one at ratio 1), the indexer only on index sources (its keys' ``wk``
    on KV sources), every compressed layer attends to the top-k picks; Engram's ``wkv`` where it is."""
    d, H, c, n = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.hc_mult
    dense = 2 * (2 + n) * n * n * d
    dense += d * cfg.q_lora_rank + cfg.q_lora_rank * H * c + d * c
    dense += H * c * cfg.o_lora_rank + cfg.o_groups * cfg.o_lora_rank * d
    dense += cfg.n_routed_experts * d + 3 * cfg.moe_intermediate_size * d * cfg.n_shared_experts
    if layer in cfg.engram_layer_ids:
        dense += (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads * cfg.engram_head_dim * d * (n + 1)
    routed = 3 * cfg.moe_intermediate_size * d * cfg.num_experts_per_tok
    keys = _mean_window_keys(S, cfg.sliding_window)
    indexer = 0.0
    m = cfg.compress_ratios[layer]
    if m:
        keys += _mean_topk(S, m, cfg.index_topk)
        if layer in cfg.kv_source_layer_ids:
            dense += (2 if m > 1 else 1) * c * d
        if layer in cfg.index_source_layer_ids:
            hi, ci = cfg.index_n_heads, cfg.index_head_dim
            indexer = cfg.q_lora_rank * hi * ci + d * hi + (c * ci if layer in cfg.kv_source_layer_ids else 0)
            indexer += hi * ci * _mean_closed_windows(S, m)
    return dense, routed, 2 * H * c * keys, indexer


def _layer_v3(cfg, moe: bool, S: int) -> tuple[float, float, float, float]:
    """``_layer`` for a DeepSeek-V3 family block (trex.models.deepseek_v3): MLA in its MHA form (the query
    latent ``wq_a`` + ``wq_b``, or Moonlight's one ``wq``; ``wkv_a`` to [latent | k_pe]; ``wkv_b`` to per
    head [k_nope | v]; ``wo``), causal attention over (S + 1) / 2 keys on average (q.k over qk_head_dim,
    p.v over v_head_dim), then a dense SwiGLU MLP or the MoE (router, shared experts, k routed experts).
    V3.2 (``index_topk`` > 0) counts its lightning indexer from the config (wq_b from the query latent, wk,
    weights_proj, and index_n_heads x index_head_dim scores over the causal keys: forward only, no gradient)
    and attention over each query's min(t + 1, index_topk) picks: the sparse training stage (the dense
    warm-up attends to every key and trains the indexer, which this does not count)."""
    d, H = cfg.hidden_size, cfg.num_attention_heads
    qk, dv = cfg.qk_head_dim, cfg.v_head_dim
    q = d * cfg.q_lora_rank + cfg.q_lora_rank * H * qk if cfg.q_lora_rank else d * H * qk
    dense = q + d * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) + cfg.kv_lora_rank * H * (cfg.qk_nope_head_dim + dv)
    dense += H * dv * d
    routed = 0.0
    if moe:
        dense += cfg.n_routed_experts * d + 3 * cfg.moe_intermediate_size * d * cfg.n_shared_experts
        routed = 3 * cfg.moe_intermediate_size * d * cfg.num_experts_per_tok
    else:
        dense += 3 * cfg.intermediate_size * d
    keys = _mean_window_keys(S, S)  # causal: (S + 1) / 2
    indexer = 0.0
    if cfg.index_topk:
        h, dh = cfg.index_n_heads, cfg.index_head_dim
        indexer = cfg.q_lora_rank * h * dh + d * dh + d * h + h * dh * keys
        keys = _mean_window_keys(S, cfg.index_topk)  # each query attends to its top-k (all while t < k)
    return dense, routed, H * (qk + dv) * keys, indexer


def _flops_v3(cfg, seq_len: int, mult: int, with_mtp: bool) -> FlopsPerToken:
    dense = routed = attention = indexer = 0.0
    for i in range(cfg.num_hidden_layers):
        a, b, c_, i_ = _layer_v3(cfg, i >= cfg.first_k_dense_replace, seq_len)
        dense, routed, attention, indexer = dense + a, routed + b, attention + c_, indexer + i_
    d = cfg.hidden_size
    head = cfg.vocab_size * d
    mtp = 0.0
    if with_mtp:
        for _ in range(cfg.num_nextn_predict_layers):
            a, b, c_, i_ = _layer_v3(cfg, True, seq_len)
            mtp += a + b + c_ + 2 * d * d  # its MoE block and eh_proj
            indexer += i_
            head += cfg.vocab_size * d  # the shared head, once more
    return FlopsPerToken(dense_matmuls=2 * mult * dense, routed_experts=2 * mult * routed,
                         attention_core=2 * mult * attention, indexer=2 * indexer, head=2 * mult * head, mtp=2 * mult * mtp)


def flops_per_token(cfg: ModelConfig | V41Config, seq_len: int, training: bool = True,
                    with_mtp: bool = True) -> FlopsPerToken:
    """Model FLOPs per token for sequences (or packed documents) of ``seq_len`` tokens. V4.1's ``mtp.*``
    (the DSpark drafter, carried through untrained) count nothing. A DeepSeek-V3 family config
    (``architecture`` "deepseek_v3") counts by ``_layer_v3``."""
    mult = 3 if training else 1
    if getattr(cfg, "architecture", None) == "deepseek_v3":
        return _flops_v3(cfg, seq_len, mult, with_mtp)
    dense = routed = attention = indexer = 0.0
    v41 = isinstance(cfg, V41Config)
    parts = (_layer_v41(cfg, i, seq_len) if v41 else _layer(cfg, t, seq_len) for i, t in enumerate(cfg.layer_types))
    for a, b, c_, i in parts:
        dense, routed, attention, indexer = dense + a, routed + b, attention + c_, indexer + i
    d, n = cfg.hidden_size, cfg.hc_mult
    dense += 0 if v41 else n * n * d  # final HC head (V4.1 collapses with the last pre: no matmul)
    with_mtp = with_mtp and not v41
    head = cfg.vocab_size * d
    mtp = mtp_head = 0.0
    if with_mtp:
        for _ in range(cfg.num_nextn_predict_layers):
            a, b, c_, i = _layer(cfg, cfg.mtp_layer_type, seq_len)
            mtp += a + b + c_ + i + 2 * d * d + n * n * d  # block, e_proj/h_proj, its HC head
            mtp_head += cfg.vocab_size * d
    return FlopsPerToken(
        dense_matmuls=2 * mult * dense,
        routed_experts=2 * mult * routed,
        attention_core=2 * mult * attention,
        indexer=2 * indexer,
        head=2 * mult * (head + mtp_head),
        mtp=2 * mult * mtp,
    )
