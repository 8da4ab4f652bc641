"""One optimizer step, shaped for accelerators: from the first forward to the router-bias update it
never waits for the host.

    objective.step       forward + backward of the micro-batches (gradients in .grad, scaled)
    unscale, clip        the global grad norm and the clipping factor stay on the device
    guard.finite         [loss finite, grad norm finite] on the device
    optimizer.step       with apply = both finite: a non-finite step changes no state, on the device
    router bias          the same flag gates the aux-loss-free bias update

The step returns device tensors; :func:`read_scalars` then reads everything the loop logs and the
guard needs in ONE device-to-host transfer (the step's logging point). Exceptions, documented where
they happen: expert parallelism reads the all-to-all split sizes once per MoE layer forward
(trex.parallel.expert_parallel), and fidelity recording, on the steps it is due, reads its
per-group gradient norms (trex.train.signals).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trex.parallel.mesh import Parallel
from trex.parallel.preflight import collective_context
from trex.posttrain.objective import Objective, StepResult
from trex.train.moe_balance import sum_expert_counts, update_router_bias
from trex.train.optim import clip_grad_norm
from trex.precision import StepGuard


@dataclass
class StepOutput:
    """What one step leaves on the device for the loop's one read."""

    result: StepResult
    grad_norm: torch.Tensor
    """0-d: the global grad norm before clipping (unscaled)."""
    finite: torch.Tensor
    """[2] bool: loss finite, grad norm finite; the update was applied where both are."""
    loads: dict[str, torch.Tensor]
    """Per MoE layer, tokens routed to each expert this step ([E], summed over ranks when reduced)."""


def train_step(model, objective: Objective, optimizer, params: list[torch.Tensor], guard: StepGuard,
               step: int, *, grad_clip: float, bias_gamma: float, par: Parallel, fidelity=None) -> StepOutput:
    """Run optimizer step ``step`` (0-based) and return its results as device tensors (no host read)."""
    with collective_context(par, step, "forward/backward (FSDP all-gather/reduce-scatter, MoE all-to-all) "
                                       "and loss all-reduce"):
        result = objective.step(model, step, guard.scaler)
    with collective_context(par, step, "gradient sync and norm"):
        guard.scaler.unscale_(params)
        if fidelity is not None:
            fidelity.record_grad_norms(step + 1, model)  # unscaled, before clipping
        grad_norm = clip_grad_norm(params, grad_clip)
    finite = guard.finite(result.loss, grad_norm)
    apply = finite.all()
    with collective_context(par, step, "optimizer step (Muon gathers) and router-bias all-reduce"):
        optimizer.step(apply=apply)
        if bias_gamma:
            reduce = par.all_reduce_sum if par.distributed else None
            loads = update_router_bias(model, result.moe_stats, bias_gamma, reduce, apply=apply)
        else:
            loads = sum_expert_counts(result.moe_stats)
    optimizer.zero_grad(set_to_none=True)
    return StepOutput(result, grad_norm, finite, loads)


def read_scalars(values: dict[str, float | int | torch.Tensor]) -> dict[str, float]:
    """Python floats for every value, with all 0-d tensors read in one device-to-host transfer
    (stacked as fp64 on the first tensor's device). Plain numbers pass through."""
    tensors = {k: v for k, v in values.items() if isinstance(v, torch.Tensor)}
    out = {k: float(v) for k, v in values.items() if k not in tensors}
    if tensors:
        dev = next(iter(tensors.values())).device
        read = torch.stack([t.detach().reshape(()).to(device=dev, dtype=torch.float64)
                            for t in tensors.values()]).tolist()
        out.update(zip(tensors, read))
    return {k: out[k] for k in values}
