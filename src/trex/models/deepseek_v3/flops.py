"""Model FLOPs per token of the DeepSeek-V3 family (``Architecture.flops``; the conventions:
trex.models.common.flops)."""

from __future__ import annotations

from trex.models.common.flops import FlopsPerToken, mean_window_keys
from trex.models.deepseek_v3.config import V3Config


def _layer_v3(cfg: V3Config, moe: bool, S: int) -> tuple[float, float, float, float]:
    """``_layer`` for a DeepSeek-V3 family block: MLA in its MHA form (the query
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
    keys = mean_window_keys(S, S)  # causal: (S + 1) / 2
    indexer = 0.0
    if cfg.index_topk:
        h, dh = cfg.index_n_heads, cfg.index_head_dim
        indexer = cfg.q_lora_rank * h * dh + d * dh + d * h + h * dh * keys
        keys = mean_window_keys(S, cfg.index_topk)  # each query attends to its top-k (all while t < k)
    return dense, routed, H * (qk + dv) * keys, indexer


def flops_v3(cfg: V3Config, seq_len: int, training: bool = True, with_mtp: bool = True) -> FlopsPerToken:
    """Model FLOPs per token of a DeepSeek-V3 family model for sequences (or packed documents) of ``seq_len``
    tokens; its MTP modules (each a MoE block and ``eh_proj``, and the shared head once more) with ``with_mtp``."""
    mult = 3 if training else 1
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
