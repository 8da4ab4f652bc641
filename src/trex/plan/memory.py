"""Memory per device for one layout: persistent state, working buffers, activations, headroom.

State follows what trex keeps (docs/optimizers.md, trex.train.precision): parameters and their
gradients at the compute dtype, an fp32 master copy when that dtype is not fp32, Muon one fp32
momentum per parameter and AdamW two fp32 moments. FSDP shards all of it over dp_shard (experts:
ep x dp_shard/ep), pipeline stages over pp. Working buffers: the unsharded block being used and
the one prefetched (FSDP), one block's unsharded gradients before reduce-scatter, the
Newton-Schulz workspace of the largest Muon matrix, the EP dispatch/combine buffers and the
logits gradient. Activations come from `trex.plan.activations`.
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

    weights: float
    master: float
    gradients: float
    optimizer: float
    gathered: float  # FSDP: unsharded current + prefetched block, one block of unsharded gradients
    optimizer_workspace: float
    activations: float
    transient: float  # logits gradient, EP dispatch/combine buffers
    optimizer_host: float  # optimizer state moved to host memory (not in total)

    @property
    def total(self) -> float:
        return sum(v for k, v in asdict(self).items() if k != "optimizer_host")

    def as_dict(self) -> dict:
        return {**asdict(self), "total": self.total}


def activation_bytes(cfg: ModelConfig, layout: Layout, seq_len: int, b: int) -> float:
    """Saved activations of the micro-batches in flight on the busiest pipeline stage."""
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
        elif layout.recompute == "selective":  # mHC and attention are recomputed in backward
            saved += stream + blk.moe
            recompute_peak = max(recompute_peak, blk.mhc + blk.attention + copies)
        else:
            saved += stream
            recompute_peak = max(recompute_peak, blk.total + copies)
    per_micro = (saved + act.model_level(cfg, S, b) + recompute_peak) * layout.micro_batch
    return per_micro * min(layout.pp, layout.grad_accum)  # 1F1B: stage 0 holds pp micro-batches


def memory(cfg: ModelConfig, facts: ModelFacts, layout: Layout, seq_len: int, b: int) -> MemoryBreakdown:
    shard = layout.dp_shard * layout.pp
    stored, trainable = facts.stored / shard, facts.trainable / shard
    if layout.optimizer == "muon":
        state = (4 * facts.muon + 8 * facts.adamw) / shard
    else:
        state = 8 * facts.trainable / shard
    master = 4 * trainable if b != 4 else 0.0
    block = facts.block_dense + facts.block_experts / layout.ep
    gathered = 3 * b * block if layout.dp_shard > 1 else 0.0
    workspace = 0.0
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
        weights=b * stored, master=master, gradients=b * trainable,
        optimizer=0.0 if layout.offload_optimizer else state, gathered=gathered, optimizer_workspace=workspace,
        activations=activation_bytes(cfg, layout, seq_len, b), transient=transient,
        optimizer_host=state if layout.offload_optimizer else 0.0)
