"""Tensor parallelism's collectives counted in one process: a model split at tp = N over a fake process group
(torch's ``fake`` backend: rank 0 of N, every collective a no-op that returns its input, so the values are not
the group's) and each all-reduce trex.parallel.tensor_parallel issues recorded. What is counted is what a real
tp group runs: the plan, the hooks and the autograd functions are the real ones; only the numbers are wrong."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the "fake" backend)
from torch.distributed.device_mesh import init_device_mesh

from trex.models import build_model
from trex.models.common.context import shift_labels
from trex.parallel import tensor_parallel


@contextlib.contextmanager
def fake_tp(size: int = 2):
    """A tp mesh of ``size`` ranks over a fake process group (this process rank 0), left when done."""
    dist.init_process_group("fake", store=dist.HashStore(), rank=0, world_size=size)
    try:
        yield init_device_mesh("cpu", (size,), mesh_dim_names=("tp",))["tp"]
    finally:
        dist.destroy_process_group()


class AllReduces:
    """The all-reduces tensor_parallel issues while entered: each buffer's shape and its ring bytes (as the planner
    counts: reduce-scatter + all-gather, 2 x the buffer)."""

    def __init__(self, monkeypatch):
        self.shapes: list[tuple[int, ...]] = []
        self.bytes = 0
        real = tensor_parallel._all_reduce

        def counting(x: torch.Tensor, op: str, group) -> torch.Tensor:
            self.shapes.append(tuple(x.shape))
            self.bytes += 2 * x.numel() * x.element_size()
            return real(x, op, group)

        monkeypatch.setattr(tensor_parallel, "_all_reduce", counting)

    def take(self) -> list[tuple[int, ...]]:
        """The shapes since the last take."""
        shapes, self.shapes = self.shapes, []
        return shapes


def split_model(cfg, mesh):
    """``cfg``'s model (seed 0, training mode) split over ``mesh`` by its family's plan."""
    model = build_model(cfg, seed=0).train()
    tensor_parallel.apply_tensor_parallel(model, mesh)
    return model


def training_step(model, S: int, counted: AllReduces) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
    """One sequence of S tokens through every head (main and MTP), the losses' sum backward: the shapes of the
    all-reduces ``counted`` saw in the forward and in the backward."""
    cfg = model.cfg
    ids = torch.randint(0, cfg.vocab_size, (1, S), generator=torch.Generator().manual_seed(0))
    docs = torch.zeros_like(ids)
    heads = 1 + (getattr(cfg, "num_nextn_predict_layers", 0) or 0)
    counted.take()
    out = model(ids, doc_ids=docs, targets=[shift_labels(ids, k + 1, docs) for k in range(heads)],
                return_logits=False)
    forward = counted.take()
    sum(nll.sum() for nll in out.token_nll).backward()
    return forward, counted.take()
