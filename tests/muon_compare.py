"""What the Muon workers (tests/muon_owner_worker.py, tests/muon_tp_worker.py) check of a sharded optimizer after its
steps: every Muon-updated parameter, gathered whole, against one process's."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def compare_muon_params(optimizer, one_params: dict[str, torch.Tensor], rank0: bool) -> tuple[list, list]:
    """([name, max |difference|] of each Muon parameter whose whole value (a DTensor gathered, on every rank) is not
    bitwise one process's ``one_params[name]``, checked on rank 0; [(name, parameter)] of every Muon parameter)."""
    mismatched, muon = [], []
    for group in optimizer.param_groups:
        if group["algorithm"] != "muon":
            continue
        for name, q in zip(group["names"], group["params"]):
            full = q.full_tensor() if isinstance(q, DTensor) else q
            if rank0 and not torch.equal(full, one_params[name].detach()):
                mismatched.append([name, (full - one_params[name]).abs().max().item()])
            muon.append((name, q))
    return mismatched, muon
