"""The planner's memory and time terms of DeepSeek-V4 and V4.1 (the functions trex.models.common.plan_terms
lists; trex.plan sums them).

Activations: the bytes that autograd keeps for backward in one training forward of trex's DeepSeek-V4.

Derived from the real layer shapes *and* from what ``trex.models.deepseek_v4`` (with the
reference kernels) actually saves: every term below names the tensor and why it is kept.
``tests/test_plan_activations.py`` checks the sums against ``saved_tensors_hooks`` on a real
model (storage-deduplicated, parameters excluded) at fp32 and bf16.

Conventions, for one sequence (batch row) of S tokens without document boundaries:
  b   bytes of the compute dtype (2 for bf16, 4 for fp32);
  cp  bytes of an extra fp32 copy: a ``.float()`` of a compute-dtype tensor is a new tensor at
      bf16 (cp = 4) and the same tensor at fp32 (cp = 0);
  N   compressed entries floor(S / m); kc the compressed entries a query scores (CSA: the
      indexer's top-k, HCA: all N); K the window keys of a block of W/4 queries (W/4 + W).
Context parallelism over ``cp`` ranks (``cp`` arguments): S stays the whole sequence; a rank keeps the
per-token terms of its S / cp rows (its attention kernel also runs the W - 1 window-halo rows as
queries), the compressed entries of the whole sequence (gathered), and pools only its own windows.
Weights that trex casts to fp32 inside the forward (mHC fn, norms) are saved as fp32 copies at
bf16: per-layer constants, not per-token. The router, compressor and LM head go through
``linear_fp32``, which keeps weight and input as they are and re-casts in backward.

DeepSeek-V4.1 (``trex.models.deepseek_v4.model_v41``) is described with the same terms by layer *kind*
(:func:`layer_kinds`): its ratio, whether it computes compressed entries (a KV source: the
compressor, non-overlapping, no ``ape``) and whether Engram writes before it; every compressed layer
attends over the top-k picks of N = S / ratio entries; no per-head query norm; the single-pass mHC
collapse, no HC head. The V4.1 terms are an estimate checked against autograd to a stated bound
(tests/test_plan_activations.py), not term by term as V4's.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from trex.kernels.sparse_attention import CHUNK_BYTES, DENSE_TOPK_FRACTION
from trex.models.common.config import HASH_MOE
from trex.models.common.plan_terms import F32, I64, LayerActivations, SplitBlock, rms_norm, tp_ring_elements
from trex.models.deepseek_v4.config import CSA, SLIDING, ModelConfig, shard_halo
from trex.models.deepseek_v4.config_v41 import CSA2, V41Config


def layer_kinds(cfg: ModelConfig | V41Config) -> list[str]:
    """Each main layer's kind: V4's layer type; for V4.1 ``"csa2/<ratio>"`` (``"/kv"`` for a KV source)
    or the sliding type, with ``"+engram"`` where Engram writes before the block."""
    if not isinstance(cfg, V41Config):
        return list(cfg.layer_types)
    kinds = []
    for i, r in enumerate(cfg.layer_ratios):
        kind = f"{CSA2}/{r}" + ("/kv" if i in cfg.kv_source_layer_ids else "") if r else SLIDING
        kinds.append(kind + ("+engram" if i in cfg.engram_layer_ids else ""))
    return kinds


def layer_kind(cfg: ModelConfig | V41Config, kind: str) -> tuple[str, int, bool, bool]:
    """(layer type, compression ratio, computes its entries, Engram before it) of a layer kind."""
    base, engram = kind.removesuffix("+engram"), kind.endswith("+engram")
    if not base.startswith(CSA2):
        return base, cfg.compress_rate(base) if base != SLIDING else 0, base != SLIDING, engram
    parts = base.split("/")
    return CSA2, int(parts[1]), parts[-1] == "kv", engram


def mtp_blocks(cfg: ModelConfig | V41Config) -> int:
    """MTP blocks the model trains (V4.1's DSpark stages are carried through, not built)."""
    return 0 if isinstance(cfg, V41Config) else cfg.num_nextn_predict_layers


def main_blocks(cfg: ModelConfig | V41Config) -> list[tuple[str, str]]:
    """(layer kind, FFN type) of each main layer."""
    return list(zip(layer_kinds(cfg), cfg.mlp_layer_types))


def mtp_kind(cfg: ModelConfig | V41Config) -> str:
    """The layer kind of an MTP block."""
    return cfg.mtp_layer_type


def stream_bytes(cfg: ModelConfig | V41Config, b: int, rows: int = 1) -> float:
    """Per token, a block's input: all a checkpointed block keeps (the hc_mult streams; under sequence parallelism
    a rank keeps its 1 / ``rows`` of the rows)."""
    return b * cfg.hidden_size * cfg.hc_mult / rows


def mhc_site(cfg: ModelConfig, b: int) -> float:
    """Per token, one HyperConnection (pre/post/comb with Sinkhorn) around a sublayer, as the registry's default
    mixing runs it (trex.kernels.mhc's fused coefficients: the RMS factor scales the mixes, so no normalised copy
    of the streams is kept)."""
    n, d, it = cfg.hc_mult, cfg.hidden_size, cfg.hc_sinkhorn_iters
    cp = 0 if b == F32 else F32
    per = n * d + 1  # fp32 streams (fn's and the RMS factor's input); rstd
    per += 2 * (2 + n) * n  # the mixes before and after the RMS factor
    per += 4 * n  # two sigmoids, pre (+eps), post
    per += 3 * n * n  # softmax output, the last normalisation's output, comb (its copy, the stream mix's)
    per += (2 * it - 2) * n * n + (2 * it - 1) * n  # Sinkhorn: the other normalisations' outputs, denominators
    per += d  # sublayer output in fp32
    return F32 * per + 2 * cp * n * d  # at bf16 two more .float() copies of the streams


def compressed_seen(cfg: ModelConfig, layer_type: str, S: int) -> tuple[int, int, bool]:
    """(N entries, entries in each query's softmax, gathered top-k?) of a layer at S tokens. CSA whose
    top-k picks half or more of the entries runs dense with a mask (sparse_attention.DENSE_TOPK_FRACTION)."""
    lt, m, _, _ = layer_kind(cfg, layer_type)
    if lt == SLIDING:
        return 0, 0, False
    N = S // m
    k = min(cfg.index_topk, N)
    if lt in (CSA, CSA2) and k < DENSE_TOPK_FRACTION * N:
        return N, k, True
    return N, N, False


def _halo(cfg: ModelConfig, layer_type: str, cp: int) -> tuple[int, int]:
    """(window-halo query rows, extra input rows) of a context-parallel shard (0, 0 without CP)."""
    if cp == 1:
        return 0, 0
    return cfg.sliding_window - 1, sum(shard_halo(cfg, layer_kind(cfg, layer_type)[0]))


def attention(cfg: ModelConfig, layer_type: str, S: int, b: int, cp: int = 1, tp: int = 1) -> float:
    """One sequence of S tokens through attn_norm and Attention (compressor included), on one of ``cp``
    context-parallel and ``tp`` tensor-parallel ranks. Under TP (trex.models.deepseek_v4.tp_plan) a rank keeps
    the terms of its H / tp heads (the heads' norm, q, the probabilities, wo_a's input) and of its o_groups / tp
    output groups (wo_b's input); attn_norm, the query latent, the shared K = V head, the compressed entries,
    the indexer's picks and the RoPE rotations are replicated: whole on every rank."""
    d, H, c, q, W = cfg.hidden_size, cfg.num_attention_heads // tp, cfg.head_dim, cfg.q_lora_rank, cfg.sliding_window
    rd = cfg.qk_rope_head_dim
    K = max(1, W // 4) + W  # window keys per query block of W/4 (the probabilities keep all K)
    per_tok = rms_norm(d)  # attn_norm
    per_tok += b * d + rms_norm(q) + b * q  # wq_a input (shared with wkv), q_norm, wq_b input
    lt, _, computes_entries, engram = layer_kind(cfg, layer_type)
    if lt != CSA2:
        per_tok += F32 * (H * c + H)  # unweighted RMSNorm of the heads: fp32 input and rstd (not in V4.1)
    per_tok += rms_norm(c)  # kv_norm
    per_tok += 3 * F32 * rd  # RoPE of q, kv and the output: each keeps its complex rotation [rd/2]
    per_tok += b * H * c + b * cfg.o_groups // tp * cfg.o_lora_rank  # grouped wo_a input (permuted copy), wo_b input
    # sparse attention (kernels.sparse_attention, hand-written backward): q, kv and the probabilities
    per_tok += b * H * c + b * c
    per_seq = 0.0
    N, kc, gathered = compressed_seen(cfg, layer_type, S)
    if lt != SLIDING:
        per_seq += b * c * N if computes_entries else 0  # compressed entries (V4.1: the KV source's, shared)
        if gathered:
            per_tok += I64 * kc  # the indexer's top-k (entries are re-gathered in backward)
        per_seq += compressor(cfg, layer_type, S, b, cp) if computes_entries else 0
    per_tok += F32 * H * (K + kc + 1)  # softmax output over window, compressed entries and sink
    window, extra = _halo(cfg, layer_type, cp)
    if engram:  # Engram's lookup before the block, counted with the attention site it feeds
        per_seq += engram_lookup(cfg, b) * (S // cp)
    return per_tok * (S // cp + window) + b * d * extra + per_seq


def engram_lookup(cfg: V41Config, b: int) -> float:
    """Per token, one V4.1 Engram layer: the row ids, the looked-up rows (wkv's input), the fp32 streams,
    key and their products for the gate, the gate and the fp32 value."""
    n, d = cfg.hc_mult, cfg.hidden_size
    cols = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads
    per = I64 * cols + b * cols * cfg.engram_head_dim
    per += F32 * (3 * n * d + d + 6 * n)  # h (fp32), key (fp32), h * gains; value (fp32); rstds, dot, gate
    return per + (F32 * n * d if b != F32 else 0)  # key's fp32 copy at bf16


def compressor(cfg: ModelConfig, layer_type: str, S: int, b: int, cp: int = 1) -> float:
    """One sequence through the attention's Compressor (the indexer's runs under no_grad); a
    context-parallel rank projects its rows and halo and pools its own S / cp rows' windows."""
    lt, m, _, _ = layer_kind(cfg, layer_type)
    c = cfg.head_dim
    if lt == CSA2 and m == 1:  # V4.1's ratio 1: norm(wkv x) per row, then RoPE
        return (S // cp) * (rms_norm(c) + F32 * cfg.qk_rope_head_dim)
    coff = 2 if lt == CSA else 1
    N = S // cp // m
    total = (S // cp + _halo(cfg, layer_type, cp)[1]) * F32 * 2 * coff * c  # kv and gate scores (fp32; linear_fp32 keeps x as it is, shared)
    total += N * m * F32 * 2 * coff * c  # gathered window slots and their softmax weights
    total += N * m * I64 * (2 if lt == CSA else 1)  # slot index (and previous-window index)
    total += N * (1 if lt == CSA else 0)  # previous-window mask (bool)
    total += N * rms_norm(c)  # norm of the pooled entries
    total += N * F32 * cfg.qk_rope_head_dim  # RoPE of the entries: their complex rotation
    return total


def moe(cfg: ModelConfig, mlp_type: str, b: int, tp: int = 1) -> float:
    """Per token, ffn_norm and the MoE (router, k routed experts, shared expert). Under TP the shared expert's
    width / tp (column/row-wise); ffn_norm and the router whole (replicated); the routed copies of 1 / tp of the
    rows, as the planner splits experts over ``ep`` carved from dp_shard x cp x tp (trex.plan.layout)."""
    d, E, k, inter = cfg.hidden_size, cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size
    per = rms_norm(d)  # ffn_norm
    per += b * d  # router and expert input (linear_fp32 keeps it at the compute dtype)
    per += F32 * 2 * E + I64 * k + F32 * (k + 1)  # logits, scores; top-k index; weights and their sum
    per += F32 if mlp_type != HASH_MOE else 0  # balance loss: score sums (and [E] per sequence, in block())
    routed = 2 * I64 * k + F32 * k  # sort order and token index of the k copies, gathered weights
    routed += b * d * k + F32 * d * k  # permuted inputs; expert outputs, as the fp32 copies the combine sums
    swiglu = F32 * 5 + F32 + b  # clamped SwiGLU's five fp32 tensors, routed product, w2 input
    routed += swiglu * inter * k
    per += routed / tp
    per += (F32 * 5 + b) * inter * cfg.n_shared_experts / tp
    return per


def block(cfg: ModelConfig, layer_type: str, mlp_type: str, S: int, b: int, cp: int = 1,
          tp: int = 1, rows: int = 1) -> LayerActivations:
    """One block's saved bytes for one sequence on one of ``cp`` context-parallel and ``tp`` tensor-parallel
    ranks (mHC over 1 / ``rows`` of the rows: sequence parallelism; whole without)."""
    balance = F32 * cfg.n_routed_experts if mlp_type != HASH_MOE else 0  # per-sequence expert fractions
    return LayerActivations(mhc=2 * mhc_site(cfg, b) * (S // cp) / rows,
                            attention=attention(cfg, layer_type, S, b, cp, tp),
                            moe=moe(cfg, mlp_type, b, tp) * (S // cp) + balance)


def backward_workspace(cfg: ModelConfig, layer_type: str, S: int, b: int, cp: int = 1, tp: int = 1,
                       rows: int = 1) -> float:
    """Transient bytes while one block runs backward (or is recomputed), on top of what it saved:
    the fp32 gradients of its output and input streams, and sparse attention's entry-gradient buffers
    (kernels.sparse_attention: the score and probability gradients of the compressed entries; over all
    entries (HCA, and CSA whose top-k covers half of them) the probabilities as one matmul operand;
    for gathered top-k, one query chunk's stacked [2H] operands and [T, k, c] per-pick gradients).
    Checked end to end by the full-recompute cases of tests/test_plan_memory_cpu.py, where it shows. Under TP
    the H / tp heads' buffers; the streams over 1 / ``rows`` of the rows (sequence parallelism)."""
    n, d, H, c = cfg.hc_mult, cfg.hidden_size, cfg.num_attention_heads // tp, cfg.head_dim
    total = 2 * F32 * n * d * (S // cp) / rows
    if layer_kind(cfg, layer_type)[0] != SLIDING:
        _, kc, gathered = compressed_seen(cfg, layer_type, S)
        queries = S // cp + _halo(cfg, layer_type, cp)[0]
        total += 2 * F32 * queries * H * kc  # dP and dS of the compressed scores
        if gathered:
            T = min(queries, max(1, CHUNK_BYTES // (kc * c * b)))
            total += T * (2 * H * (kc + c) * b + kc * c * b)
        if not gathered or b != F32:  # the probabilities as one [S * H, N] operand, or their bf16 cast
            total += queries * H * kc * b
    return total


def weight_copies(cfg: ModelConfig, layer_type: str, b: int) -> float:
    """fp32 copies of weights that one block keeps at bf16 (0 at fp32, where .float() is free)."""
    if b == F32:
        return 0.0
    n, d, c = cfg.hc_mult, cfg.hidden_size, cfg.head_dim
    total = 2 * (2 + n) * n * n * d  # mHC fn (two sites)
    total += 2 * d + cfg.q_lora_rank + c  # RMSNorm weights
    if layer_kind(cfg, layer_type)[2]:
        total += c  # compressor norm
    return F32 * total


def head(cfg: ModelConfig, b: int) -> float:
    """Per token, one output head: HC head, final norm, LM head input, the loss's log-sum-exp and
    target. No logits: training runs the LM head fused with the loss (cross_entropy.head_nll)."""
    n, d = cfg.hc_mult, cfg.hidden_size
    cp = 0 if b == F32 else F32
    hc_head = F32 * (2 * n * d + 1 + 3 * n) + cp * n * d
    if isinstance(cfg, V41Config):  # single-pass mHC: the streams collapse with the last block's pre
        hc_head = b * n * d + F32 * n
    return hc_head + rms_norm(d) + b * d + F32 + I64 + 1  # ...; target index and its valid mask


def model_level(cfg: ModelConfig, S: int, b: int, heads: bool = True, tp: int = 1, rows: int = 1) -> float:
    """Per-sequence bytes outside the blocks: ids, document ids, heads, MTP inputs, weight copies.
    ``heads=False``: what is left once the heads and MTP modules are back-propagated. Whole rows under sequence
    parallelism too (``rows`` unused: an upper bound; the heads read the gathered rows)."""
    n, d = cfg.hc_mult, cfg.hidden_size
    cp = 0 if b == F32 else F32
    mtp = mtp_blocks(cfg)
    per_tok = I64 * (1 + mtp)  # token ids for the embeddings
    per_tok += I64  # document ids (sparse attention rebuilds its window masks from them in backward)
    if heads:
        per_tok += head(cfg, b) * (1 + mtp)
        per_tok += mtp * (rms_norm(d) + b * d)  # enorm, e_proj input
        per_tok += mtp * (cp * n * d + F32 * (n * d + n) + b * n * d)  # hnorm (input copy at bf16), h_proj input
    copies = 0.0
    if b != F32 and heads:  # the heads' fp32 weight copies
        copies = F32 * (1 + mtp) * (n * n * d + d) + mtp * F32 * 3 * d  # HC head fn, norm weights
    return per_tok * S + copies


# ---- time, facts, notes ------------------------------------------------------------------------------------

def moe_layers(cfg: ModelConfig | V41Config, layers: int) -> int:
    """MoE layers among ``layers`` main layers: every layer (hash-routed ones too)."""
    return min(layers, cfg.num_hidden_layers)


def dense_ffn_flops(cfg: ModelConfig | V41Config) -> int:
    """Forward FLOPs per token of dense FFN layers: none, every layer is MoE."""
    return 0


def busiest_shard_flops(cfg: ModelConfig | V41Config, seq_len: int, cp: int, total: Callable[[int], float]) -> float:
    """Training FLOPs per token of the last of ``cp`` contiguous shards, whose queries see the most compressed
    entries (HCA attention and the CSA indexer's scores grow with the position): the mean over its positions
    (``total(S)`` is the mean over positions 0..S-1, so a sum over positions is S times it)."""
    before = seq_len - seq_len // cp
    return (seq_len * total(seq_len) - before * total(before)) / (seq_len - before)


def kernel_extra_flops(cfg: ModelConfig | V41Config, seq_len: int) -> float:
    """Training FLOPs per token the kernels run beyond the model FLOPs: none counted (trex.models.flops counts
    the attention as trex's sparse attention runs it)."""
    return 0.0


def indexer_training_flops(cfg: ModelConfig | V41Config, seq_len: int) -> tuple[float, float]:
    """Training FLOPs per token the lightning indexer adds when it trains (``[train] indexer_loss`` > 0:
    trex.models.deepseek_v4.compressor ``Indexer.align``), every CSA layer (and a CSA MTP block), as (split by
    TP's heads, whole on every TP rank); NotImplementedError for V4.1, which has none. Per layer and token, over
    k = min(index_topk, S / ratio) picks of compressed entries:
      the KL's target, the main attention's scores over the picks (H heads x head_dim), once (no gradient, outside
        the checkpoint); TP splits it by heads;
      the index scores over the picks (index_n_heads x index_head_dim, then weighed over the heads) in each
        checkpointed query chunk: the forward, the recompute and the backward's two products, whole;
      the indexer's projections (wq_b, weights_proj, its compressor's) run again with a gradient, and their weight
        gradients (the inputs are detached), whole."""
    if isinstance(cfg, V41Config):
        raise NotImplementedError("DeepSeek-V4.1's indexer has no alignment loss in trex (train.indexer_loss is "
                                  "refused for it)")
    d, hi, ci = cfg.hidden_size, cfg.index_n_heads, cfg.index_head_dim
    types = list(cfg.layer_types) + [cfg.mtp_layer_type] * cfg.num_nextn_predict_layers
    projections = cfg.q_lora_rank * hi * ci + d * hi + 2 * 2 * ci * d
    split = whole = 0.0
    for m in (cfg.compress_rate(CSA) for t in types if t == CSA):
        k = min(cfg.index_topk, seq_len // m)
        split += cfg.num_attention_heads * cfg.head_dim * k
        whole += 4 * hi * (ci + 1) * k + 2 * projections
    return 2.0 * split, 2.0 * whole


def cp_traffic(cfg: ModelConfig | V41Config, seq_len: int, b: int) -> tuple[float, float]:
    """Context-parallel bytes per sequence row and pass (forward and backward), for one rank:
    (halo bytes it sends to its neighbours: each layer's input rows forward, their gradients backward;
    ring-collective buffer bytes: each compressed layer's entries, all-gathered forward and their
    gradients reduce-scattered backward, and the CSA indexer's keys, forward only)."""
    halo = gathered = 0.0
    kinds = (*layer_kinds(cfg), *[cfg.mtp_layer_type] * mtp_blocks(cfg))
    for kind, n in Counter(kinds).items():
        lt, m, computes_entries, _ = layer_kind(cfg, kind)
        halo += n * 2 * b * cfg.hidden_size * sum(shard_halo(cfg, lt))
        if m and computes_entries:  # V4.1: only KV sources gather entries; the layers after them reuse them
            gathered += n * 2 * b * cfg.head_dim * (seq_len // m)
            if lt in (CSA, CSA2):
                gathered += n * b * cfg.index_head_dim * (seq_len // m)
    return halo, gathered


def tp_split(cfg: ModelConfig | V41Config) -> dict[str, int]:
    """What trex's TP splits (trex.models.deepseek_v4.tp_plan): the attention heads (``wq_b``'s rows, the sinks),
    whole output groups (``wo_a``), the vocabulary (embedding and head), the shared expert's width."""
    return {"attention heads": cfg.num_attention_heads, "output groups": cfg.o_groups,
            "vocabulary": cfg.vocab_size, "shared-expert width": cfg.moe_intermediate_size * cfg.n_shared_experts}


def tp_traffic(cfg: ModelConfig | V41Config, S: int, b: int, recompute: str, layers: int, cp: int = 1,
               sp: bool = True) -> float:
    """Ring-collective buffer bytes one TP rank takes part in for one sequence of ``S`` tokens on one of ``cp``
    context-parallel ranks (its S / cp rows) through ``layers`` main layers, the MTP blocks and the heads, as
    trex.parallel.tensor_parallel runs V4's plan (``tp_ring_elements``, at the compute dtype). What enters the
    heads' region, its gradient summed in backward: ``wq_b``'s input [S, q_lora_rank], the shared K = V head ``_kv``
    [S + window halo, head_dim], the compressed entries a compressing layer's compressor returns [S / ratio,
    head_dim], and the shared expert's input [S, hidden]. Under sequence parallelism each block's norms and its two
    HyperConnections compute on this rank's rows (their gradients summed), V4.1's Engram on the whole rows, and
    the final norm, V4's mHC head and MTP's projections, norms and mHC heads outside the blocks likewise. Each
    vocabulary-parallel loss (head_nll) sums three fp32 statistics per row forward and the fp32 hidden-state
    gradient backward."""
    d, c, q, n = cfg.hidden_size, cfg.head_dim, cfg.q_lora_rank, cfg.hc_mult
    shared = bool(cfg.n_shared_experts)
    mtp = mtp_blocks(cfg)
    s = S // cp
    hc = (2 + n) * n * (n * d + 1) + 3  # one HyperConnection's fn, base, scale
    blocks = []
    kinds = [k for k, _ in main_blocks(cfg)[:layers]] + [mtp_kind(cfg)] * mtp
    engram = set(getattr(cfg, "engram_layer_ids", ()))
    for i, kind in enumerate(kinds):
        lt, m, computes_entries, _ = layer_kind(cfg, kind)
        entries = q * s + c * (s + _halo(cfg, kind, cp)[0]) + (d * s if shared else 0)
        if lt != SLIDING and computes_entries:
            entries += c * (s // m)
        blocks.append(SplitBlock(shared, entries, 2 * d + 2 * hc, n * s * d if i in engram else 0.0))
    head_hc = n * n * d + n + 1  # an mHC head's fn, base, scale (V4.1 collapses with the last pre: none)
    root = d + (0 if isinstance(cfg, V41Config) else head_hc) + mtp * (2 * d * d + 3 * d + head_hc)
    return b * tp_ring_elements(s, d, blocks, 1 + mtp, root, F32 / b * (3 + d), recompute, sp)


def table_reads(cfg: ModelConfig | V41Config) -> int:
    """Elements of V4.1's Engram tables one token reads: (max_ngram - 1) x heads rows of each table (0 for V4)."""
    if not isinstance(cfg, V41Config):
        return 0
    return len(cfg.engram_layer_ids) * (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads * cfg.engram_head_dim


def table_lookup_bytes(cfg: ModelConfig | V41Config, trained: bool) -> int:
    """Bytes per token of V4.1's Engram lookup over every rank: per table its int64 row ids and fp32 rows there
    and back, and the rows' fp32 gradients back when the tables train (0 for V4)."""
    if not isinstance(cfg, V41Config):
        return 0
    cols = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads
    return len(cfg.engram_layer_ids) * cols * (8 + 4 * cfg.engram_head_dim * (2 if trained else 1))


def counted_model(cfg: ModelConfig | V41Config) -> tuple[ModelConfig | V41Config, int, int]:
    """The model built on meta is counted as it is: nothing added."""
    return cfg, 0, 0


def notes(cfg: ModelConfig | V41Config, tp: int = 1) -> list[str]:
    return []
