"""Process group and device mesh from the recipe's [parallel] section.

Ranks form a 5-D mesh ("dp_replicate", "efsdp", "ep", "cp", "tp"). The ("dp_replicate", "efsdp", "ep")
ranks are data parallel (each reads its own micro-batches); the "cp" ranks of one data-parallel
index read the same micro-batch and each computes a contiguous shard of its sequences (context
parallelism, trex.parallel.context_parallel); the "tp" ranks, innermost (adjacent), read the same
micro-batch too and each holds a slice of the attention heads, FFN widths and vocabulary (tensor
parallelism, trex.parallel.tensor_parallel). Parameters are sharded over the flattened
("efsdp", "ep", "cp") = "fsdp" dimension (FSDP2, replicated over "dp_replicate" as HSDP; a tensor-parallel
slice is FSDP-sharded again over it, 2-D). Routed experts are split over the expert-parallel group
(``Parallel.ep_mesh``) and their shards are FSDP-sharded again over ("dp_replicate", ("efsdp", "cp")), the
ranks that hold the same experts. With tp > 1 the group spans the tp ranks (torchtitan's expert-tensor-parallel
degree 1): it is ("ep", "tp") flattened, the "ep" dimension holding ep / tp ranks of dp_shard, and each tp rank
dispatches its 1/tp of the group's tokens (trex.parallel.expert_parallel); with tp = 1 it is the "ep" dimension.
"""

from __future__ import annotations

import gc
import os
import warnings
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from trex import device as device_layer
from trex.logs import plural
from trex.recipe import check_choices


@dataclass
class ParallelSection:
    dp_replicate: int = 1
    """Data-parallel replicas (the outer, replicated dimension of HSDP)."""
    dp_shard: int = -1
    """Ranks that shard parameters, gradients and optimizer state (FSDP); -1: all ranks not used by
    dp_replicate."""
    ep: int = 1
    """Expert-parallel size: routed experts are split across this many ranks of the shard dimension; with tp > 1,
    across ep / tp ranks of the shard dimension times the tp ranks (each tp rank dispatches its 1/tp of the
    tokens), so tp must divide it."""
    cp: int = 1
    """Context-parallel size: each sequence is split into this many contiguous shards, one per rank
    (those ranks read the same micro-batches). data.seq_len must split evenly (see trex plan)."""
    activation_checkpointing: Literal["none", "full", "selective"] = "none"
    """none | full | selective (recompute the attention site: V4's mHC and attention, the V3 family's attention)."""
    reduce_every_micro_batch: bool = False
    """With grad_accum > 1: reduce-scatter gradients after every micro-batch, so only sharded fp32
    gradients accumulate (grad_accum reduce-scatters per step). Off: one reduce-scatter after the
    last micro-batch, and FSDP2 keeps the stage's gradients unsharded in between (see trex plan)."""
    tp: int = 1
    """Tensor-parallel size: each block's attention heads, dense FFN and shared-expert widths, and the
    vocabulary of the embedding and head are split over this many adjacent ranks, which read the same
    micro-batches (trex.parallel.tensor_parallel; the model's family declares what it splits)."""
    sequence_parallel: bool = True
    """With tp > 1: the residual stream, the norms and mHC between the split regions hold 1/tp of the rows on each
    tp rank (the norms' outputs all-gathered into a region, its output reduce-scattered out: the traffic of the
    all-reduces they replace), so what a block keeps for backward or recompute is 1/tp. Off: every tp rank keeps
    the whole rows. Generation keeps the whole rows either way."""
    timeout_s: int = 1800
    """Collective timeout in seconds: how long a rank waits in one collective before the backend
    gives up (long enough for a first step that compiles on a large cluster)."""
    heartbeat_timeout_s: float = 300
    """Seconds after which a rank that sends no heartbeat, or is stuck at one place of the loop while
    the others moved on, is named and the job stops (exit 4); 0: off. See trex.parallel.watchdog."""

    def __post_init__(self) -> None:
        check_choices(self, "parallel")
        if (self.dp_replicate < 1 or self.ep < 1 or self.cp < 1 or self.tp < 1
                or (self.dp_shard < 1 and self.dp_shard != -1)):
            raise ValueError("parallel: dp_replicate, ep, cp and tp must be >= 1 and dp_shard >= 1 or -1")
        if self.timeout_s <= 0 or self.heartbeat_timeout_s < 0:
            raise ValueError("parallel: timeout_s must be > 0 and heartbeat_timeout_s >= 0 (0: no heartbeat)")

    def world_size(self, available: int) -> int:
        """Ranks the layout needs given ``available`` ranks (resolving dp_shard = -1)."""
        shard = available // (self.dp_replicate * self.cp * self.tp) if self.dp_shard == -1 else self.dp_shard
        return self.dp_replicate * shard * self.cp * self.tp


@dataclass
class Parallel:
    """This process's place in the run. ``mesh`` is None for a single process."""

    rank: int = 0
    world_size: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    ep: int = 1
    cp: int = 1
    mesh: DeviceMesh | None = None
    tp: int = 1
    summed_group: dist.ProcessGroup | None = None
    """The process group ``all_reduce_sum`` reduces over when tp > 1 (the "summed" mesh dimension's, made once:
    slicing a mesh reads its coordinates on the host); None: every rank."""
    sequence_parallel: bool = True
    """With tp > 1: the rows between the split regions split over the tp ranks (``ParallelSection``)."""

    @property
    def data_rank(self) -> int:
        """This rank's index among the data-parallel ranks (the cp x tp ranks of a group share it)."""
        return self.rank // (self.cp * self.tp)

    @property
    def cp_rank(self) -> int:
        """This rank's place in its context-parallel group (0 .. cp - 1)."""
        return self.rank // self.tp % self.cp

    @property
    def data_world(self) -> int:
        """Data-parallel ranks: distinct micro-batches per micro-step (world_size / (cp x tp))."""
        return self.world_size // (self.cp * self.tp)

    @property
    def summed_ranks(self) -> int:
        """The ranks ``all_reduce_sum`` adds up: every rank but the copies a tensor-parallel group holds of one
        value (world_size / tp). Averages over ranks (balance and indexer losses, DPO's pairs) divide by it."""
        return self.world_size // self.tp

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def dp_mesh(self) -> DeviceMesh:
        """2-D (dp_replicate, fsdp) mesh for FSDP2 (HSDP when dp_replicate > 1); fsdp = dp_shard x cp."""
        return self._sliced("dp_replicate", "fsdp")

    @property
    def expert_dp_mesh(self) -> DeviceMesh:
        """2-D (dp_replicate, efsdp x cp) mesh: the ranks that hold the same routed experts."""
        return self._sliced("dp_replicate", "efsdp_cp")

    @property
    def ep_spans_tp(self) -> bool:
        """Whether the expert-parallel group spans the tp ranks (module docstring)."""
        return ep_spans_tp(self.ep, self.tp)

    @property
    def efsdp(self) -> int:
        """Ranks of dp_shard that hold the same routed experts: dp_shard / ep, or dp_shard / (ep / tp) when the
        expert-parallel group spans the tp ranks."""
        return self.dp_shard * (self.tp if self.ep_spans_tp else 1) // self.ep

    @property
    def ep_mesh(self) -> DeviceMesh:
        """The expert-parallel group: ("ep", "tp") flattened when it spans the tp ranks, else "ep"."""
        return self._sliced("ep_tp") if self.ep_spans_tp else self.mesh["ep"]

    @property
    def cp_mesh(self) -> DeviceMesh:
        return self.mesh["cp"]

    @property
    def tp_mesh(self) -> DeviceMesh:
        return self.mesh["tp"]

    @property
    def world_mesh(self) -> DeviceMesh:
        """1-D mesh of every rank (what V4.1's Engram tables are split over, trex.parallel.engram)."""
        return self._sliced("world")

    def _sliced(self, *names: str) -> DeviceMesh:
        with warnings.catch_warnings():  # slicing a flattened dim: supported, with a deprecation notice
            warnings.simplefilter("ignore", UserWarning)
            return self.mesh[names]

    def all_reduce_sum(self, tensor):
        """Sum ``tensor`` in place over the ranks (over ``summed_ranks``: a tensor-parallel group's ranks hold
        the same value, each group adds it once)."""
        if self.distributed:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.summed_group)
        return tensor


def ep_spans_tp(ep: int, tp: int) -> bool:
    """Whether the expert-parallel group spans the tp ranks (ep / tp shard ranks x tp): with tp > 1 it always
    does (ep = 1: no expert parallelism, each tp rank runs every expert on the same tokens)."""
    return tp > 1 and ep > 1


def resolve_layout(dp_replicate: int, dp_shard: int, ep: int, world_size: int, cp: int = 1,
                   tp: int = 1) -> tuple[int, int, int]:
    """Check the layout against the world size; dp_shard = -1 takes the ranks dp_replicate, cp and tp leave."""
    if world_size % (dp_replicate * cp * tp):
        raise ValueError(f"parallel.dp_replicate x cp x tp = {dp_replicate} x {cp} x {tp} does not divide the world "
                         f"size {world_size}")
    shard = world_size // (dp_replicate * cp * tp) if dp_shard == -1 else dp_shard
    if dp_replicate * shard * cp * tp != world_size:
        raise ValueError(f"parallel: dp_replicate ({dp_replicate}) x dp_shard ({shard}) x cp ({cp}) x tp ({tp}) = "
                         f"{plural(dp_replicate * shard * cp * tp, 'rank')}, but the run has {world_size} "
                         f"(torchrun --nproc-per-node x --nnodes)")
    check_expert_split(shard, ep, tp)
    return dp_replicate, shard, ep


def check_expert_split(dp_shard: int, ep: int, tp: int = 1) -> None:
    """ValueError unless trex can split the routed experts over ``ep`` ranks: inside dp_shard (tp = 1), or over
    ep / tp ranks of dp_shard times the tp ranks (tp > 1, ``ep_spans_tp``); never over context-parallel ranks.
    trex.plan asks this too (trex.plan.layout.Layout.train_refusal), so a search offers only layouts trex train
    runs."""
    if ep_spans_tp(ep, tp) and (ep % tp or dp_shard % (ep // tp)):
        raise ValueError(f"parallel.ep = {ep} spans the tp ranks: it must be tp ({tp}) times a divisor of dp_shard "
                         f"({dp_shard})")
    if not ep_spans_tp(ep, tp) and dp_shard % ep:
        raise ValueError(f"parallel.ep = {ep} must divide dp_shard = {dp_shard}")


def attempt_store(timeout: timedelta) -> dist.Store | None:
    """The store in which this launch attempt's ranks meet, when torchrun's agent hosts it (None: let
    ``init_process_group`` make its own from the environment).

    torchrun's agent keeps one TCPStore for the whole job and gives the workers of every restart
    (``--max-restarts``) the same address, and env:// adds no per-attempt prefix: a restarted process
    group would read the keys the failed one left, gloo the dead ranks' addresses ("connectFullMesh
    failed ... Connection refused") or a barrier's stale counter, and fail or wait. The keys of
    attempt N live under ``trex/attempt_N/`` instead."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"trex/attempt_{attempt}/", dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout))


def init_parallel(dp_replicate: int, dp_shard: int, ep: int, timeout_s: int,
                  dev: device_layer.Device, world_size: int | None = None, trace_dir: str | None = None,
                  cp: int = 1, tp: int = 1, sequence_parallel: bool = True) -> Parallel:
    """Join the process group (torchrun's environment) and build the mesh; a no-op for one process.
    With ``trace_dir``, a backend with a flight recorder dumps each rank's last collectives there
    (``rank_<r>``) when one times out; variables already set in the environment win."""
    world_size = world_size or int(os.environ.get("WORLD_SIZE", "1"))
    replicate, shard, ep = resolve_layout(dp_replicate, dp_shard, ep, world_size, cp, tp)
    if world_size == 1:
        return Parallel()
    if not dist.is_initialized():
        recorder = dev.flight_recorder_env(os.path.join(trace_dir, "rank_")) if trace_dir else {}
        if recorder:
            os.makedirs(trace_dir, exist_ok=True)
        for key, value in recorder.items():
            os.environ.setdefault(key, value)
        timeout = timedelta(seconds=timeout_s)
        store = attempt_store(timeout)
        dist.init_process_group(backend=dev.backend(), timeout=timeout, store=store,
                                **({"rank": int(os.environ["RANK"]), "world_size": world_size} if store else {}))
    ep_shard = ep // tp if ep_spans_tp(ep, tp) else ep  # the expert-parallel ranks inside dp_shard
    mesh = init_device_mesh(dev.type, (replicate, shard // ep_shard, ep_shard, cp, tp),
                            mesh_dim_names=("dp_replicate", "efsdp", "ep", "cp", "tp"))
    mesh["efsdp", "ep", "cp"]._flatten("fsdp")
    mesh["efsdp", "cp"]._flatten("efsdp_cp")
    mesh["dp_replicate", "efsdp", "ep", "cp"]._flatten("summed")
    mesh["dp_replicate", "efsdp", "ep", "cp", "tp"]._flatten("world")
    if ep_spans_tp(ep, tp):
        mesh["ep", "tp"]._flatten("ep_tp")
    par = Parallel(dist.get_rank(), world_size, replicate, shard, ep, cp, mesh, tp, sequence_parallel=sequence_parallel)
    if tp > 1:
        par.summed_group = par._sliced("summed").get_group()
    return par


def shutdown_distributed() -> None:
    """Leave the process group at the end of a run: a barrier (no rank tears the group down while
    another still talks to it), then destroy it while the interpreter is fully alive.

    Call it once the model, optimizer and mesh are out of scope. FSDP state holds its process groups in
    reference cycles; a group still alive at interpreter exit is destroyed during finalisation, where
    gloo's worker threads can abort the process (``terminate called without an active exception``,
    SIGABRT) after a run that succeeded. Collecting the cycles before and after the destroy frees every
    group here instead. A no-op for a single process."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    dist.barrier()
    gc.collect()
    dist.destroy_process_group()
    gc.collect()
