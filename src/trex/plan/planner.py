"""A plan: parameters, memory per device, fit, step time, throughput and MFU for one layout; and the
search over layouts that fit, fastest first."""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass

from trex.hardware import HardwareProfile
from trex.logs import plural
from trex.models.registry import AnyConfig, drafter_kind
from trex.plan.drafter import DrafterPlan, drafter_plan
from trex.plan.layout import Layout, PlanError, Trained, check_context_parallel, check_tensor_parallel
from trex.plan.memory import HEADROOM, MemoryBreakdown, memory
from trex.plan.model_facts import ModelFacts, model_facts
from trex.plan.terms import terms
from trex.plan.timing import StepTime, TimeAssumptions, step_time, training_flops

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
GiB = 2**30


@dataclass(frozen=True)
class Plan:
    layout: Layout
    seq_len: int
    hardware: HardwareProfile
    facts: ModelFacts
    memory: MemoryBreakdown
    time: StepTime
    flops_per_token: float
    assumptions: TimeAssumptions
    routed_experts: int = 0  # per MoE layer (the model's n_routed_experts): what ep must divide
    model_notes: tuple[str, ...] = ()  # how the family's plan terms model this config (their ``notes``)
    drafter: DrafterPlan | None = None  # a recipe's [drafter] re-fit (trex.plan.drafter)

    @property
    def usable_bytes(self) -> float:
        return self.hardware.memory_gib * GiB * (1 - HEADROOM)

    @property
    def host_fits(self) -> bool | None:
        """Offloaded state vs host memory per device (None when the profile states no host memory)."""
        if not self.layout.offload_optimizer:
            return True
        if not self.hardware.host_memory_gib:
            return None
        per_device = self.hardware.host_memory_gib * GiB / self.hardware.devices_per_node
        return self.memory.optimizer_host <= per_device * (1 - HEADROOM)

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.usable_bytes and self.host_fits is not False

    @property
    def global_batch_tokens(self) -> int:
        return self.layout.global_batch_tokens(self.seq_len)

    @property
    def tokens_per_s_per_device(self) -> float:
        return self.global_batch_tokens / self.time.total / self.layout.devices

    @property
    def mfu(self) -> float:
        return self.tokens_per_s_per_device * self.flops_per_token / self.hardware.peak_flops(self.assumptions.dtype)

    @property
    def notes(self) -> list[str]:
        out = []
        if refusal := self.layout.train_refusal():
            out.append(refusal)
        if self.layout.tp > 1 and self.layout.ep == 1:
            out.append("tp > 1, ep = 1: routed experts are planned as torchtitan places them (each TP rank dispatches "
                       "its 1/tp of the rows); trex train runs them on every rank of a TP group, on the same rows")
        if self.host_fits is None:
            out.append(f"{self.hardware.name} states no host memory: offloaded state is not checked")
        if ep_note := expert_parallel_note(self.layout, self.routed_experts):
            out.append(ep_note)
        return out + list(self.model_notes)


def expert_parallel_note(layout: Layout, experts: int) -> str | None:
    """Why a layout runs without expert parallelism when its shard group has ranks to split experts
    over but no ep > 1 divides both (ep must divide dp_shard and the routed experts); None otherwise."""
    shard = layout.dp_shard
    if layout.ep != 1 or shard == 1 or experts <= 1 or math.gcd(shard, experts) != 1:
        return None
    # the shard size nearest this one (within an eighth) that splits the experts widest
    near = range(max(2, shard - max(1, shard // 8)), shard + max(1, shard // 8) + 1)
    better = max(near, key=lambda n: (math.gcd(n, experts), -abs(n - shard)))
    others = layout.devices // shard
    devices = f"--devices {better * others} (dp_shard={better})" if others == 1 else f"dp_shard={better}"
    return (f"expert parallelism off (ep=1): ep must divide both dp_shard={shard} and the model's {experts} routed "
            f"experts, and only 1 divides both, so FSDP gathers all {experts} experts of each layer on every rank "
            f"(fsdp_comm); choose a shard size that shares a factor with {experts}, e.g. {devices}, which allows up to "
            f"ep={math.gcd(better, experts)}")


def make_plan(cfg: AnyConfig, layout: Layout, seq_len: int, hw: HardwareProfile,
              assume: TimeAssumptions = TimeAssumptions(), fitting_only: bool = False) -> Plan | None:
    """The plan of ``layout``: memory per device, then the step's time. ``fitting_only``: None for a layout
    that does not fit, its time not computed (what a search needs of the many layouts it rejects)."""
    layout.check(cfg, seq_len)
    if assume.dtype not in DTYPE_BYTES:
        raise PlanError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {assume.dtype!r}")
    if assume.dtype not in hw.peak_tflops:
        raise PlanError(f"hardware profile {hw.name!r} has no {assume.dtype} peak; it has {sorted(hw.peak_tflops)}")
    b = DTYPE_BYTES[assume.dtype]
    facts = model_facts(cfg)
    plan = Plan(layout=layout, seq_len=seq_len, hardware=hw, facts=facts,
                memory=memory(cfg, facts, layout, seq_len, b), time=None,
                flops_per_token=training_flops(cfg, seq_len).total, assumptions=assume,
                routed_experts=cfg.n_routed_experts, model_notes=tuple(terms(cfg).notes(cfg, layout.tp)))
    if fitting_only and not plan.fits:
        return None
    return dataclasses.replace(plan, time=step_time(cfg, facts, layout, seq_len, hw, assume, b))


def with_drafter(plan: Plan, cfg, section, main_steps: int) -> Plan:
    """``plan`` with the re-fit of ``section`` (a recipe's enabled DrafterSection) counted (``plan.drafter``)."""
    if drafter_kind(cfg) is None:
        raise PlanError("[drafter] enabled: the model has no drafter to re-fit (DeepSeek-V4.1's DSpark stages: "
                        "num_nextn_predict_layers and dspark_target_layer_ids; or the multi-token prediction modules "
                        "of DeepSeek-V4 and the V3 family: num_nextn_predict_layers > 0)")
    b = DTYPE_BYTES[plan.assumptions.dtype]
    refit = drafter_plan(cfg, section, plan.layout, plan.seq_len, plan.hardware, plan.assumptions, b, plan.memory,
                         plan.facts, main_steps)
    return dataclasses.replace(plan, drafter=refit)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def search(cfg: AnyConfig, devices: int, seq_len: int, global_batch_tokens: int, hw: HardwareProfile,
           assume: TimeAssumptions = TimeAssumptions(), optimizer: str = "muon",
           micro_batches: tuple[int, ...] = (1, 2, 4), recompute: tuple[str, ...] = ("none", "selective", "full"),
           pipeline: tuple[int, ...] = (1,), fitting_only: bool = True,
           offload: tuple[bool, ...] = (False, True), largest_ep_only: bool = False,
           trained: Trained = Trained(), tensor: tuple[int, ...] | None = None,
           runnable_only: bool = True) -> list[Plan]:
    """Every layout on ``devices`` devices that fits (every one, with ``fitting_only=False``) and
    reaches ``global_batch_tokens`` exactly, fastest first; ``offload`` and ``largest_ep_only``
    narrow the options tried; ``trained``: what trains beyond the default (trex.plan.layout.Trained). tp ranges
    over ``tensor`` (default :func:`tensor_parallel_sizes`: within a node, dividing what TP splits), cp over the
    divisors of the devices left that split the sequence (see trex.models.registry.check_shardable), shard
    sizes over the divisors of what it leaves; ep divides the expert count and dp_shard x tp (the search carves
    experts from those; an explicit layout may span cp too). ``runnable_only`` (the default, and what the default
    plan, the nearest fitting layout and the fewest devices use): only layouts trex train runs today
    (Layout.train_refusal None: ep inside dp_shard, no pipeline stages)."""
    if global_batch_tokens % seq_len:
        raise PlanError(f"global batch of {global_batch_tokens} tokens is not a whole number of "
                        f"{seq_len}-token sequences")
    Layout(dp_shard=1).check(cfg, seq_len)
    plans = []
    for pp, tp in itertools.product(pipeline, tensor_parallel_sizes(cfg, devices, hw) if tensor is None else tensor):
        if devices % (pp * tp) or cfg.num_hidden_layers % pp:
            continue
        for cp, shard in ((c, s) for c in _context_parallel_sizes(cfg, seq_len, devices // pp // tp)
                          if (seq_len // c) % tp == 0 for s in _divisors(devices // pp // tp // c)):
            replicate = devices // pp // tp // cp // shard
            eps = [e for e in _divisors(shard * tp) if cfg.n_routed_experts % e == 0 and not (
                runnable_only and Layout(dp_shard=shard, ep=e, cp=cp, tp=tp, pp=pp).train_refusal())]
            for ep in eps[-1:] if largest_ep_only else eps:
                for mb in micro_batches:
                    rows = global_batch_tokens // seq_len
                    if rows % (mb * shard * replicate):
                        continue
                    ga = rows // (mb * shard * replicate)
                    reduce_options = (False, True) if ga > 1 and shard > 1 else (False,)
                    for rc, off, every in itertools.product(recompute, offload, reduce_options):
                        layout = Layout(dp_shard=shard, dp_replicate=replicate, ep=ep, cp=cp, tp=tp, pp=pp, micro_batch=mb,
                                        grad_accum=ga, recompute=rc, optimizer=optimizer, offload_optimizer=off,
                                        reduce_every_micro_batch=every, train_engram=trained.engram,
                                        train_indexer=trained.indexer)
                        plan = make_plan(cfg, layout, seq_len, hw, assume, fitting_only)
                        if plan is not None:
                            plans.append(plan)
    return sorted(plans, key=lambda p: p.time.total)


CHOICES = ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep", "micro_batch", "recompute", "offload_optimizer",
           "reduce_every_micro_batch")  # what a layout chooses (grad_accum follows from the batch)


def layout_changes(frm: Layout, to: Layout) -> list[str]:
    """The choices ``to`` makes differently from ``frm``, as ``name a -> b``."""
    return [f"{k} {getattr(frm, k)} -> {getattr(to, k)}" for k in CHOICES if getattr(frm, k) != getattr(to, k)]


def nearest_fitting(layout: Layout, plans: list[Plan]) -> Plan | None:
    """Of ``plans`` (fitting ones, e.g. :func:`search`'s), the one whose layout changes the fewest of ``layout``'s
    choices (CHOICES), the fastest among equals; None when there are none."""
    fitting = [p for p in plans if p.fits]
    return min(fitting, key=lambda p: (len(layout_changes(layout, p.layout)), p.time.total), default=None)


def no_fit_hint(cfg: AnyConfig, devices: int, seq_len: int, global_batch_tokens: int, hw: HardwareProfile,
                assume: TimeAssumptions = TimeAssumptions(), optimizer: str = "muon", trained: Trained = Trained()) -> str:
    """Why :func:`search` found nothing, naming only what it did not try: the batch does not split over
    any layout, or the leanest layout it tried needs more memory than the device has."""
    tried = search(cfg, devices, seq_len, global_batch_tokens, hw, assume, optimizer, fitting_only=False,
                   trained=trained)
    if not tried:
        return (f"no layout on {plural(devices, 'device')} reaches {global_batch_tokens:,} tokens per step exactly "
                f"(its {global_batch_tokens // seq_len:,} sequences must split evenly over the data-parallel ranks): "
                "change --global-batch-tokens or --devices")
    lean = min(tried, key=lambda p: p.memory.total)
    return (f"the leanest layout tried ({lean.layout.describe()}) needs {lean.memory.total / GiB:.1f} GiB per device, "
            f"{lean.usable_bytes / GiB:.1f} usable; every recompute, offload, micro-batch and shard/ep/cp/tp split trex "
            "train runs was tried: add devices (without --devices, trex plan finds the fewest that fit) or shorten the "
            "sequence")


def tensor_parallel_sizes(cfg: AnyConfig, devices: int, hw: HardwareProfile) -> list[int]:
    """The tp sizes a search tries: powers of two dividing ``devices``, within one node (TP's per-layer
    collectives need the node's link), that divide what TP splits (trex.plan.layout.check_tensor_parallel); 1 for
    a family TP is not planned for."""
    sizes = []
    tp = 1
    while tp <= min(devices, hw.devices_per_node) and devices % tp == 0:
        try:
            check_tensor_parallel(cfg, tp)
        except PlanError:
            break
        sizes.append(tp)
        tp *= 2
    return sizes


def _context_parallel_sizes(cfg: AnyConfig, seq_len: int, devices: int) -> list[int]:
    """The cp sizes a search tries: divisors of ``devices`` that split ``seq_len``."""
    sizes = []
    for cp in _divisors(devices):
        try:
            check_context_parallel(cfg, seq_len, cp)
        except ValueError:
            continue
        sizes.append(cp)
    return sizes


def device_counts(hw: HardwareProfile, limit: int = 1 << 17) -> list[int]:
    """The device counts a cluster is built from: 1, 2, 4, ... up to one node, then whole nodes."""
    node = hw.devices_per_node
    small = [1 << i for i in range(node.bit_length()) if (1 << i) < node]
    return [*small, *range(node, limit + 1, node)]


@dataclass(frozen=True)
class Fewest:
    """The answer to "how many devices": the fewest that fit, the most that was tried without a fit
    (None when one device fits) and the fitting layouts there, fastest first."""

    devices: int
    fewer: int | None
    plans: list[Plan]
    global_batch_tokens: int | None  # None: one sequence per device per step


def fewest_devices(cfg: AnyConfig, seq_len: int, hw: HardwareProfile, assume: TimeAssumptions = TimeAssumptions(),
                   optimizer: str = "muon", global_batch_tokens: int | None = None,
                   limit: int = 1 << 17, trained: Trained = Trained()) -> Fewest | None:
    """The fewest devices (of :func:`device_counts`) on which some layout fits, and every layout that
    fits there, fastest first. A count is tried with its leanest layouts (full recompute, one sequence
    per micro-batch, the widest ep of every shard/cp split, with and without offload): if none fits,
    no layout does. Memory per device falls as devices are added (every state is sharded over them),
    so the counts are doubled until one fits, then the counts in between are tried in order.
    ``global_batch_tokens`` None plans one sequence per device per step; a fixed batch keeps the
    counts that divide its sequences. None when nothing up to ``limit`` fits."""
    counts = device_counts(hw, limit)
    if global_batch_tokens is not None:
        if global_batch_tokens % seq_len:
            raise PlanError(f"global batch of {global_batch_tokens} tokens is not a whole number of "
                            f"{seq_len}-token sequences")
        counts = [n for n in counts if (global_batch_tokens // seq_len) % n == 0]

    def fitting(n: int, lean: bool) -> list[Plan]:
        batch = global_batch_tokens or n * seq_len
        if lean:  # the least memory: one sequence, full recompute, experts split widest
            return search(cfg, n, seq_len, batch, hw, assume, optimizer, micro_batches=(1,), recompute=("full",),
                          largest_ep_only=True, trained=trained)
        return search(cfg, n, seq_len, batch, hw, assume, optimizer, trained=trained)

    lo, hi, step = -1, None, 1  # indices into counts: counts[lo] does not fit, counts[hi] fits
    while hi is None:
        i = min(lo + step, len(counts) - 1)
        if i <= lo:
            return None
        if fitting(counts[i], lean=True):
            hi = i
        else:
            lo, step = i, step * 2
    # between the last count that did not fit and the first that did, ascending: not a bisection, since a
    # count whose divisors allow no large ep (416 = 2^5 x 13 for 384 experts) can miss where a smaller fits
    first = next(i for i in range(lo + 1, hi + 1) if i == hi or fitting(counts[i], lean=True))
    fewer = counts[first - 1] if first > 0 else None
    return Fewest(counts[first], fewer, fitting(counts[first], lean=False), global_batch_tokens)
