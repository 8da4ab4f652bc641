"""Model FLOPs per token of DeepSeek-V4 and V4.1 (``Architecture.flops``; the conventions: trex.models.common.flops).

HCA sees floor((t+1)/m) compressed entries; CSA (V4.1: every compressed layer) sees the indexer's top-k of
its floor((t+1)/m) entries.
"""

from __future__ import annotations

from trex.models.common.flops import FlopsPerToken, mean_closed_windows, mean_topk, mean_window_keys
from trex.models.deepseek_v4.config import CSA, HCA, SLIDING, ModelConfig
from trex.models.deepseek_v4.config_v41 import V41Config


def _layer(cfg: ModelConfig, layer_type: str, S: int) -> tuple[float, float, float, float]:
    """(dense matmul MACs, routed MACs, attention-core MACs, indexer MACs) per token, forward."""
    d, H, c, n = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.hc_mult
    dense = 2 * (2 + n) * n * n * d  # mHC projections at the attention and FFN sites
    dense += d * cfg.q_lora_rank + cfg.q_lora_rank * H * c + d * c  # wq_a, wq_b, wkv
    dense += H * c * cfg.o_lora_rank + cfg.o_groups * cfg.o_lora_rank * d  # wo_a (grouped), wo_b
    dense += cfg.n_routed_experts * d + 3 * cfg.moe_intermediate_size * d * cfg.n_shared_experts
    routed = 3 * cfg.moe_intermediate_size * d * cfg.num_experts_per_tok
    keys = mean_window_keys(S, cfg.sliding_window)
    indexer = 0.0
    if layer_type != SLIDING:
        m = cfg.compress_rate(layer_type)
        coff = 2 if layer_type == CSA else 1
        dense += 2 * coff * c * d  # compressor wkv, wgate
        if layer_type == HCA:
            keys += mean_closed_windows(S, m)
        else:
            keys += mean_topk(S, m, cfg.index_topk)
            hi, ci = cfg.index_n_heads, cfg.index_head_dim
            indexer = cfg.q_lora_rank * hi * ci + d * hi + 2 * 2 * ci * d  # wq_b, weights_proj, compressor
            indexer += hi * ci * mean_closed_windows(S, m)  # scores against every visible entry
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
    keys = mean_window_keys(S, cfg.sliding_window)
    indexer = 0.0
    m = cfg.compress_ratios[layer]
    if m:
        keys += mean_topk(S, m, cfg.index_topk)
        if layer in cfg.kv_source_layer_ids:
            dense += (2 if m > 1 else 1) * c * d
        if layer in cfg.index_source_layer_ids:
            hi, ci = cfg.index_n_heads, cfg.index_head_dim
            indexer = cfg.q_lora_rank * hi * ci + d * hi + (c * ci if layer in cfg.kv_source_layer_ids else 0)
            indexer += hi * ci * mean_closed_windows(S, m)
    return dense, routed, 2 * H * c * keys, indexer


def flops_v4(cfg: ModelConfig, seq_len: int, training: bool = True, with_mtp: bool = True) -> FlopsPerToken:
    """Model FLOPs per token of DeepSeek-V4 for sequences (or packed documents) of ``seq_len`` tokens."""
    return _count(cfg, [_layer(cfg, t, seq_len) for t in cfg.layer_types], seq_len, training, with_mtp)


def flops_v41(cfg: V41Config, seq_len: int, training: bool = True, with_mtp: bool = True) -> FlopsPerToken:
    """``flops_v4`` of DeepSeek-V4.1: its ``mtp.*`` (the DSpark drafter, carried through untrained) count nothing,
    and the final streams collapse with the last block's pre (no HC head matmul)."""
    return _count(cfg, [_layer_v41(cfg, i, seq_len) for i in range(cfg.num_hidden_layers)], seq_len, training, False)


def _count(cfg, layers: list, seq_len: int, training: bool, with_mtp: bool) -> FlopsPerToken:
    mult = 3 if training else 1
    dense = routed = attention = indexer = 0.0
    for a, b, c_, i in layers:
        dense, routed, attention, indexer = dense + a, routed + b, attention + c_, indexer + i
    d, n = cfg.hidden_size, cfg.hc_mult
    dense += 0 if isinstance(cfg, V41Config) else n * n * d  # final HC head
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
