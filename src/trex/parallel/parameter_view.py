"""What a module's forward sees of its parameters, swapped in while it runs and restored after.

The parameter objects never change (names, the optimizer, FSDP2 and checkpoints see them throughout); only the
module's ``_parameters`` slots hold a view for the duration of the forward. Used for the compute-dtype casts of
one-process mixed precision (trex.parallel.plan.ComputeCast) and tensor parallelism's local shards
(trex.parallel.tensor_parallel.LocalView).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.placement_types import _StridedShard


def whole(weight: torch.Tensor) -> torch.Tensor:
    """A parameter outside the forward that views it (split over tp, sharded by FSDP2: a DTensor) as the whole
    tensor, the same on every rank, detached; a plain tensor as itself, detached. Every rank of the parameter's
    mesh must call it (a DTensor's ``full_tensor`` gathers)."""
    weight = weight.detach()
    return full_tensor(weight) if isinstance(weight, DTensor) else weight


def full_tensor(t: DTensor) -> torch.Tensor:
    """``t.full_tensor()`` (the whole tensor, the same on every rank of its mesh, which must all call it) as one
    all_gather per mesh dim that splits it, each a redistribution of its own: first a ``_StridedShard`` (FSDP2's
    shard of a dim tensor parallelism split before it: the finer split, inside TP's chunks), then the other splits
    innermost mesh dim first. ``full_tensor`` plans the same gathers in one redistribution, cannot merge them into
    one collective (no flattened mesh of those dims, and FSDP2 x TP's strided gather comes first: "non-ascending")
    and logs DTensor's warning about sequential all_gathers on every rank."""
    placements = list(t.placements)
    strided = [i for i, p in enumerate(placements) if isinstance(p, _StridedShard)]
    rest = [i for i in reversed(range(len(placements))) if i not in strided and not placements[i].is_replicate()]
    for i in strided + rest:
        placements[i] = Replicate()
        t = t.redistribute(t.device_mesh, placements)
    return t.to_local()


class ParameterView:
    """While entered, the parameters of ``unit`` that ``select`` picks (minus those under the modules ``skip``)
    are seen as ``view(parameter)``: a differentiable tensor whose gradient reaches the parameter. The unit's
    forward enters it (hooks); entering again while entered does nothing, so a region that activation
    checkpointing recomputes during backward can enter it again and see the same views as the forward did."""

    def __init__(self, unit: nn.Module, select: Callable[[nn.Parameter], bool],
                 view: Callable[[nn.Parameter], torch.Tensor], skip: tuple[nn.Module, ...] = ()):
        skipped = {id(m) for s in skip for m in s.modules()}
        self.view = view
        self.slots = [(m, name) for m in unit.modules() if id(m) not in skipped
                      for name, p in m.named_parameters(recurse=False) if select(p)]
        self.saved: list[nn.Parameter] = []
        self.depth = 0
        self.hooks = [unit.register_forward_pre_hook(lambda *_: self._enter()),
                      unit.register_forward_hook(lambda *_: self._exit(), always_call=True)]

    def __enter__(self) -> ParameterView:
        self._enter()
        return self

    def _enter(self) -> None:
        if self.depth == 0:
            self.saved = [m._parameters[name] for m, name in self.slots]  # FSDP2's unsharded ones, if sharded
            for (m, name), p in zip(self.slots, self.saved):
                m._parameters[name] = self.view(p)  # a tensor, not a Parameter: the forward's view
        self.depth += 1

    def __exit__(self, *_) -> None:
        self._exit()

    def _exit(self) -> None:
        self.depth -= 1
        if self.depth == 0:
            for (m, name), p in zip(self.slots, self.saved):
                m._parameters[name] = p
            self.saved = []

    def remove(self) -> None:
        for hook in self.hooks:
            hook.remove()
