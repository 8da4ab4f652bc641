"""Expert parallelism: routed experts split over the "ep" mesh dimension, tokens moved by all-to-all.

Each rank keeps E/ep whole experts: the stacked w1/w2/w3 become DTensors sharded on dim 0 over the
ep mesh, so their names and global shapes are unchanged (checkpoints reshard across layouts). A
forward sends every (token, expert) pair to the rank owning the expert with one variable-size
all-to-all, runs the local experts as grouped matmuls, and brings the results back with a second
all-to-all; autograd runs the same exchanges in reverse.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
from torch import nn
from torch.distributed.tensor import Shard, distribute_tensor

from trex import kernels
from trex.models.deepseek_v4 import Experts, clamped_swiglu


class ExpertParallelExperts(Experts):
    """Experts whose parameters are DTensors Shard(0) over ``ep_mesh``; same names as Experts."""

    def forward(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x: [T, d] local tokens; idx, weights: [T, k] global expert ids -> [T, d]."""
        group = self.ep_mesh.get_group()
        ep = self.ep_mesh.size()
        w1, w2, w3 = (w.to_local() for w in (self.w1, self.w2, self.w3))
        n_local = w1.shape[0]
        T, k = idx.shape
        flat = idx.reshape(-1)
        order = flat.argsort(stable=True)
        token = order // k
        per_expert = torch.bincount(flat, minlength=n_local * ep)  # [E], sorted rows go to owner e // n_local
        recv_per_expert = torch.empty_like(per_expert)
        dist.all_to_all_single(recv_per_expert, per_expert, group=group)  # [ep sources x n_local experts]
        send = per_expert.view(ep, n_local).sum(dim=1).tolist()
        recv_table = recv_per_expert.view(ep, n_local)
        recv = recv_table.sum(dim=1).tolist()

        xs = x[token]
        received = dist_fn.all_to_all_single(xs.new_empty(sum(recv), x.shape[1]), xs, recv, send, group=group)
        # rows arrive grouped by source rank, then by local expert: regroup by local expert
        local_expert = torch.repeat_interleave(torch.arange(n_local, device=x.device).repeat(ep), recv_table.reshape(-1))
        regroup = local_expert.argsort(stable=True)
        counts = torch.bincount(local_expert, minlength=n_local).tolist()
        mm = kernels.get("grouped_mm", x.device.type)
        xg = received[regroup]
        h = clamped_swiglu(mm(xg, w1, counts), mm(xg, w3, counts), self.limit).to(x.dtype)
        y = torch.empty_like(received).index_copy(0, regroup, mm(h, w2, counts))
        back = dist_fn.all_to_all_single(y.new_empty(sum(send), x.shape[1]), y, send, recv, group=group)
        back = back * weights.reshape(-1)[order, None].to(back.dtype)
        return torch.zeros_like(x).index_add_(0, token, back)


def shard_experts(model: nn.Module, ep_mesh) -> list[nn.Parameter]:
    """Replace every routed-experts module by its expert-parallel form; returns the expert params."""
    ep = ep_mesh.size()
    params = []
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if type(child) is not Experts:
                continue
            n = child.w1.shape[0]
            if n % ep:
                raise ValueError(f"parallel.ep = {ep} does not divide n_routed_experts = {n}")
            child.__class__ = ExpertParallelExperts
            child.ep_mesh = ep_mesh
            for name in ("w1", "w2", "w3"):
                full = getattr(child, name)
                sharded = nn.Parameter(distribute_tensor(full.detach(), ep_mesh, [Shard(0)], src_data_rank=None),
                                       requires_grad=full.requires_grad)
                setattr(child, name, sharded)
                params.append(sharded)
    return params
