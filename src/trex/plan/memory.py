"""Memory per device for one layout: persistent state, the step's peak, headroom.

State follows what trex keeps (docs/optimizers.md, trex.precision, trex.parallel.plan):
fp32 parameters, which are the master weights (FSDP2's mixed precision, and ComputeCast on one
process, cast them to the compute dtype per block), fp32 gradients, Muon one fp32 momentum per
parameter and AdamW two fp32 moments. FSDP shards all of it over dp_shard x cp (experts: ep x
dp_shard x cp / ep), pipeline stages over pp. A context-parallel rank keeps the activations of its
S / cp rows.

Tensor parallelism (``Layout.tp``): a parameter TP splits (trex.plan.model_facts.TP_SPLIT)
holds 1 / tp of itself on each TP rank, then FSDP shards that over dp_shard x cp; the parts TP leaves whole
(the attention's down projections, V4's K = V head, compressor and indexer, mHC, norms, the router) are
FSDP-sharded only; routed experts are split over
dp_shard x cp x tp (EP, then FSDP over what is left). Activations of a TP rank: the family's plan terms (``tp``).

A step's memory peaks at one of two moments, and the breakdown keeps what is alive at each:
  backward   activations at their backward peak, the FSDP working set (`gathered`), the fused
             head + loss backward and EP dispatch buffers (`transient`), and the gradients of earlier
             micro-batches (`accumulated_gradients`, zero without gradient accumulation: the sharded
             gradients fill in as the activations drain);
  optimizer  the sharded gradients and the Newton-Schulz workspace of the largest Muon matrix.
total = weights + optimizer state + the larger of the two. V4.1's Engram tables are split by rows
over every device outside FSDP (fp32); trained, they add an fp32 gradient of the device's rows and
row-wise AdaGrad's one fp32 per row. Activations, per block and outside the blocks, are the family's plan
terms (trex.plan.terms; their list: trex.models.common.plan_terms). tests/test_plan_memory_cpu.py and
tests/test_plan_memory_distributed.py check the step peak against measured CPU runs (one process; FSDP and
FSDP+EP on two).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from itertools import accumulate

from trex.models.common.plan_terms import head_backward_workspace
from trex.models.registry import AnyConfig
from trex.plan.layout import Layout
from trex.plan.model_facts import ModelFacts
from trex.plan.terms import terms

HEADROOM = 0.10  # of device memory, kept free for allocator fragmentation, runtime and collective buffers


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes per device."""

    weights: float  # fp32 parameters (the master weights)
    gradients: float  # fp32, sharded, from the last backward to the optimizer step
    optimizer: float
    gathered: float  # weights at the compute dtype: FSDP's unsharded units, or one process's casts
    accumulated_gradients: float  # held through the backward of micro-batches after the first
    optimizer_workspace: float
    activations: float  # alive at the backward peak
    transient: float  # fused head + loss backward, EP dispatch/combine buffers
    backward_gradients: float  # gradients the backward has produced by its peak (full recompute: most)
    optimizer_host: float  # optimizer state moved to host memory (not in total)

    @property
    def backward_peak(self) -> float:
        return self.activations + self.gathered + self.transient + self.accumulated_gradients + self.backward_gradients

    @property
    def optimizer_peak(self) -> float:
        return self.gradients + self.optimizer_workspace

    @property
    def step_peak(self) -> float:
        """Bytes a step adds on top of the persistent weights and optimizer state."""
        return max(self.backward_peak, self.optimizer_peak)

    @property
    def total(self) -> float:
        return self.weights + self.optimizer + self.step_peak

    def as_dict(self) -> dict:
        return {**asdict(self), "step_peak": self.step_peak, "total": self.total}


@dataclass(frozen=True)
class BackwardMoment:
    """What one device holds at one moment of the backward (bytes)."""

    activations: float  # saved tensors still alive, plus the block being recomputed
    transient: float  # the fused head + loss backward at the start; EP dispatch/combine buffers in a block
    gradients: float  # gradients this backward has already produced (this rank's shard)


_MEMO: dict[int, tuple[AnyConfig, dict]] = {}


def _memo(cfg: AnyConfig) -> dict:
    """The per-block terms already computed for this config object (held here, so its id is not reused; a
    config is a value the planner never changes in place)."""
    held = _MEMO.get(id(cfg))
    if held is None or held[0] is not cfg:
        held = _MEMO[id(cfg)] = (cfg, {})
    return held[1]


def backward_peak(cfg: AnyConfig, facts: ModelFacts, layout: Layout, seq_len: int, b: int,
                  grads_held: bool) -> BackwardMoment:
    """The busiest moment of the backward of the busiest pipeline stage, found by walking the backward
    in autograd's order: the start (everything the forward saved, the fused head + loss backward), then the MTP
    blocks (they run before the main heads are freed), then the main blocks from the last. At each
    block: the forward-saved tensors of the blocks not yet done, the block's recomputation (selective:
    its attention site; full: all of it), the model-level tensors still alive, and the gradients of
    everything already done. Without recomputation the start is the peak; under full recomputation the
    activations are small and the gradients filling in decide it. ``grads_held``: gradient buffers
    exist before this backward (gradient accumulation), so it adds none."""
    S, mb, cp, tp = seq_len, layout.micro_batch, layout.cp, layout.tp
    S_local = S // cp  # a context-parallel rank's rows of each sequence
    act = terms(cfg)  # the family's activation terms
    main = act.main_blocks(cfg)[: cfg.num_hidden_layers // layout.pp]
    n_mtp = act.mtp_blocks(cfg)
    blocks = main + [(act.mtp_kind(cfg), "moe")] * n_mtp
    rows = tp if layout.sequence_parallel else 1  # the ranks a block's rows are split over
    stream = act.stream_bytes(cfg, b, rows) * S_local  # a block's input, all a checkpointed block keeps
    # per block: kept from the forward; recomputed in its backward (by then the block's FFN site, run
    # first in backward, has freed what it kept: only the block's input is left of its own)
    def kind(lt: str, mt: str) -> tuple[float, float, float]:
        """(saved, rebuilt, workspace) of a block of attention ``lt`` and FFN ``mt``."""
        blk, copies = act.block(cfg, lt, mt, S, b, cp, tp, rows), act.weight_copies(cfg, lt, b)
        work = act.backward_workspace(cfg, lt, S, b, cp, tp, rows)
        if layout.recompute == "none":
            return blk.total + copies, 0.0, work
        if layout.recompute == "selective":  # the attention site (hc_attn: mHC + attention) is recomputed;
            return stream + blk.mhc / 2 + blk.moe, blk.mhc / 2 + blk.attention + copies, work  # FFN site's mHC, MoE kept
        return stream, blk.total + copies, work

    memo = _memo(cfg)  # a search plans thousands of layouts over a few kinds of block at a few shapes
    kinds = {}
    for k in dict.fromkeys(blocks):
        key = (*k, S, b, cp, tp, rows, layout.recompute)
        if key not in memo:
            memo[key] = kind(*k)
        kinds[k] = memo[key]
    saved, rebuilt, workspace = ([kinds[k][i] for k in blocks] for i in range(3))

    def own(j: int) -> float:
        """Block j's own bytes while its backward runs."""
        return (saved[j] if layout.recompute == "none" else stream + rebuilt[j]) + workspace[j]

    model_level = act.model_level(cfg, S_local, b, tp=tp, rows=rows)
    after_heads = act.model_level(cfg, S_local, b, heads=False, tp=tp, rows=rows)
    in_flight = min(layout.pp, layout.grad_accum)  # 1F1B: stage 0 holds pp micro-batches
    others = (in_flight - 1) * mb * (sum(saved) + model_level)
    tokens = mb * S_local
    ep_buffers = 2 * b * tokens / tp * cfg.num_experts_per_tok * cfg.hidden_size if layout.ep > 1 else 0.0
    # gradient shards per block (a block's TP-whole part taken as the largest block's) and of the heads
    grad = [0.0 if grads_held else 4 * facts.per_tp_rank(n, min(n, facts.tp_whole_block), tp) / layout.fsdp
            for n in facts.block_trainable]
    heads = facts.per_tp_rank(facts.root - facts.by_type["embedding"], facts.tp_whole_root, tp)
    heads_grad = 0.0 if grads_held else 4 * heads / layout.fsdp

    before = [0.0, *accumulate(saved)]  # before[i]: what blocks 0..i-1 saved
    after = [0.0, *accumulate(reversed(grad))][::-1][1:]  # after[j]: gradients of blocks j+1.. (sum(grad[j + 1:]))
    # (activations, transient, gradients) at each moment, as plain tuples: the search calls this per layout
    moments = [(mb * (sum(saved) + model_level) + others, head_backward_workspace(cfg, tokens, tp), 0.0)]
    L = len(main)
    for j in reversed(range(L, len(blocks))):  # MTP blocks; the main heads are still alive
        moments.append((mb * (before[j] + own(j) + model_level) + others, ep_buffers, after[j]))
    for i in reversed(range(L)):
        moments.append((mb * (before[i] + own(i) + after_heads) + others, ep_buffers, after[i] + heads_grad))
    return BackwardMoment(*max(moments, key=sum))


def memory(cfg: AnyConfig, facts: ModelFacts, layout: Layout, seq_len: int, b: int) -> MemoryBreakdown:
    shard, tp = layout.fsdp * layout.pp, layout.tp

    def per_rank(total: int, whole: int) -> float:
        """Elements of ``total`` on one TP rank (``whole`` of them not split by TP), before FSDP."""
        return facts.per_tp_rank(total, whole, tp)

    stored = per_rank(facts.stored, facts.tp_whole_stored) / shard
    trained, muon = facts.trained_per_tp_rank(tp, layout.train_indexer)
    indexer = facts.indexer if layout.train_indexer else 0  # whole on every TP rank (both families' TP plans)
    trainable = trained / shard
    state = (4 * muon + 8 * (trained - muon)) / shard if layout.optimizer == "muon" else 8 * trainable
    tables = 4 * facts.engram_tables / layout.devices
    table_grads = tables if layout.train_engram else 0.0
    table_state = 4 * facts.engram_rows / layout.devices if layout.train_engram else 0.0
    gathered = accumulated = 0.0
    if layout.fsdp == 1 and b != 4:
        # one process: ComputeCast's per-block casts are saved by the forward's matmuls for backward
        gathered = b * facts.stored / layout.pp
    elif layout.fsdp > 1:
        # FSDP2: the block in use, the one prefetched and one block of unsharded gradients before its
        # reduce-scatter; the root unit (embedding, heads) is not resharded after forward, so its
        # unsharded copy lives through forward and backward
        block = per_rank(facts.block_dense, facts.tp_whole_block) + facts.block_experts / layout.ep
        gathered = b * (3 * block + per_rank(facts.root, facts.tp_whole_root) * (1 - 1 / layout.fsdp))
    if layout.grad_accum > 1 and layout.reduce_every_micro_batch and layout.fsdp > 1:
        accumulated = 4 * trainable  # every micro-batch reduce-scatters: the sharded gradients accumulate
    elif layout.grad_accum > 1:
        # micro-batches before the last skip the reduce-scatter (no-sync), so FSDP2 accumulates
        # *unsharded* gradients of the whole stage (experts: this rank's ep share), upcast to the
        # fp32 reduce dtype (trex.precision); one process keeps its fp32 gradients
        unsharded = (per_rank(facts.trainable - facts.experts, facts.tp_whole_trainable) + indexer
                     + facts.experts / layout.ep) / layout.pp
        accumulated = 4 * unsharded if layout.fsdp > 1 else 4 * trainable
    # the largest local matrix (TP splits the largest dense ones, MLA's wo or the dense MLP's)
    largest = max(facts.largest_muon_matrix / tp, facts.block_experts / 3 / layout.ep)
    if layout.optimizer == "muon":  # momentum direction, X, X X^T products on the largest local matrix
        workspace = 4 * 4 * largest
    else:
        workspace = 4 * 2 * largest
    peak = backward_peak(cfg, facts, layout, seq_len, b, grads_held=layout.grad_accum > 1)
    return MemoryBreakdown(
        weights=4 * stored + tables, gradients=4 * trainable + table_grads,
        optimizer=(0.0 if layout.offload_optimizer else state) + table_state, gathered=gathered, accumulated_gradients=accumulated,
        optimizer_workspace=workspace, activations=peak.activations, transient=peak.transient,
        backward_gradients=peak.gradients, optimizer_host=state if layout.offload_optimizer else 0.0)
