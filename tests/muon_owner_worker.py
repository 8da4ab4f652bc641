"""Muon's sharded update on two gloo ranks, for tests/test_optim.py::test_sharded_muon_*.

    python -m torch.distributed.run --nproc-per-node 2 tests/muon_owner_worker.py OUT_DIR

The tiny model (4 experts) under trex's own layout, FSDP2 over both ranks and experts split in two (EP 2),
plus three hand-sharded matrices FSDP never makes (uneven rows, split columns, a stack split along its
rows); two Muon steps with the same gradients as one process's. Each rank writes OUT_DIR/rankR.json:
whether every Muon parameter equals one process's bitwise, the shapes the Newton-Schulz update ran on
(``ns_calls``), the matrices this rank owns and the stacks it holds whole, and the host syncs of a step.
"""

from __future__ import annotations

import json
import os
import sys

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from muon_compare import compare_muon_params
from trex import device as device_layer
from trex.models import build_model
from trex.models.common.config import HASH_MOE, MOE
from trex.models.deepseek_v4.config import CSA, HCA, tiny
from trex.parallel.mesh import init_parallel, shutdown_distributed
from trex.parallel.plan import apply_parallelism
from trex.precision import PrecisionPolicy
from trex.syncs import SyncCounter
from trex.train import optim

SECTION = optim.OptimSection(lr=0.02, weight_decay=0.1)
HAND_MADE = {"uneven_rows": ((5, 12), Shard(0)), "split_columns": ((12, 5), Shard(1)),
             "stack_split_rows": ((3, 8, 6), Shard(1))}


def hand_made_optimizer(params: list[torch.Tensor]) -> optim.MuonAdamW:
    return optim.MuonAdamW([{"algorithm": "muon", "params": params, "names": list(HAND_MADE), "lr": SECTION.lr,
                             "weight_decay": SECTION.weight_decay, "momentum": SECTION.momentum,
                             "nesterov": SECTION.nesterov, "update_rms": SECTION.update_rms,
                             "ns_schedule": SECTION.ns_schedule(), "ns_dtype": "fp32"}])


def main(out: str) -> None:
    dev = device_layer.Device("cpu")
    par = init_parallel(1, 2, 2, 120, dev)  # FSDP2 over 2 ranks, experts split over EP 2
    cfg = tiny(n_routed_experts=4, num_hidden_layers=2, layer_types=[CSA, HCA], mlp_layer_types=[HASH_MOE, MOE])
    one, model = build_model(cfg, seed=0), build_model(cfg, seed=0)
    apply_parallelism(model, par, PrecisionPolicy.resolve("fp32", dev))
    world = init_device_mesh("cpu", (2,))
    g = torch.Generator().manual_seed(1)
    one_hand = {n: torch.randn(shape, generator=g) for n, (shape, _) in HAND_MADE.items()}
    hand = {n: distribute_tensor(w.clone(), world, [HAND_MADE[n][1]], src_data_rank=None) for n, w in one_hand.items()}
    pairs = [(optim.build_optimizer(one, SECTION), optim.build_optimizer(model, SECTION),
              dict(one.named_parameters()), dict(model.named_parameters())),
             (hand_made_optimizer(list(one_hand.values())), hand_made_optimizer(list(hand.values())), one_hand, hand)]

    calls = []
    real = optim.orthogonalized_update

    def recorded(direction, *args, **kwargs):
        calls.append(list(direction.shape))
        return real(direction, *args, **kwargs)

    optim.orthogonalized_update = recorded
    syncs = 0
    for step in range(2):
        for reference, sharded, one_params, params in pairs:
            for name, p in one_params.items():
                p.grad = torch.randn(p.shape, generator=g)
                q = params[name]
                q.grad = (distribute_tensor(p.grad, q.device_mesh, q.placements, src_data_rank=None)
                          if isinstance(q, DTensor) else p.grad.clone())
            if par.rank == 0:  # one process's step, compared on rank 0
                saved, optim.orthogonalized_update = optim.orthogonalized_update, real
                reference.step()
                optim.orthogonalized_update = saved
            with SyncCounter() as counter:
                sharded.step()
            syncs += counter.count
    optim.orthogonalized_update = real

    mismatched, owned, stacks = [], [], []
    for reference, sharded, one_params, params in pairs:
        differing, muon = compare_muon_params(sharded, one_params, par.rank == 0)
        mismatched += differing
        for name, q in muon:
            split = optim._matrix_split(q) if isinstance(q, DTensor) else "plain"
            if isinstance(split, tuple) and sharded.owners()[q] == q.device_mesh.get_local_rank(split[0]):
                owned.append(list(q.shape))
            elif split in ("local", "plain"):
                stacks.append(list(q.to_local().shape if isinstance(q, DTensor) else q.shape))
    result = {"rank": par.rank, "mismatched": mismatched, "ns_calls": calls, "owned": owned, "stacks": stacks,
              "syncs": syncs, "experts": list(model.layers[1].ffn.experts.w1.to_local().shape),
              "owner_path": sum(len(o.owners()) for _, o, *_ in pairs)}
    with open(os.path.join(out, f"rank{par.rank}.json"), "w") as f:
        json.dump(result, f)
    shutdown_distributed()


if __name__ == "__main__":
    main(sys.argv[1])
