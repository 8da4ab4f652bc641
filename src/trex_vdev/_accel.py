"""``torch.accelerator`` functions that PyTorch cannot serve for a Python-registered backend.

``torch.accelerator.synchronize / memory_* / empty_cache / get_memory_info /
get_device_capability`` go to the C++ device guard or the C++ device allocator, which a backend
registered from Python does not have (they raise "Backend doesn't support ..." or assert
"Allocator for vdev is not a DeviceAllocator"; ``empty_host_cache`` can even segfault).
``device_count / current_device_index / set_device_index`` go to the Python device guard, which
hard-codes one device. So device-agnostic code that uses ``torch.accelerator`` does not fail on
vdev where it would work on CUDA or NPU, these are routed to ``torch.vdev`` while the accelerator
is vdev. Set ``TREX_VDEV_PATCH_ACCELERATOR=0`` before the import to leave torch untouched.
"""

from __future__ import annotations

import functools

import torch
import torch.accelerator
import torch.accelerator.memory

from trex_vdev import _module

_SUPPORTED_DTYPES = {
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
    torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool,
}


def _set_device_index(device, /) -> None:
    idx = _module._index(device)
    if idx >= 0:
        _module.set_device(idx)


def _get_device_capability(device=None, /):
    _module._check(_module._index(device))
    return {"supported_dtypes": set(_SUPPORTED_DTYPES)}


def _synchronize(device=None, /) -> None:
    _module.synchronize(device)


def _memory_stats(device_index=None, /):
    return _module.memory_stats(device_index)


REPLACEMENTS = {
    "device_count": _module.device_count,
    "current_device_index": _module.current_device,
    "set_device_index": _set_device_index,
    "synchronize": _synchronize,
    "get_device_capability": _get_device_capability,
    "empty_cache": _module.empty_cache,
    "empty_host_cache": _module.empty_cache,
    "memory_stats": _memory_stats,
    "memory_allocated": _module.memory_allocated,
    "max_memory_allocated": _module.max_memory_allocated,
    "memory_reserved": _module.memory_reserved,
    "max_memory_reserved": _module.max_memory_reserved,
    "reset_accumulated_memory_stats": _module.reset_accumulated_memory_stats,
    "reset_peak_memory_stats": _module.reset_peak_memory_stats,
    "get_memory_info": _module.mem_get_info,
}


def _routed(name, original, replacement):
    @functools.wraps(original)
    def routed(*args, **kwargs):
        acc = torch._C._accelerator_getAccelerator()
        if acc is not None and acc.type == _module.DEVICE_TYPE:
            return replacement(*args, **kwargs)
        return original(*args, **kwargs)

    routed._trex_vdev_original = original
    return routed


def patch() -> list[str]:
    patched = []
    for name, replacement in REPLACEMENTS.items():
        for namespace in (torch.accelerator, torch.accelerator.memory):
            original = getattr(namespace, name, None)
            if original is None or hasattr(original, "_trex_vdev_original"):
                continue
            setattr(namespace, name, _routed(name, original, replacement))
            patched.append(f"{namespace.__name__}.{name}")
    return patched
