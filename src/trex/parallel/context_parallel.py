"""Context parallelism: each sequence split into contiguous shards over the "cp" mesh dimension.

The model does the arithmetic of a shard (``trex.models.common.context.SequenceShard``: which rows, which
compression windows, which halo each layer needs); this module gives it the group's two
collectives, both from PyTorch's functional collectives, so they are differentiable (autograd runs
the reverse exchange in backward) and traceable by torch.compile:

* ``gather``: an all-gather along the sequence (compressed entries, per-token losses, balance sums);
  backward reduce-scatters the gradients back to the rows' owners.
* ``exchange``: the halo. Each rank sends its first rows to the previous rank and its last rows to the
  next one with one all-to-all whose split sizes are fixed by the layer type (no host read).

Every rank of a group runs the same operations (only constants such as slice offsets differ), so
that compiled blocks have the same graph on every rank and issue their collectives in one order.

Every rank of a group gets the same micro-batch (``Parallel.data_rank``) and computes the whole
loss of it from the gathered per-token losses, so the group holds ``cp`` copies of that loss. Losses
are normalised by counts summed over all ranks, which count each row ``cp`` times, so the copies
add up to the loss once, and gradients are summed over the parameter-sharding group (dp_shard x cp).
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh

from trex.models.common.heads import Model


class ContextParallelShard:
    """The ``SequenceShard`` of this rank in a 1-D "cp" mesh."""

    def __init__(self, mesh: DeviceMesh):
        self.group = mesh.get_group()
        self.rank = mesh.get_local_rank()
        self.size = mesh.size()

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, s, ...] -> [B, size * s, ...], the ranks' x in rank order."""
        rows = funcol.all_gather_single_autograd(x.movedim(1, 0).contiguous(), 0, self.group)
        return funcol.wait_tensor(rows).movedim(0, 1)  # a plain tensor, as the model's outputs are

    def exchange(self, head: torch.Tensor, tail: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """head [B, f, ...] goes to the previous rank, tail [B, b, ...] to the next; returns (the previous
        rank's tail, the next rank's head), zeros at the group's ends.

        One all-to-all around the ring (rank 0's previous is the last rank), the ends masked after it:
        every rank then runs the same operations and only constants differ. Rank-dependent branches
        would give the ranks' compiled graphs different shapes, and a compiled, checkpointed block
        could then order its collectives differently on each rank (a mismatch, then a hang)."""
        r, size = self.rank, self.size
        before, after = tail.shape[1], head.shape[1]
        prev, nxt = (r - 1) % size, (r + 1) % size
        send, recv = [0] * size, [0] * size
        send[prev] += after
        send[nxt] += before
        recv[prev] += before
        recv[nxt] += after
        # rows are laid out by rank, and within one rank (cp = 2: both neighbours are one rank) head first
        parts = [head, tail] if prev <= nxt else [tail, head]
        buf = torch.cat([p.movedim(1, 0) for p in parts], dim=0).contiguous()
        got = funcol.wait_tensor(funcol.all_to_all_single_autograd(buf, recv, send, self.group)).movedim(0, 1)
        if prev == nxt:  # from the one neighbour: its head, then its tail
            next_head, prev_tail = got[:, :after], got[:, after:]
        elif prev < nxt:  # the previous rank's tail arrives first
            prev_tail, next_head = got[:, :before], got[:, before:]
        else:
            next_head, prev_tail = got[:, :after], got[:, after:]
        return prev_tail * float(r > 0), next_head * float(r < size - 1)


def apply_context_parallel(model: Model, cp_mesh: DeviceMesh) -> None:
    """Make ``model`` (of any family: DeepSeek-V4, V4.1 or the V3 family) compute its rank's shard of every sequence
    (a no-op for a group of one)."""
    if cp_mesh.size() > 1:
        model.sequence_shard = ContextParallelShard(cp_mesh)
