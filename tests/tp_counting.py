"""Tensor parallelism's collectives counted in one process: a model split at tp = N over a fake process group
(torch's ``fake`` backend: rank 0 of N, every collective a no-op that returns its input, so the values are not
the group's) and each collective trex.parallel.tensor_parallel issues recorded. What is counted is what a real
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
from trex.parallel.expert_parallel import shard_experts


@contextlib.contextmanager
def fake_tp(size: int = 2):
    """A tp mesh of ``size`` ranks over a fake process group (this process rank 0), left when done."""
    dist.init_process_group("fake", store=dist.HashStore(), rank=0, world_size=size)
    try:
        yield init_device_mesh("cpu", (size,), mesh_dim_names=("tp",))["tp"]
    finally:
        dist.destroy_process_group()


class Collectives:
    """The collectives tensor_parallel issues while entered: each buffer's shape and its ring bytes (as the planner
    counts: an all-reduce 2 x the buffer, a reduce-scatter + an all-gather; an all-gather its output, a
    reduce-scatter its input); ``shapes`` are the all-reduces'."""

    def __init__(self, monkeypatch):
        self.shapes: list[tuple[int, ...]] = []
        self.bytes = 0

        def counted(name: str, ring: int, size_of):
            real = getattr(tensor_parallel, name)

            def counting(x: torch.Tensor, *args) -> torch.Tensor:
                out = real(x, *args)
                if name == "_all_reduce":
                    self.shapes.append(tuple(x.shape))
                self.bytes += ring * size_of(x, out).numel() * x.element_size()
                return out

            monkeypatch.setattr(tensor_parallel, name, counting)

        counted("_all_reduce", 2, lambda x, out: x)
        counted("_all_gather", 1, lambda x, out: out)
        counted("_reduce_scatter", 1, lambda x, out: x)

    def take(self) -> list[tuple[int, ...]]:
        """The all-reduces' shapes since the last take."""
        shapes, self.shapes = self.shapes, []
        return shapes


def split_model(cfg, mesh, sequence_parallel: bool = False, experts: bool = False):
    """``cfg``'s model (seed 0, training mode) split over ``mesh`` by its family's plan; ``experts``: the routed
    experts split over the tp group as its expert-parallel group (ep = tp)."""
    model = build_model(cfg, seed=0).train()
    tensor_parallel.apply_tensor_parallel(model, mesh, sequence_parallel)
    if experts:
        shard_experts(model, mesh, mesh)
    return model


def training_step(model, S: int, counted: Collectives) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
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
