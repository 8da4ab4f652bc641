"""Apply the parallel plan to an unchanged model of any family: activation checkpointing, compiled blocks,
tensor parallel, context parallel, expert parallel, then FSDP2 per block (and the root) over the data-parallel
mesh (2-D over the tensor-parallel slices).

Gradients are summed, not averaged, across ranks (``set_gradient_divide_factor(1.0)``): the loop
divides every loss by the global number of targets, so a step at any layout computes the same
gradient as one process on the whole global batch.

Mixed precision is the same at every layout: parameters are stored in fp32 (the master weights the
optimizer updates) and each block sees them in the policy's compute dtype during its forward. FSDP2
does this when it gathers a block (``MixedPrecisionPolicy``); one process uses `ComputeCast` on the
same units (each block, and the root for the parameters outside blocks). Gradients flow back
through the cast, so they reach ``.grad`` in fp32 and accumulate over micro-batches in fp32.
"""

from __future__ import annotations

import contextlib
import functools
import warnings

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard
from torch.utils.checkpoint import checkpoint

from trex.models.common.heads import Model
from trex.parallel.context_parallel import apply_context_parallel
from trex.parallel.engram import shard_engram_tables
from trex.parallel.expert_parallel import shard_experts
from trex.parallel.mesh import Parallel
from trex.parallel.parameter_view import ParameterView
from trex.parallel.tensor_parallel import apply_tensor_parallel, local_view_of
from trex.precision import PrecisionPolicy


class ComputeCast(ParameterView):
    """While entered, the fp32 parameters of ``unit`` (minus those under ``skip``) are seen by the
    forward as casts to ``dtype``; leaving restores them. Entering again while entered does nothing,
    so a region that activation checkpointing recomputes during backward can enter it again and see
    the same low-precision weights as the forward did (as FSDP2 gathers a block again for backward).

    The casts are differentiable: each gradient is computed in ``dtype`` and arrives in the fp32
    parameter's ``.grad`` through the cast, where micro-batches accumulate in fp32. The parameter
    objects never change, so names, the optimizer and checkpoints see fp32 parameters throughout.
    """

    def __init__(self, unit: nn.Module, dtype: torch.dtype, skip: tuple[nn.Module, ...] = ()):
        super().__init__(unit, lambda p: p.is_floating_point(), lambda p: p.to(dtype), skip)


_CAST = "_trex_compute_cast"


def cast_for_compute(model: Model, dtype: torch.dtype) -> None:
    """One process: run each block's forward (and the root's) on ``dtype`` casts of the fp32 parameters.

    Replaces a cast installed by an earlier call (a model carried into the next stage of a job);
    when every parameter is already ``dtype`` (fp32 runs) nothing is installed and the model runs
    exactly as before.
    """
    blocks = (*model.layers, *model.mtp)
    for unit in (model, *blocks):
        old = unit.__dict__.pop(_CAST, None)
        if old is not None:
            old.remove()
    if all(p.dtype == dtype for p in model.parameters() if p.is_floating_point()):
        return
    for unit in (model, *blocks):
        unit.__dict__[_CAST] = ComputeCast(unit, dtype, skip=blocks if unit is model else ())


def _cast_of(unit: nn.Module) -> contextlib.AbstractContextManager:
    return unit.__dict__.get(_CAST) or contextlib.nullcontext()


def _recompute(module: nn.Module, block: nn.Module) -> None:
    """Recompute ``module`` (inside ``block``)'s forward during backward instead of keeping its activations.

    Wraps the instance's forward, so parameter names (and checkpoints) do not change. The
    recomputation enters ``block``'s compute cast, if it has one (one process, low precision), and its
    tensor-parallel local view (trex.parallel.tensor_parallel.LocalView), as the block's hooks did in forward."""
    forward = module.forward

    def run(*args, **kwargs):
        with _cast_of(block), local_view_of(block):
            return forward(*args, **kwargs)

    @functools.wraps(forward)
    def checkpointed(*args, **kwargs):
        return checkpoint(run, *args, use_reentrant=False, **kwargs)

    module.forward = checkpointed


_REDUCE_EVERY = "_trex_reduce_every_micro_batch"
_APPLIED = "_trex_parallel_plan"  # (plan, expert parameters) of a model already sharded


def sync_gradients(model: nn.Module, micro_batch: int, micro_batches: int) -> None:
    """Call before each micro-batch's backward: whether FSDP2 reduce-scatters its gradients.

    Default: only after the last micro-batch (one reduce-scatter per step; FSDP2 accumulates the
    earlier micro-batches' gradients unsharded). With ``reduce_every_micro_batch`` every
    micro-batch is reduce-scattered and sharded gradients accumulate (less memory, more traffic).
    No-op for a model that is not FSDP-sharded."""
    if isinstance(model, FSDPModule):
        every = model.__dict__.get(_REDUCE_EVERY, False)
        model.set_requires_gradient_sync(every or micro_batch == micro_batches - 1)


def apply_activation_checkpointing(model: Model, mode: str) -> None:
    """none; full (each block); selective (each block's attention site: V4's mHC + attention, ``hc_attn``; the
    attention, ``attn``, in a block without mHC, the V3 family's)."""
    if mode == "none":
        return
    for block in [*model.layers, *model.mtp]:
        _recompute(block if mode == "full" else getattr(block, "hc_attn", None) or block.attn, block)


def apply_compile(model: Model, fullgraph: bool = True, backend: str = "inductor") -> None:
    """torch.compile each block's forward (main and MTP blocks), the final mHC head and the fused LM
    head + loss, the torchtitan way: per block, so blocks of one kind share a compiled graph and
    compile time does not grow with depth. Instance attributes are replaced (as activation
    checkpointing does), so parameter names, hooks (FSDP2's gathers run outside the graphs) and
    checkpoints do not change. ``fullgraph``: fail on any graph break; expert parallelism and sharded
    Engram tables pass False, since their one host read of the all-to-all split sizes per layer (per
    table) breaks the graph there.
    ``backend``: torch.compile's (``eager`` traces the graphs without generating code, for checks)."""
    # a checkpointed block's forward records its MoE statistics once (SeqContext.recording) and its
    # recompute in backward records nothing: the side effect is meant not to be replayed
    no_replay = torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True)

    def compile_(fn):
        return no_replay(torch.compile(fn, fullgraph=fullgraph, backend=backend))

    for block in [*model.layers, *model.mtp]:
        block.forward = compile_(block.forward)
    if hasattr(model, "hc_head"):  # DeepSeek-V4's mHC head (V3 has none: its final norm runs in head_nll's caller)
        model.hc_head.forward = compile_(model.hc_head.forward)
    model.head_nll = compile_(model.head_nll)


def apply_parallelism(model: Model, par: Parallel, policy: PrecisionPolicy,
                      activation_checkpointing: str = "none", reduce_every_micro_batch: bool = False,
                      compile: str | None = None) -> list[nn.Parameter]:
    """Returns the expert-parallel parameters. Expects the parameters in fp32 (the master weights).
    ``reduce_every_micro_batch``: see :func:`sync_gradients`. ``compile``: the torch.compile backend of
    the blocks (None: eager). Order: activation checkpointing, compile (:func:`apply_compile`), tensor
    parallelism (trex.parallel.tensor_parallel), context parallelism, expert parallelism, V4.1's Engram tables split over every rank (trex.parallel.engram), FSDP2.

    A sharded model handed to a later stage (the default job's SFT after its CPT) keeps its plan:
    applying the same one again changes nothing, a different one is a ValueError."""
    plan = {"world_size": par.world_size, "dp_replicate": par.dp_replicate, "dp_shard": par.dp_shard, "ep": par.ep,
            "cp": par.cp, "tp": par.tp, "sequence_parallel": par.sequence_parallel,
            "activation_checkpointing": activation_checkpointing, "compile": compile,
            "param_dtype": str(policy.compute_dtype), "reduce_dtype": str(policy.reduce_dtype)}
    if par.distributed and isinstance(model, FSDPModule):
        applied, experts = model.__dict__[_APPLIED]
        if applied != plan:
            changed = {k: (applied[k], plan[k]) for k in plan if applied[k] != plan[k]}
            raise ValueError(f"the model is already sharded for another plan; a later stage must keep it "
                             f"(changed: {changed})")
        model.__dict__[_REDUCE_EVERY] = reduce_every_micro_batch
        return experts
    apply_activation_checkpointing(model, activation_checkpointing)
    if compile:
        # the all-to-alls of expert parallelism and of sharded Engram tables read their sizes on the host
        exchanges = par.ep > 1 or (par.distributed and bool(getattr(model.cfg, "engram_layer_ids", None)))
        apply_compile(model, fullgraph=not exchanges, backend=compile)
    model.__dict__[_REDUCE_EVERY] = reduce_every_micro_batch
    if not par.distributed:
        cast_for_compute(model, policy.compute_dtype)
        return []
    # FSDP2 warns, once per module and rank, that a wrapped module returned a view: an in-place op on it
    # would skip the pre-backward hook. trex never modifies a block's or the model's output in place
    # (the losses are out-of-place; tests/test_gradient_sync.py checks sharded gradients against one
    # process), so the warning says nothing about trex and is filtered here, once.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(\w+\) returned a view tensor",
                            category=UserWarning)
    mp = MixedPrecisionPolicy(param_dtype=policy.compute_dtype, reduce_dtype=policy.reduce_dtype)
    if par.tp > 1:
        apply_tensor_parallel(model, par.tp_mesh, par.sequence_parallel)
    if par.cp > 1:
        apply_context_parallel(model, par.cp_mesh)
    experts = shard_experts(model, par.ep_mesh, par.tp_mesh if par.ep_spans_tp else None) if par.ep > 1 else []
    tables = set(shard_engram_tables(model, par.world_mesh, par.tp))  # rows over every rank, outside FSDP
    if experts:  # expert shards are further sharded over the ranks that hold the same experts
        efsdp = par.expert_dp_mesh.size(1)
        local_experts = model.cfg.n_routed_experts // par.ep
        # whole experts per rank when they divide evenly, else split every expert's rows (no padding)
        placement = Shard(0) if local_experts % efsdp == 0 else Shard(1)
        for block in [*model.layers, *model.mtp]:
            if hasattr(block.ffn, "experts"):  # DeepSeek-V3's first first_k_dense_replace layers are dense
                fully_shard(block.ffn.experts, mesh=par.expert_dp_mesh, mp_policy=mp,
                            shard_placement_fn=lambda p: placement)
    for block in [*model.layers, *model.mtp]:
        fully_shard(block, mesh=par.dp_mesh, mp_policy=mp, ignored_params=tables)
    fully_shard(model, mesh=par.dp_mesh, mp_policy=mp, ignored_params=tables)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # plain SUM: gloo has no PREMUL_SUM
    model.__dict__[_APPLIED] = (plan, experts)
    return experts
