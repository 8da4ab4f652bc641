"""Step time of one layout: compute, communication with stated overlap, pipeline bubble, optimizer.

Compute: tokens per device x FLOPs per token (`trex.models.flops`, the MFU numerator) plus what the
family's kernels run beyond it (its ``kernel_extra_flops``: V3.2's absorbed sparse MLA), the lightning indexer's
training when it trains (``Layout.train_indexer``: the family's ``indexer_training_flops``, its whole part on
every TP rank) and the forward work that recomputation repeats, at ``compute_efficiency`` x the device peak.
Communication per step and device, ring algorithms (a device moves (g-1)/g of the buffer):
  FSDP   all-gather of parameters in forward and again in backward per micro-batch (compute
         dtype), reduce-scatter of gradients once per step (fp32, trex's reduce dtype), or once
         per micro-batch with ``reduce_every_micro_batch``;
  HSDP   all-reduce of the sharded gradients over dp_replicate;
  EP     all-to-all dispatch and combine of k copies of every token, forward and backward, and forward again
         under full recompute (trex's, and torchtitan's, full activation checkpointing wraps the whole block, so
         its recompute dispatches and combines again; selective recompute keeps the MoE's tensors);
  Engram (V4.1) the all-to-all lookup over every rank: per token and table, its row ids and rows
         there and back, and the rows' gradients back when the tables train (counted with EP);
  CP     per layer and micro-batch, forward and backward (and again in a recompute): the halo
         exchange of the layer's input rows with the neighbours, the all-gather of the compressed
         entries (and the indexer's keys, forward only), the reduce-scatter of their gradients; for
         the DeepSeek-V3 family no halo, the all-gather of every row's MLA latent and k_pe
         (kv_lora_rank + qk_rope_head_dim values a token) and the reduce-scatter of its gradient
         (and V3.2's index keys, forward only).
  TP     per micro-batch, the family's ``tp_traffic`` (its collectives per layer, forward, backward and again
         in a recompute, and the embedding's and heads'), as trex.parallel.tensor_parallel runs them: with
         sequence parallelism (``Layout.sequence_parallel``, the default) all-gathers and reduce-scatters of
         [mb x S / cp, hidden] around each region, without it all-reduces of the regions' outputs; both sum the
         gradients of what enters a region. An expert-parallel group spanning the TP ranks all-gathers the
         gradients of each MoE layer's dispatched rows and routing weights over them (backward), and without
         sequence parallelism its outputs too (forward, and again in a full recompute).
         TP ranks are adjacent: a group within a node runs at the intra-node link.
         ``tp_overlap`` (default 0, as torchtitan without async TP) hides it. Every TP rank also runs the
         matmuls TP leaves whole (``ModelFacts.tp_whole_matmul``: the attention's and the router's) on all
         of the group's rows: ``tp - 1`` extra copies of that work, in the compute time, not in the MFU.
Expert parallelism spans dp_shard x cp x tp ranks (trex.plan.layout): the all-to-all of each rank's own rows
(mb x S / (cp x tp)); FSDP gathers a TP rank's 1 / tp of the split parameters over dp_shard x cp ranks spaced
tp apart, the experts over dp_shard x cp x tp / ep ranks spaced ep apart.
Context-parallel ranks of one group wait for the busiest (the family's ``busiest_shard_flops``): for V4 and
V4.1, with contiguous shards, the last one, whose queries see the most compressed entries (HCA attention and
the CSA indexer's scores grow with the position); its FLOPs per token are the mean over the last S / cp
positions. The V3 family's shards do equal work (the dense document-causal mask skips nothing), the mean per
token, plus the ``wkv_b`` expansion of the other ranks' rows (none for V3.2's absorbed sparse MLA).
What depends on the family (busiest shard, CP traffic, MoE and dense layers, the Engram lookup) comes from its
plan terms (trex.plan.terms; their list: trex.models.common.plan_terms).
A group of g ranks runs at the intra-node bandwidth when it fits in one node, at the
inter-node bandwidth otherwise. ``fsdp_overlap`` / ``ep_overlap`` of that time hides behind
compute (never more than the compute itself). Optimizer: the Newton-Schulz FLOPs of Muon split
over the shard group, and, with offload, the moments crossing the host link twice.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from trex.hardware import HardwareProfile
from trex.models.common.flops import FlopsPerToken
from trex.models.flops import flops_per_token
from trex.models.registry import AnyConfig
from trex.plan.layout import Layout
from trex.plan.model_facts import ModelFacts
from trex.plan.terms import terms


_FLOPS_CACHE: dict[tuple[str, int], FlopsPerToken] = {}


def training_flops(cfg: AnyConfig, seq_len: int) -> FlopsPerToken:
    """`flops_per_token` (training), memoised: a search evaluates hundreds of layouts of one model."""
    key = (repr(cfg), seq_len)
    if key not in _FLOPS_CACHE:
        _FLOPS_CACHE[key] = flops_per_token(cfg, seq_len)
    return _FLOPS_CACHE[key]


@dataclass(frozen=True)
class TimeAssumptions:
    compute_efficiency: float = 0.55  # achieved / peak FLOP/s of the model's kernels while computing
    fsdp_overlap: float = 0.9  # share of FSDP traffic hidden behind compute (prefetch)
    ep_overlap: float = 0.5  # share of EP all-to-all hidden behind compute
    cp_overlap: float = 0.0  # share of CP traffic hidden behind compute (eager trex waits for each)
    tp_overlap: float = 0.0  # share of TP traffic hidden behind compute (torchtitan without async TP waits for each)
    dtype: str = "bf16"


@dataclass(frozen=True)
class StepTime:
    """Seconds per optimizer step on every device (they run in lockstep)."""

    compute: float
    recompute: float
    fsdp_comm: float
    ep_comm: float
    cp_comm: float
    tp_comm: float
    exposed_comm: float
    bubble: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.compute + self.recompute + self.exposed_comm + self.bubble + self.optimizer

    def as_dict(self) -> dict:
        return {**asdict(self), "total": self.total}


def recompute_flops_per_token(cfg: AnyConfig, seq_len: int, recompute: str) -> float:
    """Forward FLOPs repeated in backward. Selective: mHC and attention (everything but the MoE)."""
    f = training_flops(cfg, seq_len)
    if recompute == "none":
        return 0.0
    trained_forward = (f.total - f.indexer) / 3
    if recompute == "full":
        return trained_forward + f.indexer
    family = terms(cfg)
    layers = family.moe_layers(cfg, cfg.num_hidden_layers) + family.mtp_blocks(cfg)
    moe_dense = 2 * layers * (cfg.n_routed_experts + 3 * cfg.moe_intermediate_size * cfg.n_shared_experts) * cfg.hidden_size
    moe_dense += family.dense_ffn_flops(cfg)
    return (f.dense_matmuls + f.attention_core) / 3 - moe_dense + f.indexer


def busiest_shard_flops(cfg: AnyConfig, seq_len: int, cp: int) -> float:
    """Training FLOPs per token of the busiest of ``cp`` context-parallel shards (the family's rule)."""
    if cp == 1:
        return training_flops(cfg, seq_len).total
    return terms(cfg).busiest_shard_flops(cfg, seq_len, cp, lambda n: training_flops(cfg, n).total)


def tp_traffic(cfg: AnyConfig, layout: Layout, seq_len: int, b: int) -> float:
    """Ring-collective buffer bytes one TP rank takes part in per micro-batch (an all-reduce counts twice: a
    reduce-scatter and an all-gather), the family's ``tp_traffic`` of a context-parallel rank's rows through one
    pipeline stage; 0 without TP."""
    if layout.tp == 1:
        return 0.0
    family = terms(cfg)
    layers = cfg.num_hidden_layers // layout.pp
    total = family.tp_traffic(cfg, seq_len, b, layout.recompute, layers, layout.cp, layout.sequence_parallel)
    if layout.ep > 1:  # the expert-parallel group spans the TP ranks (trex.parallel.expert_parallel): each rank
        # dispatches its 1 / tp of the rows, backward all-gathers the gradients of their input [S, hidden] and of their
        # fp32 routing weights [S, k]; without sequence parallelism the outputs are all-gathered forward (again in a
        # full recompute)
        rows, moe = seq_len // layout.cp, family.moe_layers(cfg, layers) + family.mtp_blocks(cfg)
        per_layer = b * rows * cfg.hidden_size + 4 * rows * cfg.num_experts_per_tok
        if not layout.sequence_parallel:
            per_layer += (2 if layout.recompute == "full" else 1) * b * rows * cfg.hidden_size
        total += moe * per_layer
    return layout.micro_batch * total


def tp_whole_flops(cfg: AnyConfig, facts: ModelFacts, seq_len: int, tp: int, recompute: str) -> tuple[float, float]:
    """(training, recomputed) FLOPs per token that each of ``tp`` TP ranks runs beyond its 1 / tp share, on the
    other ranks' rows: the trained matmuls TP leaves whole (``ModelFacts.tp_whole_matmul``: 2 forward + 4 backward
    FLOPs a weight; their forward again under full recompute) and, where TP leaves it whole
    (``ModelFacts.tp_whole_indexer``: V4's), the frozen indexer's forward (again under any recompute, as
    :func:`recompute_flops_per_token` counts it)."""
    if tp == 1:
        return 0.0, 0.0
    matmul = 6 * facts.tp_whole_matmul * (tp - 1)
    indexer = training_flops(cfg, seq_len).indexer * (tp - 1) if facts.tp_whole_indexer else 0.0
    again = {"none": 0.0, "selective": indexer, "full": matmul / 3 + indexer}[recompute]
    return matmul + indexer, again


def _bandwidth(group: int, hw: HardwareProfile, span: int = 1) -> float:
    """Bytes/s between ranks of a group of ``group`` spaced ``span`` apart: intra-node when it fits."""
    within_node = group * span <= hw.devices_per_node
    return (hw.intra_node_gbps if within_node else hw.inter_node_gbps) * 1e9


def _group_seconds(nbytes: float, group: int, hw: HardwareProfile, span: int = 1) -> float:
    """A ring collective moving ``nbytes`` in a group of ``group`` ranks spaced ``span`` apart."""
    if group <= 1:
        return 0.0
    return nbytes * (group - 1) / group / _bandwidth(group, hw, span)


def step_time(cfg: AnyConfig, facts: ModelFacts, layout: Layout, seq_len: int, hw: HardwareProfile,
              assume: TimeAssumptions, b: int) -> StepTime:
    tokens_per_device = layout.micro_batch * seq_len * layout.grad_accum * layout.dp_replicate * layout.dp_shard \
        / layout.devices
    rate = hw.peak_flops(assume.dtype) * assume.compute_efficiency
    whole, whole_again = tp_whole_flops(cfg, facts, seq_len, layout.tp, layout.recompute)
    kernel = terms(cfg).kernel_extra_flops(cfg, seq_len)  # e.g. V3.2's absorbed sparse MLA; the attention is
    kernel_again = kernel / 3 if layout.recompute != "none" else 0.0  # recomputed under either recompute
    split_i, whole_i = terms(cfg).indexer_training_flops(cfg, seq_len) if layout.train_indexer else (0.0, 0.0)
    indexer = split_i + layout.tp * whole_i  # a TP rank runs its heads' share and all of the rest on every row
    compute = tokens_per_device * (busiest_shard_flops(cfg, seq_len, layout.cp) + whole + kernel + indexer) / rate
    recompute = tokens_per_device * (recompute_flops_per_token(cfg, seq_len, layout.recompute) + whole_again
                                     + kernel_again) / rate

    micro, tp = layout.grad_accum, layout.tp
    shard, ef = layout.fsdp, layout.expert_fsdp
    dense = facts.per_tp_rank(facts.dense, facts.tp_whole_stored, tp) / layout.pp  # a TP rank's share
    experts = facts.experts / layout.pp / layout.ep
    gather = 2 * micro * (_group_seconds(b * dense, shard, hw, tp) + _group_seconds(b * experts, ef, hw, layout.ep))
    reduce = _group_seconds(4 * dense, shard, hw, tp) + _group_seconds(4 * experts, ef, hw, layout.ep)
    reduce *= micro if layout.reduce_every_micro_batch else 1
    stored = facts.per_tp_rank(facts.stored, facts.tp_whole_stored, tp)
    replicate = 2 * _group_seconds(4 * stored / layout.pp / shard, layout.dp_replicate, hw, shard * tp)
    fsdp = gather + reduce + replicate

    family = terms(cfg)
    layers = family.moe_layers(cfg, cfg.num_hidden_layers // layout.pp) + family.mtp_blocks(cfg)
    passes = 6 if layout.recompute == "full" else 4  # dispatch + combine, forward + backward (+ the recompute's)
    a2a_bytes = passes * b * layout.micro_batch * seq_len * cfg.num_experts_per_tok * cfg.hidden_size * layers * micro
    ep = _group_seconds(a2a_bytes / layout.cp / tp, layout.ep, hw)
    if facts.engram_tables:  # fp32 rows (and their gradients when trained) and int64 ids, every table
        per_token = family.table_lookup_bytes(cfg, layout.train_engram)
        passes = 2 if layout.recompute == "full" else 1  # a recomputed block looks its rows up again
        ep += _group_seconds(passes * per_token * layout.micro_batch * seq_len * micro / layout.cp, layout.devices, hw)
    cp = 0.0
    if layout.cp > 1:  # a recompute (selective or full) runs the attention's collectives again
        passes = micro * layout.micro_batch * (1.5 if layout.recompute != "none" else 1)
        halo, gathered = family.cp_traffic(cfg, seq_len, b)
        cp = passes * (halo / _bandwidth(layout.cp, hw) + _group_seconds(gathered, layout.cp, hw))

    tp_comm = micro * _group_seconds(tp_traffic(cfg, layout, seq_len, b), tp, hw)

    busy = compute + recompute
    hidden = min(busy, assume.fsdp_overlap * fsdp + assume.ep_overlap * ep + assume.cp_overlap * cp
                 + assume.tp_overlap * tp_comm)
    exposed = fsdp + ep + cp + tp_comm - hidden
    bubble = (layout.pp - 1) / layout.grad_accum * busy if layout.pp > 1 else 0.0

    optimizer = 0.0
    if layout.optimizer == "muon":
        optimizer += facts.muon_ns_flops / (layout.fsdp * layout.pp * tp) / rate
    if layout.offload_optimizer:
        trainable, muon = facts.trained_per_tp_rank(tp, layout.train_indexer)
        state = (4 * muon + 8 * (trainable - muon)) if layout.optimizer == "muon" else 8 * trainable
        link = hw.host_link_gbps or hw.inter_node_gbps
        optimizer += 2 * state / (layout.fsdp * layout.pp) / (link * 1e9)
    return StepTime(compute=compute, recompute=recompute, fsdp_comm=fsdp, ep_comm=ep, cp_comm=cp, tp_comm=tp_comm,
                    exposed_comm=exposed, bubble=bubble, optimizer=optimizer)
