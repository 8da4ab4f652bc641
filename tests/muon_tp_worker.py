"""Muon on FSDP2 x TP on four gloo ranks, for tests/test_optim.py::test_muon_under_fsdp2_x_tp_*.

    python -m torch.distributed.run --nproc-per-node 4 tests/muon_tp_worker.py OUT_DIR

tiny-v3 split over tp = 2, sharded by FSDP2 over dp_shard = 2, its routed experts over ep = 4 (its split weights
2-D DTensors: a column-wise one's rows split by TP, then again by FSDP, a ``_StridedShard``); two Muon steps
with the same gradients as one process's. Each rank writes OUT_DIR/rankR.json: the Muon parameters that differ from one process's (rank 0
compares, bitwise, after gathering them with DTensor's own ``full_tensor``), the placements of those Muon
orthogonalises gathered whole on every rank (the "full" path), the warnings torch.distributed.tensor logged
during the steps, and the parameters trex.parallel.parameter_view.full_tensor gathers otherwise than DTensor's
``full_tensor`` (every placement this layout makes).
"""

from __future__ import annotations

import json
import logging
import os
import sys

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from muon_compare import compare_muon_params
from trex import device as device_layer
from trex.models import build_model
from trex.models.registry import get_preset
from trex.parallel.mesh import init_parallel, shutdown_distributed
from trex.parallel.parameter_view import full_tensor
from trex.parallel.plan import apply_parallelism
from trex.precision import PrecisionPolicy
from trex.train import optim

SECTION = optim.OptimSection(lr=0.02, weight_decay=0.1)


class Recorded(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def main(out: str) -> None:
    logged = Recorded()
    logging.getLogger("torch.distributed.tensor").addHandler(logged)
    dev = device_layer.Device("cpu")
    par = init_parallel(1, 2, 4, 120, dev, tp=2)  # the routed experts over all four (EP spanning TP)
    cfg = get_preset("tiny-v3")
    one, model = build_model(cfg, seed=0), build_model(cfg, seed=0)
    apply_parallelism(model, par, PrecisionPolicy.resolve("fp32", dev))
    reference, sharded = optim.build_optimizer(one, SECTION), optim.build_optimizer(model, SECTION)
    one_params, params = dict(one.named_parameters()), dict(model.named_parameters())
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        for name, p in one_params.items():
            p.grad = torch.randn(p.shape, generator=g)
            q = params[name]
            q.grad = (distribute_tensor(p.grad, q.device_mesh, q.placements, src_data_rank=None)
                      if isinstance(q, DTensor) else p.grad.clone())
        if par.rank == 0:
            reference.step()
        sharded.step()
    logged_by_steps = list(logged.messages)  # the check below gathers with DTensor's own full_tensor
    mismatched, muon = compare_muon_params(sharded, one_params, par.rank == 0)
    gathered = {str(q.placements) for _, q in muon if isinstance(q, DTensor) and optim._matrix_split(q) == "full"}
    differing = [name for name, q in params.items() if isinstance(q, DTensor)
                 and not torch.equal(full_tensor(q.detach()), q.detach().full_tensor())]
    result = {"rank": par.rank, "mismatched": mismatched, "gathered": sorted(gathered), "logged": logged_by_steps,
              "differing_gathers": differing}
    with open(os.path.join(out, f"rank{par.rank}.json"), "w") as f:
        json.dump(result, f)
    shutdown_distributed()


if __name__ == "__main__":
    main(sys.argv[1])
