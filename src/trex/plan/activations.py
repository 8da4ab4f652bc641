"""Bytes that autograd keeps for backward in one training forward of trex's DeepSeek-V4.

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

from dataclasses import dataclass

from trex.kernels import latent_attention, sparse_mla
from trex.kernels.sparse_attention import CHUNK_BYTES, DENSE_TOPK_FRACTION
from trex.models.common.config import HASH_MOE
from trex.models.common.cross_entropy import head_tiles
from trex.models.deepseek_v4.config import CSA, SLIDING, ModelConfig, shard_halo
from trex.models.deepseek_v4.config_v41 import CSA2, V41Config

F32, I64 = 4, 8


@dataclass(frozen=True)
class LayerActivations:
    """Saved bytes of one block for one sequence: both mHC sites, attention, MoE."""

    mhc: float
    attention: float
    moe: float

    @property
    def total(self) -> float:
        return self.mhc + self.attention + self.moe


def layer_kinds(cfg: ModelConfig | V41Config) -> list[str]:
    """Each main layer's kind: V4's layer type; for V4.1 ``"csa2/<ratio>"`` (``"/kv"`` for a KV source)
    or the sliding type, with ``"+engram"`` where Engram writes before the block."""
    if is_v3(cfg):
        return v3_kinds(cfg)
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


def main_blocks(cfg) -> list[tuple[str, str]]:
    """(layer kind, FFN type) of each main layer."""
    if is_v3(cfg):
        return [(k, "dense" if k == V3_DENSE else "moe") for k in v3_kinds(cfg)]
    return list(zip(layer_kinds(cfg), cfg.mlp_layer_types))


def mtp_kind(cfg) -> str:
    """The layer kind of an MTP block."""
    return V3_MTP if is_v3(cfg) else cfg.mtp_layer_type


def stream_bytes(cfg, b: int, tp: int = 1) -> float:
    """Per token, a block's input: all a checkpointed block keeps (V4's hc_mult streams, V3's one; under tensor
    parallelism a rank keeps its 1 / tp of the rows, sequence parallelism)."""
    return b * cfg.hidden_size * (1 if is_v3(cfg) else cfg.hc_mult) / tp


def _rms_norm(D: int) -> float:
    """Weighted RMSNorm (reference kernel): fp32 input, rstd, normalised pre-weight value."""
    return F32 * (2 * D + 1)


def mhc_site(cfg: ModelConfig, b: int) -> float:
    """Per token, one HyperConnection (pre/post/comb with Sinkhorn) around a sublayer."""
    n, d, it = cfg.hc_mult, cfg.hidden_size, cfg.hc_sinkhorn_iters
    cp = 0 if b == F32 else F32
    per = 2 * n * d + 1  # fp32 streams (rms input) and the normalised streams fed to fn; rstd
    per += (2 + n) * n  # mixes
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


def attention(cfg: ModelConfig, layer_type: str, S: int, b: int, cp: int = 1) -> float:
    """One sequence of S tokens through attn_norm and Attention (compressor included), on one of ``cp``
    context-parallel ranks."""
    d, H, c, q, W = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.q_lora_rank, cfg.sliding_window
    rd = cfg.qk_rope_head_dim
    K = max(1, W // 4) + W  # window keys per query block of W/4 (the probabilities keep all K)
    per_tok = _rms_norm(d)  # attn_norm
    per_tok += b * d + _rms_norm(q) + b * q  # wq_a input (shared with wkv), q_norm, wq_b input
    lt, _, computes_entries, engram = layer_kind(cfg, layer_type)
    if lt != CSA2:
        per_tok += F32 * (H * c + H)  # unweighted RMSNorm of the heads: fp32 input and rstd (not in V4.1)
    per_tok += _rms_norm(c)  # kv_norm
    per_tok += 3 * F32 * rd  # RoPE of q, kv and the output: each keeps its complex rotation [rd/2]
    per_tok += b * H * c + b * cfg.o_groups * cfg.o_lora_rank  # grouped wo_a input (permuted copy), wo_b input
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
        return (S // cp) * (_rms_norm(c) + F32 * cfg.qk_rope_head_dim)
    coff = 2 if lt == CSA else 1
    N = S // cp // m
    total = (S // cp + _halo(cfg, layer_type, cp)[1]) * F32 * 2 * coff * c  # kv and gate scores (fp32; linear_fp32 keeps x as it is, shared)
    total += N * m * F32 * 2 * coff * c  # gathered window slots and their softmax weights
    total += N * m * I64 * (2 if lt == CSA else 1)  # slot index (and previous-window index)
    total += N * (1 if lt == CSA else 0)  # previous-window mask (bool)
    total += N * _rms_norm(c)  # norm of the pooled entries
    total += N * F32 * cfg.qk_rope_head_dim  # RoPE of the entries: their complex rotation
    return total


def moe(cfg: ModelConfig, mlp_type: str, b: int) -> float:
    """Per token, ffn_norm and the MoE (router, k routed experts, shared expert)."""
    d, E, k, inter = cfg.hidden_size, cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size
    per = _rms_norm(d)  # ffn_norm
    per += b * d  # router and expert input (linear_fp32 keeps it at the compute dtype)
    per += F32 * 2 * E + I64 * k + F32 * (k + 1)  # logits, scores; top-k index; weights and their sum
    per += F32 if mlp_type != HASH_MOE else 0  # balance loss: score sums (and [E] per sequence, in block())
    per += 2 * I64 * k + F32 * k  # sort order and token index of the k copies, gathered weights
    per += b * d * k + F32 * d * k  # permuted inputs; expert outputs, as the fp32 copies the combine sums
    swiglu = F32 * 5 + F32 + b  # clamped SwiGLU's five fp32 tensors, routed product, w2 input
    per += swiglu * inter * k
    per += (F32 * 5 + b) * inter * cfg.n_shared_experts
    return per


def block(cfg: ModelConfig, layer_type: str, mlp_type: str, S: int, b: int, cp: int = 1,
          tp: int = 1) -> LayerActivations:
    """One block's saved bytes for one sequence on one of ``cp`` context-parallel and ``tp`` tensor-parallel
    ranks (tp > 1: the DeepSeek-V3 family only, trex.plan.layout.check_tensor_parallel)."""
    if is_v3(cfg):
        return v3_block(cfg, layer_type, S, b, cp, tp)
    balance = F32 * cfg.n_routed_experts if mlp_type != HASH_MOE else 0  # per-sequence expert fractions
    return LayerActivations(mhc=2 * mhc_site(cfg, b) * (S // cp), attention=attention(cfg, layer_type, S, b, cp),
                            moe=moe(cfg, mlp_type, b) * (S // cp) + balance)


def backward_workspace(cfg: ModelConfig, layer_type: str, S: int, b: int, cp: int = 1, tp: int = 1) -> float:
    """Transient bytes while one block runs backward (or is recomputed), on top of what it saved:
    the fp32 gradients of its output and input streams, and sparse attention's entry-gradient buffers
    (kernels.sparse_attention: the score and probability gradients of the compressed entries; over all
    entries (HCA, and CSA whose top-k covers half of them) the probabilities as one matmul operand;
    for gathered top-k, one query chunk's stacked [2H] operands and [T, k, c] per-pick gradients).
    Checked end to end by the full-recompute cases of tests/test_plan_memory_cpu.py, where it shows."""
    if is_v3(cfg):
        return v3_backward_workspace(cfg, S, b, cp, tp)
    n, d, H, c = cfg.hc_mult, cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
    total = 2 * F32 * n * d * (S // cp)
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
    if is_v3(cfg):
        return v3_weight_copies(cfg, layer_type, b)
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
    return hc_head + _rms_norm(d) + b * d + F32 + I64 + 1  # ...; target index and its valid mask


def head_backward_workspace(cfg: ModelConfig, tokens: int, tp: int = 1) -> float:
    """Transient bytes of one fused head + loss backward (cross_entropy.head_nll) over ``tokens``:
    one tile's fp32 logits, the fp32 hidden-state gradient, the head weight's fp32 copy and its
    fp32 gradient. Under tensor parallelism (vocabulary-parallel head and loss) a rank holds V / tp of the
    vocabulary of every token of the group."""
    V, d = cfg.vocab_size // tp, cfg.hidden_size
    block, rows = head_tiles(tokens, V)
    return F32 * (block * rows + tokens * d + 2 * V * d)


def model_level(cfg: ModelConfig, S: int, b: int, heads: bool = True, tp: int = 1) -> float:
    """Per-sequence bytes outside the blocks: ids, document ids, heads, MTP inputs, weight copies.
    ``heads=False``: what is left once the heads and MTP modules are back-propagated."""
    if is_v3(cfg):
        return v3_model_level(cfg, S, b, heads, tp)
    n, d = cfg.hc_mult, cfg.hidden_size
    cp = 0 if b == F32 else F32
    mtp = mtp_blocks(cfg)
    per_tok = I64 * (1 + mtp)  # token ids for the embeddings
    per_tok += I64  # document ids (sparse attention rebuilds its window masks from them in backward)
    if heads:
        per_tok += head(cfg, b) * (1 + mtp)
        per_tok += mtp * (_rms_norm(d) + b * d)  # enorm, e_proj input
        per_tok += mtp * (cp * n * d + F32 * (n * d + n) + b * n * d)  # hnorm (input copy at bf16), h_proj input
    copies = 0.0
    if b != F32 and heads:  # the heads' fp32 weight copies
        copies = F32 * (1 + mtp) * (n * n * d + d) + mtp * F32 * 3 * d  # HC head fn, norm weights
    return per_tok * S + copies


def forward_saved(cfg: ModelConfig, S: int, b: int) -> float:
    """Everything autograd keeps for one sequence of S tokens (the whole model, MTP included)."""
    total = model_level(cfg, S, b)
    for lt, mt in main_blocks(cfg):
        total += block(cfg, lt, mt, S, b).total + weight_copies(cfg, lt, b)
    for _ in range(mtp_blocks(cfg)):
        total += block(cfg, mtp_kind(cfg), "moe", S, b).total + weight_copies(cfg, mtp_kind(cfg), b)
    return total


# ---- the DeepSeek-V3 family (trex.models.deepseek_v3) ---------------------------------------------
# MLA in its MHA form over a plain residual stream at the compute dtype (no mHC), a dense SwiGLU MLP in
# the first first_k_dense_replace layers and the MoE (sigmoid router, group-limited top-k) after, an MTP
# block fed eh_proj([enorm(next embedding), hnorm(h)]). The attention core is counted as the kernel
# registry's reference for ``dense_attention`` (plain PyTorch over [B, H, S, S] scores), which saves the
# fp32 probabilities (and their compute-dtype cast) and the [S, S] document-causal mask: quadratic in S,
# per layer. The fused default (SDPA) keeps a logsumexp instead of the probabilities, so this is an upper
# bound on what a run saves; modelling the fused path exactly is left to do (docs/planning.md). Under context
# parallelism (cp > 1) the dense core is ``latent_attention``'s, counted as it saves (no [S, S] terms; checked
# against autograd on tiny-v3 as rank 1 of 2, tests/test_plan_v3.py).
# V3.2's attention is its sparse MLA as trex's gathered kernel saves it (the absorbed form, the top-k picks;
# nothing [S, S]; equal to autograd on tiny-v3.2, tests/test_plan_activations.py). Layer kinds: "mla/dense",
# "mla/moe" and "mla/mtp" (an MTP block's extra norms and eh_proj input). Checked against autograd on
# tiny-v3 (tests/test_plan_activations.py).
V3_DENSE, V3_MOE, V3_MTP = "mla/dense", "mla/moe", "mla/mtp"


def is_v3(cfg) -> bool:
    return getattr(cfg, "architecture", None) == "deepseek_v3"


def v3_attention(cfg, S: int, b: int, cp: int = 1, tp: int = 1) -> float:
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
    Under tensor parallelism (``tp``, Megatron's / torchtitan's MLA plan) a rank keeps 1 / tp of the rows' attn_norm
    (sequence parallel) and its H / tp heads' terms; the all-gathered norm output, the down projections' latents
    and their norms (replicated: every TP rank computes them on every row) whole."""
    d, H, q, kv, rd = cfg.hidden_size, cfg.num_attention_heads // tp, cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    qk, nope, dv = cfg.qk_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim
    s = S // cp
    per_tok = _rms_norm(d) / tp + b * d  # attn_norm (sequence parallel); wq_a / wkv_a input (one tensor)
    if q:
        per_tok += _rms_norm(q) + b * q  # q_norm, wq_b input
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


def v3_ffn(cfg, moe_layer: bool, b: int, tp: int = 1) -> float:
    """Per token, ffn_norm and the dense SwiGLU MLP or the MoE (router, k routed experts, shared experts).
    Under tensor parallelism (``tp``): ffn_norm over 1 / tp of the rows (sequence parallel), its all-gathered output
    and the router's terms whole (every TP rank routes every row), the dense MLP's and shared experts' widths
    / tp, the routed copies of 1 / tp of the rows (each TP rank dispatches its share: torchtitan's
    ReordererSequenceParallel)."""
    d = cfg.hidden_size
    per = _rms_norm(d) / tp + b * d  # ffn_norm; the FFN's input
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


def v3_block(cfg, kind: str, S: int, b: int, cp: int = 1, tp: int = 1) -> LayerActivations:
    moe_layer = kind != V3_DENSE
    s = S // cp
    per_seq = (4 * cfg.n_routed_experts + 2 * F32 * cfg.n_routed_experts) if moe_layer else 0  # offsets; balance
    d = cfg.hidden_size
    # enorm, hnorm (at fp32 its input is the previous head's input, saved already), eh_proj input [2d]; the
    # module's final norm
    # (under TP: the norms over 1 / tp of the rows, eh_proj's all-gathered input whole)
    mtp = ((3 * _rms_norm(d) - (F32 * d if b == F32 else 0)) / tp + 2 * b * d) * s if kind == V3_MTP else 0.0
    return LayerActivations(mhc=0.0, attention=v3_attention(cfg, S, b, cp, tp) + mtp,
                            moe=v3_ffn(cfg, moe_layer, b, tp) * s + per_seq)


def v3_weight_copies(cfg, kind: str, b: int) -> float:
    """fp32 copies of the RMSNorm weights one block keeps at bf16 (0 at fp32)."""
    if b == F32:
        return 0.0
    d = cfg.hidden_size
    return F32 * (2 * d + cfg.q_lora_rank + cfg.kv_lora_rank + (3 * d if kind == V3_MTP else 0))


def v3_model_level(cfg, S: int, b: int, heads: bool = True, tp: int = 1) -> float:
    """Per-sequence bytes outside the blocks: token ids, the final norm, each head's input and loss terms. Under
    tensor parallelism the final norm over 1 / tp of the rows (sequence parallel), the vocabulary-parallel heads'
    all-gathered inputs and the loss terms of every row whole."""
    heads_n = 1 + cfg.num_nextn_predict_layers
    total = I64 * heads_n * S  # ids for the embeddings (main and each MTP module's tokens ahead)
    if heads:
        d = cfg.hidden_size
        total += (_rms_norm(d) / tp + heads_n * (b * d + F32 + I64 + 1)) * S + 8 * heads_n  # norm; head input, lse, target
        total += F32 * d if b != F32 else 0.0
    return total


def v3_backward_workspace(cfg, S: int, b: int, cp: int = 1, tp: int = 1) -> float:
    """Transient bytes while one V3 block runs backward on one of ``cp`` ranks: the gradients of its output and
    input streams (its s = S / cp rows), and the attention core's: [H, s, S] gradients (of the probabilities
    at the compute dtype, of the fp32 scores through softmax and the mask); at cp > 1 for the dense MLA
    ``latent_attention``'s fp32 dq, the gathered latent's and k_pe's fp32 gradients and three fp32
    [H, tile, chunk] tiles (the scores turned probabilities in place, a matmul's output, dP turned dS); for
    V3.2's gathered sparse MLA its dq, the fp32 gradient of the whole rows' [latent | k_pe] it scatter-adds into
    and one query chunk's transients (at most sparse_mla.CHUNK_BYTES). Under tensor parallelism: the streams
    of 1 / tp of the rows, H / tp heads. An estimate, not measured."""
    H, s = cfg.num_attention_heads // tp, S // cp
    streams = 2 * b * cfg.hidden_size * s / tp
    if cfg.index_topk:
        c, k = cfg.kv_lora_rank + cfg.qk_rope_head_dim, min(cfg.index_topk, S)
        chunk = min(sparse_mla.CHUNK_BYTES, s * k * (c * (b + 8) + 16 * H))
        return streams + b * s * H * c + F32 * (S * c + s * H) + chunk
    if cp > 1:
        tile = min(latent_attention.TILE, s) * min(latent_attention.CHUNK, S)
        return streams + F32 * (H * cfg.qk_head_dim * s + (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * S + 3 * H * tile)
    return streams + (2 * F32 + b) * H * s * S


def v3_kinds(cfg) -> list[str]:
    return [V3_DENSE if i < cfg.first_k_dense_replace else V3_MOE for i in range(cfg.num_hidden_layers)]
