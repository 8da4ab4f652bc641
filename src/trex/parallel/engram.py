"""Engram tables (DeepSeek-V4.1) split by rows over every rank, looked up with an all-to-all.

V4.1-Flash's two tables hold 2 x ~384 M rows of 256 (197 B parameters, 788 GB in fp32): no rank can
hold one, and FSDP would gather a whole table for the block that reads it. Here each table is a
DTensor Shard(0) over a one-dimensional mesh of all ranks (rank r keeps rows [r * c, (r + 1) * c),
c = ceil(rows / world)), left out of FSDP, and its module (``Engram.embed``, same name, same
parameter) looks rows up like expert parallelism moves tokens. A model marks such a table by naming it in its
module's ``sharded_table`` attribute (the name of an nn.Embedding child; V4.1's ``Engram``):

1. the step's row ids [T] (T = tokens x (max_ngram - 1) x heads of this rank) are sorted by owner;
2. one all-to-all of the per-owner counts, read on the host once per table and forward (a
   variable-size all-to-all needs its sizes there: the only host read, as in expert parallelism);
3. the ids travel to their owners, each owner gathers its rows, and the rows travel back.

Backward runs the exchange in reverse: each owner adds the gradients of the rows it served into a
dense gradient of its own shard, so a table's gradient is the sum over every rank's tokens, the
same sum FSDP's reduce-scatter gives every other parameter. Per rank and table the cost is
T ids and T x 256 values each way, independent of the world size; a rank keeps rows / world rows.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Shard, distribute_tensor


class _Share(torch.autograd.Function):
    """Identity forward; backward divides the gradient by ``replicas``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, replicas: int) -> torch.Tensor:
        ctx.replicas = replicas
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad / ctx.replicas, None


class ShardedTable(nn.Module):
    """``weight`` [rows, dim]: a DTensor Shard(0) over ``mesh``, every rank of the run. forward(ids)
    with ids [...] global row numbers -> [..., dim] rows in the table's dtype. ``replicas``: how many ranks
    look up the same ids with the same gradient (a tensor-parallel group's, which compute the replicated
    parts alike): each rank's share of a row's gradient is divided by it, so the owner's sum counts those
    ranks' tokens once."""

    def __init__(self, weight: nn.Parameter, mesh, replicas: int = 1):
        super().__init__()
        self.mesh, self.replicas = mesh, replicas
        self.weight = nn.Parameter(distribute_tensor(weight.detach(), mesh, [Shard(0)], src_data_rank=None),
                                   requires_grad=weight.requires_grad)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        group, world = self.mesh.get_group(), self.mesh.size()
        local = self.weight.to_local()
        rows_per_rank = -(-self.weight.shape[0] // world)  # Shard(0) splits as torch.chunk does
        flat = ids.reshape(-1)
        owner = flat // rows_per_rank
        order = owner.argsort(stable=True)
        counts = torch.zeros(world, dtype=torch.long, device=flat.device).scatter_add_(0, owner,
                                                                                      torch.ones_like(owner))
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=group)
        sizes = torch.cat([counts, received]).tolist()  # the sync: the exchange's sizes on the host
        send, recv = sizes[:world], sizes[world:]
        wanted = funcol.all_to_all_single(flat[order], recv, send, group)
        rank = self.mesh.get_local_rank()
        served = F.embedding(wanted - rank * rows_per_rank, local)
        back = funcol.all_to_all_single(served, send, recv, group)
        rows = torch.empty_like(back).index_copy(0, order, back)
        if self.replicas > 1:
            rows = _Share.apply(rows, self.replicas)
        return rows.view(*ids.shape, local.shape[-1])


def shard_engram_tables(model: nn.Module, mesh, replicas: int = 1) -> list[nn.Parameter]:
    """Swap every table a module names in its ``sharded_table`` attribute (an nn.Embedding child: each V4.1
    Engram layer's ``embed``) for a :class:`ShardedTable` over ``mesh`` (all ranks; ``replicas``: the tensor-parallel
    size, whose ranks look up the same rows); returns the tables, for FSDP to leave alone. Names and global shapes
    are unchanged, so checkpoints, sharded loading and DCP resharding see the same tensors."""
    tables = []
    for module in model.modules():
        name = getattr(module, "sharded_table", None)
        table = getattr(module, name, None) if name else None
        if isinstance(table, nn.Embedding):
            setattr(module, name, ShardedTable(table.weight, mesh, replicas))
            tables.append(getattr(module, name).weight)
    return tables

