"""Apply the parallel plan to an unchanged DeepseekV4: activation checkpointing, expert parallel,
then FSDP2 per block (and the root) over the data-parallel mesh.

Gradients are summed, not averaged, across ranks (``set_gradient_divide_factor(1.0)``): the loop
divides every loss by the global number of targets, so a step at any layout computes the same
gradient as one process on the whole global batch.
"""

from __future__ import annotations

import functools

from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard
from torch.utils.checkpoint import checkpoint

from trex.models import DeepseekV4
from trex.parallel.expert_parallel import shard_experts
from trex.parallel.mesh import Parallel
from trex.train.precision import PrecisionPolicy


def _recompute(module: nn.Module) -> None:
    """Recompute ``module``'s forward during backward instead of keeping its activations.

    Wraps the instance's forward, so parameter names (and checkpoints) do not change."""
    forward = module.forward

    @functools.wraps(forward)
    def checkpointed(*args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    module.forward = checkpointed


def apply_activation_checkpointing(model: DeepseekV4, mode: str) -> None:
    """none; full (each block); selective (each block's mHC + attention site: hc_attn)."""
    if mode == "none":
        return
    for block in [*model.layers, *model.mtp]:
        _recompute(block if mode == "full" else block.hc_attn)


def apply_parallelism(model: DeepseekV4, par: Parallel, policy: PrecisionPolicy,
                      activation_checkpointing: str = "none") -> list[nn.Parameter]:
    """Returns the expert-parallel parameters."""
    apply_activation_checkpointing(model, activation_checkpointing)
    if not par.distributed:
        return []
    mp = MixedPrecisionPolicy(param_dtype=policy.compute_dtype, reduce_dtype=policy.reduce_dtype)
    experts = shard_experts(model, par.ep_mesh) if par.ep > 1 else []
    if experts:  # expert shards are further sharded over the ranks that hold the same experts
        efsdp = par.mesh["efsdp"].size()
        local_experts = model.cfg.n_routed_experts // par.ep
        # whole experts per rank when they divide evenly, else split every expert's rows (no padding)
        placement = Shard(0) if local_experts % efsdp == 0 else Shard(1)
        for block in [*model.layers, *model.mtp]:
            fully_shard(block.ffn.experts, mesh=par.mesh["dp_replicate", "efsdp"], mp_policy=mp,
                        shard_placement_fn=lambda p: placement)
    for block in [*model.layers, *model.mtp]:
        fully_shard(block, mesh=par.dp_mesh, mp_policy=mp)
    fully_shard(model, mesh=par.dp_mesh, mp_policy=mp)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # plain SUM: gloo has no PREMUL_SUM
    return experts
