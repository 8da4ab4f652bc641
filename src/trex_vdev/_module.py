"""The device module registered as ``torch.vdev`` (``torch.get_device_module("vdev")``).

It mirrors the parts of ``torch.cuda`` / ``torch.npu`` that device-agnostic code calls.
RNG functions act on the CPU default generator: vdev has no generator of its own, so a seeded
run on vdev draws exactly the numbers a seeded CPU run draws (and seeding vdev seeds CPU).
Memory functions report the bytes of the CPU storages held by live vdev tensors. Streams and
events (``Stream``, ``Event``, ``stream``, ``current_stream``) have torch.cuda's signatures and do
nothing: every vdev op runs synchronously.
"""

from __future__ import annotations

import os
import threading
from collections import namedtuple
from typing import Any

import torch

from trex_vdev import _tensor

DEVICE_TYPE = _tensor.DEVICE_TYPE

_state = threading.local()


def _count() -> int:
    try:
        return max(1, int(os.environ.get("TREX_VDEV_COUNT", "1")))
    except ValueError:
        return 1


def _index(device: Any = None) -> int:
    """Device index from None / int / "vdev" / "vdev:1" / torch.device."""
    if device is None:
        return current_device()
    if isinstance(device, int):
        return device
    dev = torch.device(device)
    if dev.type != DEVICE_TYPE:
        raise ValueError(f"trex_vdev: expected a {DEVICE_TYPE} device, got {dev}")
    return current_device() if dev.index is None else dev.index


def _check(index: int) -> int:
    if not 0 <= index < device_count():
        raise RuntimeError(f"trex_vdev: invalid device index {index} (device_count() == {device_count()})")
    return index


# ---- availability and selection ----------------------------------------------------------------
def is_available() -> bool:
    return True


def is_initialized() -> bool:
    return True


def init() -> None:
    pass


def _lazy_init() -> None:
    pass


def _is_in_bad_fork() -> bool:
    return False


def device_count() -> int:
    return _count()


def current_device() -> int:
    return getattr(_state, "index", 0)


def set_device(device: Any) -> None:
    _state.index = _check(_index(device))


class device:
    """Context manager that selects a vdev device index (like ``torch.cuda.device``)."""

    def __init__(self, device: Any):
        self.idx = -1 if device is None else _index(device)
        self.prev_idx = -1

    def __enter__(self):
        self.prev_idx = current_device()
        if self.idx >= 0:
            set_device(self.idx)
        return self

    def __exit__(self, *exc):
        if self.idx >= 0:
            set_device(self.prev_idx)
        return False


class device_of(device):
    def __init__(self, obj: torch.Tensor):
        super().__init__(obj.get_device() if obj.device.type == DEVICE_TYPE else -1)


def synchronize(device: Any = None) -> None:
    """Nothing to wait for: every vdev op runs synchronously on CPU."""


def get_device_name(device: Any = None) -> str:
    return "trex virtual device (CPU memory)"


def get_device_capability(device: Any = None) -> tuple[int, int]:
    return (0, 0)


_Props = namedtuple("_Props", "name total_memory multi_processor_count major minor is_virtual")


def get_device_properties(device: Any = None) -> Any:
    """``name``, ``total_memory`` (``TREX_VDEV_TOTAL_MEMORY`` bytes, else physical RAM)."""
    _check(_index(device))
    total = os.environ.get("TREX_VDEV_TOTAL_MEMORY")
    if total is None:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return _Props(get_device_name(device), int(total), os.cpu_count() or 1, 0, 0, True)


def is_bf16_supported(including_emulation: bool = True) -> bool:
    return True


def get_amp_supported_dtype() -> list[torch.dtype]:
    return [torch.float16, torch.bfloat16]


# ---- RNG: the CPU generator -----------------------------------------------------------------------
def manual_seed(seed: int) -> None:
    torch.default_generator.manual_seed(int(seed))


def manual_seed_all(seed: int) -> None:
    torch.default_generator.manual_seed(int(seed))


def seed() -> None:
    torch.default_generator.seed()


def seed_all() -> None:
    torch.default_generator.seed()


def initial_seed() -> int:
    return torch.default_generator.initial_seed()


def get_rng_state(device: Any = None) -> torch.Tensor:
    return torch.default_generator.get_state()


def set_rng_state(new_state: torch.Tensor, device: Any = None) -> None:
    torch.default_generator.set_state(new_state.cpu() if new_state.device.type != "cpu" else new_state)


def get_rng_state_all() -> list[torch.Tensor]:
    return [get_rng_state(i) for i in range(device_count())]


def set_rng_state_all(new_states: list[torch.Tensor]) -> None:
    for i, s in enumerate(new_states):
        set_rng_state(s, i)


default_generators = (torch.default_generator,)


# ---- memory ---------------------------------------------------------------------------------------
def memory_allocated(device: Any = None) -> int:
    return _tensor.memory_allocated(_index(device))


def max_memory_allocated(device: Any = None) -> int:
    return _tensor.max_memory_allocated(_index(device))


def memory_reserved(device: Any = None) -> int:
    return memory_allocated(device)


def max_memory_reserved(device: Any = None) -> int:
    return max_memory_allocated(device)


def reset_peak_memory_stats(device: Any = None) -> None:
    _tensor.reset_peak_memory_stats(_index(device))


reset_max_memory_allocated = reset_peak_memory_stats


def reset_accumulated_memory_stats(device: Any = None) -> None:
    pass


def memory_stats(device: Any = None) -> dict[str, int]:
    cur, peak = memory_allocated(device), max_memory_allocated(device)
    return {
        "allocated_bytes.all.current": cur,
        "allocated_bytes.all.peak": peak,
        "reserved_bytes.all.current": cur,
        "reserved_bytes.all.peak": peak,
    }


def mem_get_info(device: Any = None) -> tuple[int, int]:
    total = get_device_properties(device).total_memory
    return max(0, total - memory_allocated(device)), total


def empty_cache() -> None:
    pass


# ---- streams: one synchronous default stream ------------------------------------------------------
# Every vdev op runs synchronously, so streams and events only need the API of torch.cuda's
# (FSDP2's device handle calls ``Stream(priority=...)``, ``wait_stream``, ``record_event``,
# ``wait_event``, ``Event().record()``, ``event.synchronize()``). They are ``torch.Stream`` /
# ``torch.Event`` subclasses, so the generic C++ methods accept them; all report index 0.
class Event(torch.Event):
    """A vdev event (``torch.cuda.Event``'s signature). Always complete: vdev work is synchronous."""

    def __new__(cls, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False,
                device: Any = None):
        return super().__new__(cls, device=torch.device(DEVICE_TYPE, _index(device)),
                               enable_timing=enable_timing, blocking=blocking, interprocess=interprocess)

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass


class Stream(torch.Stream):
    """A vdev stream (``torch.cuda.Stream``'s signature); work on it runs synchronously."""

    def __new__(cls, device: Any = None, priority: int = 0, **kwargs: Any):
        return super().__new__(cls, device=torch.device(DEVICE_TYPE, _index(device)), priority=priority)

    def record_event(self, event: Any = None) -> Event:
        event = Event() if event is None else event
        event.record(self)
        return event

    def wait_event(self, event: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


def current_stream(device: Any = None) -> Stream:
    return Stream(device)


default_stream = current_stream


class stream:
    """No-op stream context (vdev has a single synchronous stream)."""

    def __init__(self, stream: Any = None):
        self.stream = stream

    def __enter__(self):
        return self.stream

    def __exit__(self, *exc):
        return False


StreamContext = stream


def set_stream(stream: Any) -> None:
    pass
