"""Expert parallelism: routed experts split over the "ep" mesh dimension, tokens moved by all-to-all.

Each rank keeps E/ep whole experts: the stacked w1/w2/w3 become DTensors sharded on dim 0 over the
ep mesh, so their names and global shapes are unchanged (checkpoints reshard across layouts). A
forward sends every (token, expert) pair to the rank owning the expert with one variable-size
all-to-all, runs the local experts with the model's own grouped FFN, and brings the results back
with a second all-to-all; autograd runs the same exchanges in reverse.

When the group spans the tensor-parallel ranks (``shard_experts``' ``tp_mesh``: torchtitan's expert-tensor-parallel
degree 1), the tp ranks of a group hold the same tokens, routed the same way (the router is replicated): each
dispatches only its 1/tp of them (the rows padded to a multiple of tp with rows of routing weight 0, exact and of
static shape), and the group all-gathers the outputs (the gather's backward keeps this rank's rows; the split's
gathers the group's gradients, so the MoE input's gradient is whole on every rank, as the replicated parts expect).
Under sequence parallelism no gather: each rank's outputs, in zeros elsewhere, are a partial of the MoE's output,
which the group reduce-scatters with the shared experts' (trex.parallel.tensor_parallel).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Shard, distribute_tensor

from trex.models.common.moe import Experts, combine, expert_ffn, sort_by_expert
from trex.parallel.tensor_parallel import TensorParallelSlice, slice_of


class ExpertParallelExperts(Experts):
    """Experts whose parameters are DTensors Shard(0) over ``ep_mesh``; same names as Experts.

    The dispatch is the model's own (``sort_by_expert``, ``expert_ffn``, ``combine``); between the
    sort and the FFN the sorted rows, and their routing weights, travel to the rank that owns their
    expert, and the FFN's output travels back. The only host read is the all-to-all split sizes, once
    per layer forward (a variable-size all-to-all needs them on the host). ``tp_slice``: the tp group the
    expert-parallel group spans (module docstring), None when it does not."""

    tp_slice: TensorParallelSlice | None = None

    def forward(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x: [T, d] local tokens; idx, weights: [T, k] global expert ids -> fp32 [T, d]."""
        tp = self.tp_slice
        if tp is None:
            return self._dispatch(x, idx, weights)
        T = x.shape[0]
        pad = -T % tp.size  # padded rows: expert 0 at weight 0, which adds exactly 0 to its output and gradients
        if pad:
            x, idx, weights = (F.pad(t, (0, 0, 0, pad)) for t in (x, idx, weights))
        rows = (T + pad) // tp.size
        y = self._dispatch(tp.scatter(x, 0), idx.narrow(0, tp.rank * rows, rows), tp.scatter(weights, 0))
        if tp.split:  # sequence parallelism: a partial (this rank's rows, zeros elsewhere) that the MoE's
            # reduce-scatter sums (T divides: the rows split; ``rows_partial`` leaves it as it is)
            return F.pad(y, (0, 0, tp.rank * rows, (tp.size - 1 - tp.rank) * rows))
        return tp.gather(y, 0)[:T]

    def _dispatch(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The all-to-all dispatch of this rank's tokens (class docstring)."""
        group = self.ep_mesh.get_group()
        ep = self.ep_mesh.size()
        w1, w2, w3 = (w.to_local() for w in (self.w1, self.w2, self.w3))
        n_local = w1.shape[0]
        sort = sort_by_expert(idx, n_local * ep)  # sorted rows go to the owner of expert e: rank e // n_local
        recv_per_expert = torch.empty_like(sort.counts)
        dist.all_to_all_single(recv_per_expert, sort.counts, group=group)  # [ep sources x n_local experts]
        recv_table = recv_per_expert.view(ep, n_local)
        sizes = torch.cat([sort.counts.view(ep, n_local).sum(dim=1), recv_table.sum(dim=1)]).tolist()  # the sync
        send, recv = sizes[:ep], sizes[ep:]

        received = _exchange(x[sort.token], recv, send, group)
        received_weights = _exchange(weights.reshape(-1)[sort.order], recv, send, group)
        # rows arrive grouped by source rank, then by local expert: regroup by local expert
        local_expert = torch.repeat_interleave(torch.arange(n_local, device=x.device).repeat(ep),
                                               recv_table.reshape(-1), output_size=sum(recv))
        regroup = local_expert.argsort(stable=True)
        y = expert_ffn(received[regroup], recv_table.sum(dim=0), w1, w2, w3, received_weights[regroup], self.limit,
                       self.quant, self.act_block)
        y = torch.empty_like(received).index_copy(0, regroup, y)
        back = _exchange(y, send, recv, group)
        return combine(back, sort.token, x.shape[0])


def _exchange(x: torch.Tensor, out_sizes: list[int], in_sizes: list[int], group) -> torch.Tensor:
    """Variable-size all-to-all of x's rows, differentiable (backward runs the reverse exchange) and
    traceable by torch.compile. Eager, the result is an AsyncCollectiveTensor: it waits at first use."""
    return funcol.all_to_all_single(x, out_sizes, in_sizes, group)


def shard_experts(model: nn.Module, ep_mesh, tp_mesh=None) -> list[nn.Parameter]:
    """Replace every routed-experts module by its expert-parallel form; returns the expert params. ``tp_mesh``:
    the tp ranks ``ep_mesh`` spans, whose tokens are the same (module docstring); None: it spans none."""
    ep = ep_mesh.size()
    tp_slice = slice_of(model, tp_mesh) if tp_mesh is not None else None
    params = []
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if type(child) is not Experts:
                continue
            n = child.w1.shape[0]
            if n % ep:
                raise ValueError(f"parallel.ep = {ep} does not divide n_routed_experts = {n}")
            child.__class__ = ExpertParallelExperts
            child.ep_mesh, child.tp_slice = ep_mesh, tp_slice
            for name in ("w1", "w2", "w3"):
                full = getattr(child, name)
                sharded = nn.Parameter(distribute_tensor(full.detach(), ep_mesh, [Shard(0)], src_data_rank=None),
                                       requires_grad=full.requires_grad)
                setattr(child, name, sharded)
                params.append(sharded)
    return params
