"""Memory per device for one layout: persistent state, the step's peak, headroom.

State follows what trex keeps (docs/optimizers.md, trex.train.precision, trex.parallel.plan):
fp32 parameters, which are the master weights (FSDP2's mixed precision, and ComputeCast on one
process, cast them to the compute dtype per block), fp32 gradients, Muon one fp32 momentum per
parameter and AdamW two fp32 moments. FSDP shards all of it over dp_shard (experts: ep x
dp_shard/ep), pipeline stages over pp.

A step's memory peaks at one of two moments, and the breakdown keeps what is alive at each:
  backward   activations at their backward peak, the FSDP working set (`gathered`), the logits
             gradient and EP dispatch buffers (`transient`), and the gradients of earlier
             micro-batches (`accumulated_gradients`, zero without gradient accumulation: the sharded
             gradients fill in as the activations drain);
  optimizer  the sharded gradients and the Newton-Schulz workspace of the largest Muon matrix.
total = weights + optimizer state + the larger of the two. Activations come from
`trex.plan.activations`. tests/test_plan_memory_cpu.py and tests/test_plan_memory_distributed.py
check the step peak against measured CPU runs (one process; FSDP and FSDP+EP on two).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from trex.models.config import ModelConfig
from trex.plan import activations as act
from trex.plan.layout import Layout
from trex.plan.model_facts import ModelFacts

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
    transient: float  # logits gradient, EP dispatch/combine buffers
    optimizer_host: float  # optimizer state moved to host memory (not in total)

    @property
    def backward_peak(self) -> float:
        return self.activations + self.gathered + self.transient + self.accumulated_gradients

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


def activation_bytes(cfg: ModelConfig, layout: Layout, seq_len: int, b: int) -> float:
    """Activations alive at the backward peak of the busiest pipeline stage: the saved tensors of
    the micro-batches in flight plus the larger of the model-level tensors (logits, heads) at the
    start of backward and, with recomputation, one block recomputed after the heads' backward has
    freed their logits."""
    layers = list(zip(cfg.layer_types, cfg.mlp_layer_types))[: cfg.num_hidden_layers // layout.pp]
    layers += [(cfg.mtp_layer_type, "moe")] * cfg.num_nextn_predict_layers
    S = seq_len
    stream = b * cfg.hc_mult * cfg.hidden_size * S  # a block's input, all a checkpointed block keeps
    saved, recompute_peak = 0.0, 0.0
    for lt, mt in layers:
        blk = act.block(cfg, lt, mt, S, b)
        copies = act.weight_copies(cfg, lt, b)
        if layout.recompute == "none":
            saved += blk.total + copies
        elif layout.recompute == "selective":  # the attention site (hc_attn: mHC + attention) is recomputed;
            saved += stream + blk.mhc / 2 + blk.moe  # the FFN site's mHC and the MoE are kept
            recompute_peak = max(recompute_peak, blk.mhc / 2 + blk.attention + copies)
        else:
            saved += stream
            recompute_peak = max(recompute_peak, blk.total + copies)
    model_level = act.model_level(cfg, S, b)
    heads = act.head(cfg, b) * S * (1 + cfg.num_nextn_predict_layers)
    per_micro = (saved + max(model_level, model_level - heads + recompute_peak)) * layout.micro_batch
    return per_micro * min(layout.pp, layout.grad_accum)  # 1F1B: stage 0 holds pp micro-batches


def memory(cfg: ModelConfig, facts: ModelFacts, layout: Layout, seq_len: int, b: int) -> MemoryBreakdown:
    shard = layout.dp_shard * layout.pp
    stored, trainable = facts.stored / shard, facts.trainable / shard
    if layout.optimizer == "muon":
        state = (4 * facts.muon + 8 * facts.adamw) / shard
    else:
        state = 8 * facts.trainable / shard
    gathered = accumulated = 0.0
    if layout.dp_shard == 1 and b != 4:
        # one process: ComputeCast's per-block casts are saved by the forward's matmuls for backward
        gathered = b * facts.stored / layout.pp
    elif layout.dp_shard > 1:
        # FSDP2: the block in use, the one prefetched and one block of unsharded gradients before its
        # reduce-scatter; the root unit (embedding, heads) is not resharded after forward, so its
        # unsharded copy lives through forward and backward
        block = facts.block_dense + facts.block_experts / layout.ep
        gathered = b * (3 * block + facts.root * (1 - 1 / layout.dp_shard))
    if layout.grad_accum > 1 and not (layout.reduce_every_micro_batch and layout.dp_shard > 1):
        # micro-batches before the last skip the reduce-scatter (no-sync), so FSDP2 accumulates
        # *unsharded* gradients of the whole stage (experts: this rank's ep share), upcast to the
        # fp32 reduce dtype (trex.train.precision); one process keeps its fp32 gradients
        unsharded = (facts.trainable - facts.experts + facts.experts / layout.ep) / layout.pp
        accumulated = 4 * unsharded if layout.dp_shard > 1 else 4 * trainable
    if layout.optimizer == "muon":  # momentum direction, X, X X^T products on the largest local matrix
        local_experts = facts.block_experts / 3 / layout.ep
        workspace = 4 * 4 * max(facts.largest_muon_matrix, local_experts)
    else:
        workspace = 4 * 2 * max(facts.largest_muon_matrix, facts.block_experts / 3 / layout.ep)
    tokens = layout.micro_batch * seq_len
    transient = 4 * cfg.vocab_size * tokens  # gradient of one head's fp32 logits
    if layout.ep > 1:
        transient += 2 * b * tokens * cfg.num_experts_per_tok * cfg.hidden_size
    return MemoryBreakdown(
        weights=4 * stored, gradients=4 * trainable,
        optimizer=0.0 if layout.offload_optimizer else state, gathered=gathered, accumulated_gradients=accumulated,
        optimizer_workspace=workspace,
        activations=activation_bytes(cfg, layout, seq_len, b), transient=transient,
        optimizer_host=state if layout.offload_optimizer else 0.0)
