"""The planner's memory and time terms of the DeepSeek-V3 family (the functions trex.models.common.plan_terms
lists; trex.plan sums them).

MLA in its MHA form over a plain residual stream at the compute dtype (no mHC), a dense SwiGLU MLP in
the first first_k_dense_replace layers and the MoE (sigmoid router, group-limited top-k) after, an MTP
block fed eh_proj([enorm(next embedding), hnorm(h)]). The attention core is counted as the kernel
registry's reference for ``dense_attention`` (plain PyTorch over [B, H, S, S] scores), which saves the
fp32 probabilities (and their compute-dtype cast) and the [S, S] document-causal mask: quadratic in S,
per layer. The fused default (SDPA) keeps a logsumexp instead of the probabilities, so this is an upper
bound on what a run saves; modelling the fused path exactly is left to do (docs/planning.md). Under context
parallelism (cp > 1) the dense core is ``latent_attention``'s, counted as it saves (no [S, S] terms; checked
against autograd on tiny-v3 as rank 1 of 2, tests/test_plan_v3.py).
V3.2's attention is its sparse MLA as trex's gathered kernel saves it (the absorbed form, the top-k picks;
nothing [S, S]; equal to autograd on tiny-v3.2, tests/test_plan_activations.py). Layer kinds: "mla/dense",
"mla/moe" and "mla/mtp" (an MTP block's extra norms and eh_proj input). Checked against autograd on
tiny-v3 (tests/test_plan_activations.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from trex.kernels import latent_attention, sparse_mla
from trex.models.common.flops import mean_window_keys
from trex.models.common.plan_terms import F32, I64, LayerActivations, SplitBlock, rms_norm, tp_ring_elements
from trex.models.deepseek_v3.config import V3, V3Config

# layer kinds
V3_DENSE, V3_MOE, V3_MTP = "mla/dense", "mla/moe", "mla/mtp"


def attention(cfg: V3Config, S: int, b: int, cp: int = 1, tp: int = 1, rows: int = 1) -> float:
    """One sequence of S tokens through attn_norm and MLA, on one of ``cp`` context-parallel ranks (its s = S / cp
    rows). At cp > 1 the dense MLA runs the kernel op ``latent_attention`` (trex.kernels.latent_attention: keys
    and values expanded a chunk at a time and again in backward): it keeps the gathered [S, kv_lora_rank +
    qk_rope_head_dim] latent and k_pe and the rows' document ids, and of its own rows q, the output (wo's input
    is a view of it) and the fp32 log-sum-exp per head, nothing quadratic. V3.2 (any cp) runs its sparse MLA in
    the absorbed form, the op ``sparse_mla``'s gathered kernel (trex.kernels.sparse_mla; trex.models.deepseek_v3.dsa):
    of its own rows the rotated q, the absorbed q, the latent output, a log-sum-exp, wo's input and the top-k
    picks; the whole rows' [latent | k_pe]; nothing quadratic (checked against autograd on tiny-v3.2,
    tests/test_plan_activations.py). The kernel's mask form, which it takes only when the picks are a quarter
    of the keys and its [s, H, S] scores fit 64 MiB (tiny cases), is not modelled.
    Under tensor parallelism (``tp``, trex.models.deepseek_v3.tp_plan) a rank keeps its H / tp heads' terms, and
    under sequence parallelism 1 / ``rows`` of the rows' attn_norm; the all-gathered norm output, the down
    projections' latents and their norms (replicated: every TP rank computes them on every row) whole."""
    d, H, q, kv, rd = cfg.hidden_size, cfg.num_attention_heads // tp, cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    qk, nope, dv = cfg.qk_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim
    s = S // cp
    per_tok = rms_norm(d) / rows + b * d  # attn_norm (sequence parallel); wq_a / wkv_a input (one tensor)
    if q:
        per_tok += rms_norm(q) + b * q  # q_norm, wq_b input
    per_tok += 2 * F32 * rd  # RoPE of q and k_pe: each keeps its complex rotation [rd/2]
    # kv_norm: its fp32 input (at fp32 the split view keeps wkv_a's whole [latent | k_pe] output), rstd,
    # normalised latent
    per_tok += F32 * (kv + rd if b == F32 else kv) + F32 * (kv + 1)
    if cfg.index_topk:  # V3.2: the gathered sparse MLA in the absorbed form (kernels.sparse_mla, the default)
        k = min(cfg.index_topk, S)
        # the rotated q (the absorption's input), q_abs, the latent output (the value lift's input too), the
        # fp32 logsumexp, wo's input; the picks and their valid mask
        per_q = b * H * qk + b * H * (kv + rd) + b * H * kv + F32 * H + b * H * dv + (I64 + 1) * k
        return (per_tok + per_q) * s + b * (kv + rd) * S  # the whole rows' [latent | k_pe]
    if cp > 1:  # latent_attention: q, the output, the log-sum-exp; the gathered latent,
        return (per_tok + b * H * (qk + dv) + F32 * H) * s + (b * (kv + rd) + I64) * S  # the rows' document ids
    per_tok += F32 * H * qk  # q as the fp32 operand of the scores (scores_fp32)
    per_tok += b * H * dv  # wo input
    # per key row: wkv_b's input (at cp > 1 a view of the gathered [latent | k_pe]); k as the fp32 operand of the
    # scores; v, a view of wkv_b's output, which it keeps whole
    per_key = b * (kv if cp == 1 else kv + rd) + F32 * H * qk + b * H * (nope + dv)
    per_seq = s * S * (1 + H * (F32 + (b if b != F32 else 0)))  # mask; fp32 probabilities and their cast
    return per_tok * s + per_key * S + per_seq


def ffn(cfg: V3Config, moe_layer: bool, b: int, tp: int = 1, rows: int = 1) -> float:
    """Per token, ffn_norm and the dense SwiGLU MLP or the MoE (router, k routed experts, shared experts).
    Under tensor parallelism (``tp``): ffn_norm over 1 / ``rows`` of the rows (sequence parallel), its all-gathered
    output and the router's terms whole (every TP rank routes every row), the dense MLP's and shared experts' widths
    / tp, the routed copies of 1 / tp of the rows (each TP rank dispatches its share: torchtitan's
    ReordererSequenceParallel)."""
    d = cfg.hidden_size
    per = rms_norm(d) / rows + b * d  # ffn_norm; the FFN's input
    if not moe_layer:
        return per + (3 * F32 + b) * cfg.intermediate_size / tp  # gate, up, silu(gate) in fp32; w2 input
    E, k, inter, g = cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.n_group
    per += F32 * E  # sigmoid scores
    if g > 1:  # group limit: each group's top-2 index, the groups' top-k index, the kept-group mask
        per += I64 * 2 * g + I64 * cfg.topk_group + g
    per += I64 * k + F32 * (k + 1)  # top-k index; gathered weights and their sum
    per += F32  # balance loss: score sums
    routed = 2 * I64 * k + b * d * k  # sort order and token index of the k copies; permuted inputs
    routed += ((4 * F32 + b) * inter + F32) * k  # gate, up, silu, h (fp32), w2 input; row weight
    routed += F32 * d * k  # expert outputs as the fp32 copies the combine sums
    per += routed / tp
    per += (3 * F32 + b) * inter * cfg.n_shared_experts / tp
    return per


def block(cfg: V3Config, kind: str, mlp_type: str, S: int, b: int, cp: int = 1, tp: int = 1,
          rows: int = 1) -> LayerActivations:
    """One block's saved bytes for one sequence on one of ``cp`` context-parallel and ``tp`` tensor-parallel ranks
    (the FFN follows the kind: ``mlp_type`` is main_blocks'), the rows of the residual stream split over ``rows``
    of them (sequence parallelism)."""
    moe_layer = kind != V3_DENSE
    s = S // cp
    per_seq = (4 * cfg.n_routed_experts + 2 * F32 * cfg.n_routed_experts) if moe_layer else 0  # offsets; balance
    d = cfg.hidden_size
    # enorm, hnorm (at fp32 its input is the previous head's input, saved already), eh_proj input [2d]; the
    # module's final norm
    # (under sequence parallelism all over 1 / rows of the rows)
    mtp = ((3 * rms_norm(d) - (F32 * d if b == F32 else 0)) + 2 * b * d) / rows * s if kind == V3_MTP else 0.0
    return LayerActivations(mhc=0.0, attention=attention(cfg, S, b, cp, tp, rows) + mtp,
                            moe=ffn(cfg, moe_layer, b, tp, rows) * s + per_seq)


def weight_copies(cfg: V3Config, kind: str, b: int) -> float:
    """fp32 copies of the RMSNorm weights one block keeps at bf16 (0 at fp32)."""
    if b == F32:
        return 0.0
    d = cfg.hidden_size
    return F32 * (2 * d + cfg.q_lora_rank + cfg.kv_lora_rank + (3 * d if kind == V3_MTP else 0))


def model_level(cfg: V3Config, S: int, b: int, heads: bool = True, tp: int = 1, rows: int = 1) -> float:
    """Per-sequence bytes outside the blocks: token ids, the final norm, each head's input and loss terms. Under
    tensor parallelism the final norm over 1 / ``rows`` of the rows (sequence parallel), the vocabulary-parallel
    heads' all-gathered inputs and the loss terms of every row whole."""
    heads_n = 1 + cfg.num_nextn_predict_layers
    total = I64 * heads_n * S  # ids for the embeddings (main and each MTP module's tokens ahead)
    if heads:
        d = cfg.hidden_size
        # the final norm; each head's input, log-sum-exp and target
        total += (rms_norm(d) / rows + heads_n * (b * d + F32 + I64 + 1)) * S + 8 * heads_n
        total += F32 * d if b != F32 else 0.0
    return total


def backward_workspace(cfg: V3Config, kind: str, S: int, b: int, cp: int = 1, tp: int = 1,
                       rows: int = 1) -> float:
    """Transient bytes while one V3 block runs backward on one of ``cp`` ranks: the gradients of its output and
    input streams (its s = S / cp rows), and the attention core's: [H, s, S] gradients (of the probabilities
    at the compute dtype, of the fp32 scores through softmax and the mask); at cp > 1 for the dense MLA
    ``latent_attention``'s fp32 dq, the gathered latent's and k_pe's fp32 gradients and three fp32
    [H, tile, chunk] tiles (the scores turned probabilities in place, a matmul's output, dP turned dS); for
    V3.2's gathered sparse MLA its dq, the fp32 gradient of the whole rows' [latent | k_pe] it scatter-adds into
    and one query chunk's transients (at most sparse_mla.CHUNK_BYTES). Under tensor parallelism: the streams
    of 1 / ``rows`` of the rows (sequence parallelism), H / tp heads. An estimate, not measured."""
    H, s = cfg.num_attention_heads // tp, S // cp
    streams = 2 * b * cfg.hidden_size * s / rows
    if cfg.index_topk:
        c, k = cfg.kv_lora_rank + cfg.qk_rope_head_dim, min(cfg.index_topk, S)
        chunk = min(sparse_mla.CHUNK_BYTES, s * k * (c * (b + 8) + 16 * H))
        return streams + b * s * H * c + F32 * (S * c + s * H) + chunk
    if cp > 1:
        tile = min(latent_attention.TILE, s) * min(latent_attention.CHUNK, S)
        return streams + F32 * (H * cfg.qk_head_dim * s + (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * S + 3 * H * tile)
    return streams + (2 * F32 + b) * H * s * S


def main_blocks(cfg: V3Config) -> list[tuple[str, str]]:
    """(layer kind, FFN type) of each main layer: the first first_k_dense_replace dense, MoE after."""
    kinds = [V3_DENSE if i < cfg.first_k_dense_replace else V3_MOE for i in range(cfg.num_hidden_layers)]
    return [(k, "dense" if k == V3_DENSE else "moe") for k in kinds]


def mtp_blocks(cfg: V3Config) -> int:
    """MTP blocks the model trains."""
    return cfg.num_nextn_predict_layers


def mtp_kind(cfg: V3Config) -> str:
    """The layer kind of an MTP block."""
    return V3_MTP


def stream_bytes(cfg: V3Config, b: int, rows: int = 1) -> float:
    """Per token, a block's input: all a checkpointed block keeps (one stream at the compute dtype; under tensor
    parallelism a rank keeps its 1 / ``rows`` of the rows)."""
    return b * cfg.hidden_size / rows


# ---- time, facts, notes ------------------------------------------------------------------------------------

def moe_layers(cfg: V3Config, layers: int) -> int:
    """MoE layers among ``layers`` main layers (the first first_k_dense_replace are dense; a pipeline stage is
    charged as the busiest, all MoE)."""
    return min(layers, cfg.num_hidden_layers - cfg.first_k_dense_replace)


def dense_ffn_flops(cfg: V3Config) -> int:
    """Forward FLOPs per token of the first first_k_dense_replace layers' dense SwiGLU MLPs (w1, w3, w2)."""
    return 2 * cfg.first_k_dense_replace * 3 * cfg.intermediate_size * cfg.hidden_size


def busiest_shard_flops(cfg: V3Config, seq_len: int, cp: int, total: Callable[[int], float]) -> float:
    """Training FLOPs per token of one of ``cp`` shards: they do equal work (the dense document-causal mask skips
    nothing), the mean per token, plus the ``wkv_b`` expansion of the other ranks' rows (:func:`cp_extra_flops`)."""
    return total(seq_len) + cp_extra_flops(cfg, cp)


def cp_extra_flops(cfg: V3Config, cp: int) -> float:
    """Training FLOPs per token a V3-family rank runs at cp > 1 beyond one process's: each rank expands the
    gathered latent of all S = cp x s rows through ``wkv_b`` (2 x kv_lora_rank x H x (nope + v) a row) in
    forward, again in ``latent_attention``'s backward, and back-propagates it (dX and dW, twice that): 4 x cp
    expansions per own row against one process's 3, in every layer and MTP block. V3.2's sparse MLA runs in the
    absorbed form (trex.kernels.sparse_mla: q and the output go through ``wkv_b``'s rows, per own row) and expands
    no row's keys: nothing more. A recomputed forward's expansion of the other ranks' rows is not counted (1 x
    cp - 1 more per row and layer under recomputation)."""
    if cfg.index_topk:
        return 0.0
    per_row = 2 * cfg.kv_lora_rank * cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim)
    runs = 4 * cp - 3
    return runs * per_row * (cfg.num_hidden_layers + cfg.num_nextn_predict_layers)


def kernel_extra_flops(cfg: V3Config, seq_len: int) -> float:
    """Training FLOPs per token V3.2's attention kernel runs beyond the model FLOPs (trex.models.flops counts MLA
    in its MHA form: q.k over qk_head_dim and p.v over v_head_dim, H heads, each query's min(t + 1, index_topk)
    picks). trex's sparse MLA (trex.kernels.sparse_mla) runs the absorbed (MQA) form: per head q.kv over the
    kv_lora_rank + qk_rope_head_dim latent and p.kv over its kv_lora_rank values, for all min(index_topk, S)
    picks of every query (the invalid ones masked), forward once and backward twice (torchtitan-npu's
    ``npu_sparse_flash_attention`` runs the same form, attention_mode 2, MLA-absorb). The absorption through
    ``wkv_b`` (per query) replaces the MHA form's expansion (per key) at equal FLOPs. 0 for a dense V3."""
    if not cfg.index_topk:
        return 0.0
    H, kv, rd = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    executed = min(cfg.index_topk, seq_len) * (2 * kv + rd)
    counted = mean_window_keys(seq_len, cfg.index_topk) * (cfg.qk_head_dim + cfg.v_head_dim)
    return 3 * 2 * H * (executed - counted) * (cfg.num_hidden_layers + cfg.num_nextn_predict_layers)


def indexer_training_flops(cfg: V3Config, seq_len: int) -> tuple[float, float]:
    """Training FLOPs per token DeepSeek-V3.2's lightning indexer adds when it trains (``[train] indexer_loss`` > 0,
    the sparse stage: trex.models.deepseek_v3.dsa ``Indexer.align``), every main layer and MTP block, as (split by
    TP's heads, whole on every TP rank). Per layer and token, over k = min(index_topk, S) picks (all of them
    computed, the invalid masked):
      the KL's target, the main attention's absorbed scores over the picks (H heads x (kv_lora_rank +
        qk_rope_head_dim)), computed inside each checkpointed query chunk: in the forward and again in its
        backward; TP splits it by heads (each rank its heads, the mean over all of them all-reduced);
      the index scores over the picks (index_n_heads x index_head_dim, then weighed over the heads): the forward,
        the checkpoint's recompute and the backward's two products, whole;
      the projections (wq_b, wk, weights_proj) run again with a gradient, and their weight gradients (the inputs
        are detached: no input gradient), whole.
    The align runs in the recording forward only, so a recompute of the block adds nothing. 0 for a dense V3."""
    if not cfg.index_topk:
        return 0.0, 0.0
    k, hi, ci = min(cfg.index_topk, seq_len), cfg.index_n_heads, cfg.index_head_dim
    projections = cfg.q_lora_rank * hi * ci + cfg.hidden_size * (hi + ci)
    layers = cfg.num_hidden_layers + cfg.num_nextn_predict_layers
    target = 2 * cfg.num_attention_heads * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * k
    return 2.0 * layers * target, 2.0 * layers * (4 * hi * (ci + 1) * k + 2 * projections)


def cp_traffic(cfg: V3Config, seq_len: int, b: int) -> tuple[float, float]:
    """Context-parallel bytes per sequence row and pass, for one rank: no halo; every MLA layer (MTP blocks too)
    all-gathers every row's [latent | k_pe] forward and reduce-scatters its gradient backward, V3.2 its index
    keys too (forward only)."""
    layers = cfg.num_hidden_layers + cfg.num_nextn_predict_layers
    gathered = layers * seq_len * b * (2 * (cfg.kv_lora_rank + cfg.qk_rope_head_dim)
                                       + (cfg.index_head_dim if cfg.index_topk else 0))
    return 0.0, gathered


def tp_split(cfg: V3Config) -> dict[str, int]:
    """What tensor parallelism (Megatron's / torchtitan's plan) splits: the attention heads, the vocabulary
    (embedding and head), the dense FFN and shared-expert widths. V3.2's indexer is not split (counted_model)."""
    return {"attention heads": cfg.num_attention_heads, "vocabulary": cfg.vocab_size,
            "dense FFN width": cfg.intermediate_size,
            "shared-expert width": cfg.moe_intermediate_size * cfg.n_shared_experts}


def tp_traffic(cfg: V3Config, S: int, b: int, recompute: str, layers: int, cp: int = 1, sp: bool = True) -> float:
    """Ring-collective buffer bytes one TP rank takes part in for one sequence of ``S`` tokens on one of ``cp``
    context-parallel ranks (its S / cp rows) through ``layers`` main layers, the MTP blocks and the heads, as
    trex.parallel.tensor_parallel runs the V3 family's plan (``tp_ring_elements``, at the compute dtype). What
    enters the heads' region, its gradient summed in backward: ``wq_b``'s input [S, q_lora_rank] (Moonlight's
    ``wq``'s, [S, hidden]), the normed KV latent [S, kv_lora_rank] and the rotated k_pe [S, qk_rope_head_dim]; and
    the dense FFN's or the shared experts' input [S, hidden]. Under sequence parallelism each block's two norms
    compute on this rank's rows (their gradients summed), and outside the blocks the final norm and each MTP
    module's enorm, hnorm, eh_proj and norm. Each vocabulary-parallel loss (head_nll) sums three fp32 statistics
    per row forward and the fp32 hidden-state gradient backward."""
    d, mtp, s = cfg.hidden_size, cfg.num_nextn_predict_layers, S // cp
    attention = ((cfg.q_lora_rank or d) + cfg.kv_lora_rank + cfg.qk_rope_head_dim) * s
    shared = bool(cfg.n_shared_experts)
    blocks = [SplitBlock(dense or shared, attention + (d * s if dense or shared else 0), 2 * d)
              for dense in [i < cfg.first_k_dense_replace for i in range(layers)] + [False] * mtp]
    root = d + mtp * (2 * d * d + 3 * d)
    return b * tp_ring_elements(s, d, blocks, 1 + mtp, root, F32 / b * (3 + d), recompute, sp)


def table_reads(cfg: V3Config) -> int:
    return 0  # no row-split tables


def table_lookup_bytes(cfg: V3Config, trained: bool) -> int:
    return 0


def indexer_per_layer(cfg: V3Config) -> int:
    """Parameters of one DeepSeek-V3.2 indexer (0 for a dense V3 config)."""
    if not cfg.index_topk:
        return 0
    h, dh, d = cfg.index_n_heads, cfg.index_head_dim, cfg.hidden_size
    return cfg.q_lora_rank * h * dh + d * dh + 2 * dh + d * h


def counted_model(cfg: V3Config) -> tuple[V3Config, int, int]:
    """DeepSeek-V3.2's lightning indexer is counted from its config (per layer, MTP included: wq_b [q_lora_rank ->
    index_n_heads x index_head_dim], wk [hidden -> index_head_dim], k_norm's LayerNorm weight and bias,
    weights_proj [hidden -> index_n_heads], as DeepSeek's inference code and trex's V3.2 model build it) on top
    of the dense V3 model; it is frozen, as V4's indexer in post-training. Under TP all of it is whole on every
    rank, which runs it on the group's every row: trex.models.deepseek_v3.tp_plan replicates it (its top-k needs
    the score summed over all its heads), as torchtitan-npu's V3.2 plan does (``NoParallel`` on its wq_b, wk,
    k_norm and weights_proj)."""
    indexer = indexer_per_layer(cfg)
    if not indexer:
        return cfg, 0, 0
    return dataclasses.replace(cfg, index_n_heads=0, index_head_dim=0, index_topk=0, model_type=V3), indexer, indexer


def notes(cfg: V3Config, tp: int = 1) -> list[str]:
    out = []
    if tp > 1:
        out.append("tensor parallelism is planned as trex.parallel.tensor_parallel runs it: MLA by heads after its "
                   "replicated down projections, the dense FFN and shared experts by width; with sequence parallelism "
                   "unless the layout says sequence_parallel=false")
    if not cfg.index_topk:
        return out
    return out + ["DeepSeek-V3.2's indexer is planned from its config (its parameters and FLOPs, attention over its "
                  "top-k); its sparse MLA's activations as trex's gathered kernel saves them"]
