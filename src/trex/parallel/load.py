"""Load a checkpoint straight into a sharded model: each rank reads only the regions it owns.

The model is built on the meta device, the parallel plan is applied (parameters become DTensors),
storage is allocated for the local shards only, and each shard is filled from the checkpoint
(official or HF layout, bf16/fp32/FP8/FP4) through ``trex.checkpoint.reader``.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from trex.checkpoint.errors import CheckpointError
from trex.checkpoint.load import set_engram_tokenizer
from trex.checkpoint.reader import CheckpointReader
from trex.models import build_model
from trex.models.common.heads import Model


def local_region(t: DTensor) -> tuple[tuple[int, int], ...]:
    """[start, stop) per dim of the global tensor that this rank's shard of ``t`` covers."""
    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return tuple((o, o + n) for o, n in zip(offset, shape))


@torch.no_grad()
def load_sharded(path: str, prepare, device: torch.device, layout: str = "auto", overrides: dict | None = None
                 ) -> Model:
    """``prepare(model)`` applies the parallel plan to the meta model (and freezes what it must); ``overrides``:
    config fields set on top of the checkpoint's config.json (`CheckpointReader`)."""
    reader = CheckpointReader(path, layout, overrides)
    model = build_model(reader.config, device="meta")
    prepare(model)
    tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    fresh = reader.check({k: tuple(t.shape) for k, t in tensors.items()})
    if fresh:
        raise CheckpointError(f"{path}: no MTP weights ({len(fresh)} tensors, e.g. {fresh[0]}); a sharded load "
                              "cannot initialise them: convert the checkpoint with MTP, train on one process, or build the model without them "
                              "(model.overrides = { num_nextn_predict_layers = 0 })")
    model.to_empty(device=device)
    for key, t in {**dict(model.named_parameters()), **dict(model.named_buffers())}.items():
        if isinstance(t, DTensor):
            local = t.to_local()
            if local.numel():
                reader.fill(key, t.shape, local, local_region(t))
        else:
            reader.fill(key, t.shape, t)
    if getattr(model, "engram_hasher", None) is not None:  # V4.1: hash through the checkpoint's tokenizer
        set_engram_tokenizer(model, path)
    return model
