"""Load DeepSeek-V4 and V4.1 checkpoints into a trex model.

Loading streams tensor by tensor (``trex.checkpoint.reader``): every shard header is checked
against the model first (missing shards, truncated files, shapes, FP8/FP4 scales: all problems
raised together, naming file and tensor), then the model is built on the meta device,
materialised once on the target device, and each parameter is filled from the checkpoint,
dequantised to the training dtype. Peak host memory is the model plus about one checkpoint
tensor. With a shard function or a device mesh, each parameter holds, and each rank reads,
only its own region.
"""

from __future__ import annotations

import logging
import os

import torch

from trex import device as device_layer
from trex.checkpoint.errors import CheckpointError
from trex.checkpoint.reader import CheckpointReader, problems_error
from trex.checkpoint.sharding import ShardFn, default_placements, local_region
from trex.models import build_model
from trex.models.common.heads import Model
from trex.models.registry import architecture, drafter_kind

log = logging.getLogger(__name__)


def load_pretrained(path: str, dtype: torch.dtype | None = None, device: str | torch.device | None = None,
                    mesh=None, layout: str = "auto", shard_fn: ShardFn | None = None,
                    placements_fn=None, overrides: dict | None = None) -> Model:
    """Load a directory with ``config.json`` and safetensors weights in any DeepSeek-V4 layout.

    Official names or HF names (``layout="auto"`` detects them; "official" / "hf" force one),
    bf16/fp32 tensors, FP8 weights with ue8m0 128x128 scales (the V3 family's: fp32 scales), FP4 experts with
    1x32 scales.
    dtype: parameter dtype (default: the device's default, fp32 on CPUs without fast bf16).
    MTP tensors are loaded when present; when absent they are initialised fresh (logged; ``overrides``
    ``{"num_nextn_predict_layers": 0}`` builds the model without them). overrides: config fields set on top
    of the checkpoint's config.json (`CheckpointReader`).
    shard_fn(key, full_shape) -> Region: each parameter holds only that region, and only the
    checkpoint bytes overlapping it are read. mesh: a ``DeviceMesh``; parameters become DTensors
    with ``placements_fn(key, shape)`` (default: Shard(0) where rows >= ranks, else Replicate),
    each rank reading only its local shard. The model's ``loaded_from`` is ``path`` (absolute).
    """
    reader = CheckpointReader(path, layout, overrides)
    cfg = reader.config
    dev = device_layer.detect(str(device) if device is not None else None)
    dtype = dtype or dev.default_dtype()
    model = build_model(cfg, device="meta")
    tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    fresh = reader.check({k: tuple(t.shape) for k, t in tensors.items()})
    if mesh is not None:
        placements_fn = placements_fn or (lambda key, shape: default_placements(mesh, shape))
        shard_fn = shard_fn or (lambda key, shape: local_region(shape, mesh, placements_fn(key, shape)))
    if shard_fn is not None and fresh:
        raise CheckpointError(f"{path}: no MTP weights ({len(fresh)} tensors, e.g. {fresh[0]}); sharded loading "
                              "cannot initialise them: load unsharded or add them to the checkpoint")
    if shard_fn is None:
        model.to(dtype=dtype)  # on the meta device: never materialised in a wider dtype
        model.to_empty(device=dev.torch_device)
        model.init_weights()
        for key, target in {**dict(model.named_parameters()), **dict(model.named_buffers())}.items():
            if key not in fresh:
                reader.fill(key, target.shape, target)
    else:
        for key, meta in tensors.items():
            _load_local(model, key, meta, reader, shard_fn, dev.torch_device, dtype, mesh, placements_fn)
    if fresh:
        log.warning("%s: no MTP weights in the checkpoint; %d MTP tensors initialised fresh", path, len(fresh))
    if getattr(model, "engram_hasher", None) is not None:
        set_engram_tokenizer(model, path)
    model.loaded_from = os.path.abspath(path)  # save_pretrained refuses to write over its own source
    return model


def load_drafter(path: str, dtype: torch.dtype | None = None, device: str | torch.device | None = None):
    """The drafter a checkpoint carries besides its model (``Architecture.drafter``: V4.1's DSpark stages,
    ``trex.models.deepseek_v4.dspark.DSparkDrafter``), frozen, its ``mtp.*`` stages checked and dequantised as the
    model's tensors are; CheckpointError when the checkpoint has no such drafter or it does not match its config.
    The stages stay carried through on export, as stored."""
    reader = CheckpointReader(path)
    cfg = reader.config
    drafter_class = architecture(cfg).load("drafter")
    if drafter_class is None or drafter_kind(cfg) != "dspark":
        raise CheckpointError(f"{path}: no DSpark drafter (a DeepSeek-V4.1 config with num_nextn_predict_layers "
                              "and dspark_target_layer_ids)")
    with torch.device("meta"):
        drafter = drafter_class(cfg)
    tensors = drafter.state_dict()  # the routers' bias is a buffer
    diagnosis = reader.diagnose({k: tuple(t.shape) for k, t in tensors.items()}, optional_prefixes=(), drafter=True)
    if diagnosis.problems:
        raise problems_error("the DSpark drafter", diagnosis.problems, path)
    dev = device_layer.detect(str(device) if device is not None else None)
    drafter.to(dtype=dtype or dev.default_dtype())
    drafter.to_empty(device=dev.torch_device)
    for key, target in drafter.state_dict().items():
        reader.fill(key, target.shape, target)
    return drafter


def set_engram_tokenizer(model, path: str) -> None:
    """Give a V4.1 model's Engram hashing the compressed token map of checkpoint ``path``'s tokenizer
    (``tokenizer.json``, or ``tokenizer/tokenizer.json`` as released); CheckpointError if it needs one
    and there is none, or if the tokenizer is not the config's."""
    found = [p for p in (os.path.join(path, "tokenizer.json"), os.path.join(path, "tokenizer", "tokenizer.json"))
             if os.path.exists(p)]
    if not found:
        if not model.engram_hasher.ready:
            raise CheckpointError(f"{path}: no tokenizer.json (nor tokenizer/tokenizer.json): DeepSeek-V4.1's Engram "
                                  "hashes token ids through the checkpoint's own tokenizer")
        return
    from tokenizers import Tokenizer

    try:
        token_map = architecture(model.cfg).load("tokenizer_map")(model.cfg, Tokenizer.from_file(found[0]))
        model.set_engram_token_map(token_map.token_map, token_map.compressed_vocab)
    except ValueError as e:
        raise CheckpointError(f"{found[0]}: {e}") from None


def _load_local(model: Model, key: str, meta: torch.Tensor, reader: CheckpointReader, shard_fn: ShardFn,
                device: torch.device, dtype: torch.dtype, mesh, placements_fn) -> None:
    """Replace parameter/buffer ``key`` by its local region (a DTensor when ``mesh`` is set)."""
    shape = tuple(meta.shape)
    region = shard_fn(key, shape)
    local = torch.empty([b - a for a, b in region], dtype=dtype if meta.is_floating_point() else meta.dtype,
                        device=device)
    reader.fill(key, shape, local, region)
    if mesh is not None:
        from torch.distributed.tensor import DTensor

        local = DTensor.from_local(local, mesh, placements_fn(key, shape), run_check=False,
                                   shape=torch.Size(shape), stride=torch.empty(shape, device="meta").stride())
    owner_name, _, leaf = key.rpartition(".")
    owner = model.get_submodule(owner_name)
    if isinstance(meta, torch.nn.Parameter):
        setattr(owner, leaf, torch.nn.Parameter(local, requires_grad=meta.requires_grad))
    else:
        owner.register_buffer(leaf, local, persistent=leaf not in owner._non_persistent_buffers_set)
