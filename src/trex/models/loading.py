"""Build models from presets or config files and load Hugging Face safetensors checkpoints.

Loading streams tensor by tensor through ``safetensors.safe_open``: the model is built on the
meta device, materialised once on the target device, and each checkpoint tensor is read, renamed,
shape-checked and copied in before the next is read. Problems are collected and raised together,
before the model is returned, naming the file and tensor.
"""

from __future__ import annotations

import json
import logging
import os

import torch
from safetensors import safe_open

from trex.models.config import ModelConfig
from trex.models.deepseek_v4 import DeepseekV4
from trex.models.naming import to_trex

log = logging.getLogger(__name__)


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file and tensor."""


def build_model(cfg: ModelConfig, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
                seed: int | None = None) -> DeepseekV4:
    """A freshly initialised model. device="meta" builds the structure without memory."""
    with torch.device(device):
        model = DeepseekV4(cfg) if seed is None else _seeded(cfg, seed)
    if dtype is not None:
        model.to(dtype=dtype)
    return model


def _seeded(cfg: ModelConfig, seed: int) -> DeepseekV4:
    model = DeepseekV4(cfg)
    model.init_weights(seed=seed)
    return model


def checkpoint_files(path: str) -> list[str]:
    """The safetensors files of a checkpoint directory (single file, or sharded with an index)."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index}: not a safetensors index ({e})") from None
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not os.path.exists(os.path.join(path, f))]
        if missing:
            raise CheckpointError(f"{index}: names shard(s) that do not exist: {missing}")
        return [os.path.join(path, f) for f in files]
    single = os.path.join(path, "model.safetensors")
    if os.path.exists(single):
        return [single]
    found = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not found:
        raise CheckpointError(f"{path}: no model.safetensors, no index and no *.safetensors files")
    return [os.path.join(path, f) for f in found]


def load_pretrained(path: str, dtype: torch.dtype | None = None, device: str | torch.device | None = None
                    ) -> DeepseekV4:
    """Load a directory with ``config.json`` and safetensors weights saved by ``transformers``.

    dtype: parameter dtype (default: the device's default, fp32 on CPUs without fast bf16).
    Tensors that transformers does not save (MTP) are initialised fresh and reported in the log.
    """
    from trex import device as device_layer

    cfg = ModelConfig.from_file(path)
    dev = device_layer.detect(str(device) if device is not None else None)
    dtype = dtype or dev.default_dtype()
    model = build_model(cfg, device="meta")
    model.to_empty(device=dev.torch_device)
    model.init_weights()
    model.to(dtype=dtype)
    state = dict(model.named_parameters())
    state.update(dict(model.named_buffers()))
    loaded: set[str] = set()
    expert_slices: dict[str, set[int]] = {}
    problems: list[str] = []
    for file in checkpoint_files(path):
        try:
            handle = safe_open(file, framework="pt", device="cpu")
        except Exception as e:  # noqa: BLE001 - safetensors raises several types
            raise CheckpointError(f"{file}: cannot read safetensors header ({e})") from None
        with handle:
            for name in handle.keys():
                try:
                    tensor = handle.get_tensor(name)
                except Exception as e:  # noqa: BLE001
                    raise CheckpointError(f"{file}: tensor {name}: cannot read data ({e})") from None
                for key, expert, value in to_trex(name, tensor):
                    problem = _copy_in(state.get(key), key, expert, value)
                    if problem:
                        problems.append(f"{file}: {name}: {problem}")
                    elif expert is None:
                        loaded.add(key)
                    else:
                        expert_slices.setdefault(key, set()).add(expert)
    for key, seen in expert_slices.items():
        if len(seen) == state[key].shape[0]:
            loaded.add(key)
        else:
            absent = sorted(set(range(state[key].shape[0])) - seen)
            problems.append(f"{path}: {key}: experts {absent[:10]} missing")
    missing = [k for k in state if k not in loaded and not k.startswith("mtp.")]
    if missing:
        problems.append(f"{path}: missing tensor(s): {missing[:20]}{' ...' if len(missing) > 20 else ''}")
    if problems:
        raise CheckpointError("cannot load checkpoint:\n  " + "\n  ".join(problems))
    fresh_mtp = [k for k in state if k.startswith("mtp.") and k not in loaded]
    if fresh_mtp:
        log.warning("%s: no MTP weights in the checkpoint; %d MTP tensors initialised fresh", path, len(fresh_mtp))
    return model


def _copy_in(target: torch.Tensor | None, key: str, expert: int | None, value: torch.Tensor) -> str | None:
    """Copy a checkpoint tensor into the model (one expert slice when ``expert`` is set)."""
    if target is None:
        return f"unexpected tensor (the model has no {key})"
    if expert is not None:
        if not 0 <= expert < target.shape[0]:
            return f"expert index {expert} out of range for {key} with {target.shape[0]} experts"
        target = target[expert]
    if tuple(value.shape) != tuple(target.shape):
        return f"shape {tuple(value.shape)} does not match the config's {tuple(target.shape)} for {key}"
    with torch.no_grad():
        target.copy_(value.to(target.dtype))
    return None
