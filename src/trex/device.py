"""The device layer: the one module in trex that names a vendor.

Everything else asks this module for the device, the process-group backend, memory readings,
RNG state and capabilities. Detection order: an explicit override (argument or ``TREX_DEVICE``),
then ``torch.accelerator`` (CUDA, XPU, Ascend NPU once ``torch_npu`` is imported, any PrivateUse1
device whose plugin ``TREX_DEVICE_PLUGINS`` names), then CPU.

Device *names* with an index ("cuda:0", "npu:3") are used throughout, never bare integers:
integer ids route tensors to CUDA on some stacks and crash elsewhere.
"""

from __future__ import annotations

import functools
import importlib
import os
import platform
import resource
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from trex import atomic

# Backends by device type, used only when torch cannot tell us (see `Device.backend`).
_FALLBACK_BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl", "xpu": "xccl"}
# The environment prefix of each backend's flight recorder (a ring buffer of recent collectives that
# the backend's own watchdog dumps, one file per rank, when a collective times out).
_FLIGHT_RECORDERS = {"nccl": "TORCH_NCCL", "hccl": "TORCH_HCCL"}


def _import_vendor_plugins() -> None:
    """Import out-of-tree device plugins so that torch.accelerator can see them: Ascend's torch_npu when
    installed (it registers "npu" and HCCL), and every module named in ``TREX_DEVICE_PLUGINS``
    (comma-separated; e.g. ``trex_vdev``, the test suite's virtual accelerator, docs/device.md), which
    must import cleanly: a plugin asked for by name that fails is an error, not a CPU run."""
    try:  # Ascend: registers the "npu" device type and the HCCL backend.
        importlib.import_module("torch_npu")
    except Exception:  # noqa: BLE001 - absent or broken plugin means no NPU
        pass
    for name in filter(None, (n.strip() for n in os.environ.get("TREX_DEVICE_PLUGINS", "").split(","))):
        try:
            importlib.import_module(name)
        except ImportError as e:
            raise ValueError(f"TREX_DEVICE_PLUGINS names {name!r}, which does not import: {e}") from None


class DeviceUnavailable(RuntimeError):
    """A device was asked for (``--device``, ``TREX_DEVICE``) that this machine does not have."""


@dataclass(frozen=True)
class Capabilities:
    """What the device does well. ``bf16_fast`` is measured on CPU, not assumed from CPU flags."""

    bf16: bool
    bf16_fast: bool
    fp16: bool
    fp8: bool


@dataclass(frozen=True)
class Device:
    """A device type ("cpu", "cuda", "npu", "xpu") and the local index this process uses."""

    type: str
    index: int = 0

    # ---- naming -------------------------------------------------------------------------
    @property
    def name(self) -> str:
        """The torch device string: "cpu" or "<type>:<index>"."""
        return "cpu" if self.type == "cpu" else f"{self.type}:{self.index}"

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.name)

    @property
    def is_accelerator(self) -> bool:
        return self.type != "cpu"

    def count(self) -> int:
        """Number of devices of this type visible to the process (CPU counts as 1)."""
        if not self.is_accelerator:
            return 1
        return torch.get_device_module(self.type).device_count()

    def set_current(self) -> None:
        if self.is_accelerator:
            torch.get_device_module(self.type).set_device(self.index)

    # ---- distributed --------------------------------------------------------------------
    def backend(self) -> str:
        """Process-group backend for this device: nccl, hccl, xccl or gloo."""
        try:
            return dist.get_default_backend_for_device(self.type)
        except (RuntimeError, ValueError, AttributeError):
            return _FALLBACK_BACKENDS.get(self.type, "gloo")

    def flight_recorder_env(self, dump_prefix: str, entries: int = 2000) -> dict[str, str]:
        """Environment that turns on the backend's flight recorder: the last ``entries`` collectives,
        dumped to ``dump_prefix<rank>`` when a collective times out. Set it before the process group
        starts; empty where the backend has none (gloo)."""
        prefix = _FLIGHT_RECORDERS.get(self.backend())
        if prefix is None:
            return {}
        return {f"{prefix}_TRACE_BUFFER_SIZE": str(entries), f"{prefix}_DUMP_ON_TIMEOUT": "1",
                f"{prefix}_DEBUG_INFO_TEMP_FILE": dump_prefix}

    def engine_broadcast(self) -> "EngineBroadcast":
        """A broadcast channel from this process (rank 0) to an inference engine's workers outside any
        torch process group, joined through a unique id both sides share (as vLLM's weight transfer does):
        CUDA's NCCL communicator; DeviceUnavailable elsewhere (no vendor exposes one to Python)."""
        if self.type != "cuda":
            raise DeviceUnavailable(f"no engine weight broadcast on {self.type}: use the disk transport")
        return _CudaEngineBroadcast(self)

    # ---- timing and memory --------------------------------------------------------------
    def synchronize(self) -> None:
        if self.is_accelerator:
            torch.get_device_module(self.type).synchronize(self.index)

    def memory_allocated(self) -> int:
        """Bytes currently held: allocator bytes on accelerators, resident set size on CPU."""
        if self.is_accelerator:
            return int(torch.get_device_module(self.type).memory_allocated(self.index))
        return _rss_bytes()

    def max_memory_allocated(self) -> int:
        """Peak bytes since the last reset: allocator peak on accelerators, peak RSS on CPU."""
        if self.is_accelerator:
            return int(torch.get_device_module(self.type).max_memory_allocated(self.index))
        return _peak_rss_bytes()

    def reset_peak_memory(self) -> bool:
        """Reset the peak reading; True when it was reset. On CPU the kernel's high-water mark (VmHWM)
        is reset where Linux allows (``/proc/self/clear_refs``); where it does not (some containers,
        gVisor), False, and ``max_memory_allocated`` stays the process's lifetime peak."""
        if self.is_accelerator:
            torch.get_device_module(self.type).reset_peak_memory_stats(self.index)
            return True
        return _reset_peak_rss()

    def profiler_activities(self) -> list:
        """What ``torch.profiler`` records for work on this device: the host's ops, plus the device's
        kernels where this torch's profiler supports the device (CUDA, XPU; a PrivateUse1 plugin
        such as Ascend's torch_npu); without one, the host's ops alone."""
        from torch.profiler import ProfilerActivity, supported_activities

        activities = [ProfilerActivity.CPU]
        if self.is_accelerator:
            kind = {"cuda": "CUDA", "xpu": "XPU", "mtia": "MTIA", "hpu": "HPU"}.get(self.type, "PrivateUse1")
            activity = getattr(ProfilerActivity, kind, None)
            if activity is not None and activity in supported_activities():
                activities.append(activity)
        return activities

    def total_memory(self) -> int:
        if self.is_accelerator:
            return int(torch.get_device_module(self.type).get_device_properties(self.index).total_memory)
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    # ---- RNG ----------------------------------------------------------------------------
    def get_rng_state(self) -> dict[str, torch.Tensor]:
        state = {"cpu": torch.get_rng_state()}
        if self.is_accelerator:
            state[self.type] = torch.get_device_module(self.type).get_rng_state(self.index)
        return state

    def set_rng_state(self, state: dict[str, torch.Tensor]) -> None:
        torch.set_rng_state(state["cpu"])
        if self.is_accelerator and self.type in state:
            torch.get_device_module(self.type).set_rng_state(state[self.type], self.index)

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)  # seeds every device's default generator too

    # ---- determinism --------------------------------------------------------------------
    def set_deterministic(self, enabled: bool = True) -> None:
        """Deterministic kernels and collectives, with each backend's own switches."""
        torch.use_deterministic_algorithms(enabled, warn_only=True)
        if self.type == "cuda":
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8" if enabled else ""
            torch.backends.cudnn.deterministic = enabled
            torch.backends.cudnn.benchmark = not enabled
        elif self.type == "npu":
            os.environ["HCCL_DETERMINISTIC"] = "true" if enabled else "false"

    # ---- capabilities -------------------------------------------------------------------
    def compiles(self) -> bool:
        """Whether torch.compile has a backend for this device type: Inductor knows how to generate
        its kernels (built in for CPU, CUDA, XPU; a vendor plugin registers its own, as Ascend's does)."""
        from torch._inductor.codegen.common import get_scheduling_for_device, init_backend_registration

        init_backend_registration()
        return get_scheduling_for_device(self.type) is not None

    def capabilities(self) -> Capabilities:
        return _capabilities(self.type, self.index)

    def default_dtype(self) -> torch.dtype:
        """bf16 on accelerators with fast bf16 matmul; fp32 on CPU and elsewhere.

        CPU runs are for correctness and small jobs, where fp32 is the reference precision;
        bf16 on CPU is an explicit choice (`bf16_fast` says whether it will be quick).
        """
        if self.is_accelerator and self.capabilities().bf16_fast:
            return torch.bfloat16
        return torch.float32


class EngineBroadcast:
    """``unique_id()`` (bytes for the other side), ``join(uid, world_size)`` as rank 0, ``send(tensor)``."""


class _CudaEngineBroadcast(EngineBroadcast):
    def __init__(self, device: Device):
        import torch.cuda.nccl as nccl

        self.device, self.nccl, self.comm = device, nccl, None

    def unique_id(self) -> bytes:
        return bytes(self.nccl.unique_id())

    def join(self, uid: bytes, world_size: int) -> None:
        self.comm = self.nccl.init_rank(world_size, uid, 0)

    def send(self, t: torch.Tensor) -> None:
        self.nccl.broadcast([t.to(self.device.torch_device)], root=0, comms=[self.comm])


def detect(override: str | None = None) -> Device:
    """The device this process should use.

    ``override`` (or ``TREX_DEVICE``) is a device string such as "cpu", "cuda", "npu:1".
    Without an index, the local rank (``LOCAL_RANK``) picks the device on accelerators.
    """
    _import_vendor_plugins()
    spec = override or os.environ.get("TREX_DEVICE")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if spec:
        dev_type, _, idx = spec.partition(":")
        if dev_type != "cpu" and not _type_available(dev_type):
            raise DeviceUnavailable(
                f"device {spec!r} was requested (TREX_DEVICE or --device) but torch sees no "
                f"{dev_type!r} device; available: {available_types()}"
            )
        return Device(dev_type, int(idx) if idx else (0 if dev_type == "cpu" else local_rank))
    if torch.accelerator.is_available():
        acc = torch.accelerator.current_accelerator()
        count = torch.accelerator.device_count()
        return Device(acc.type, local_rank % max(count, 1))
    return Device("cpu", 0)


def available_types() -> list[str]:
    _import_vendor_plugins()
    types = ["cpu"]
    if torch.accelerator.is_available():
        types.append(torch.accelerator.current_accelerator().type)
    return types


def _type_available(dev_type: str) -> bool:
    try:
        return torch.get_device_module(dev_type).is_available()
    except (RuntimeError, AttributeError):
        return False


# ---- memory on CPU --------------------------------------------------------------------------
def _read_status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _rss_bytes() -> int:
    kib = _read_status_kib("VmRSS")
    return kib * 1024 if kib is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _peak_rss_bytes() -> int:
    kib = _read_status_kib("VmHWM")
    return kib * 1024 if kib is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _reset_peak_rss() -> bool:
    # Writing "5" to clear_refs resets VmHWM to the current RSS (Linux >= 4.0). A sandbox may refuse the
    # write or accept it and do nothing: the reset counts only if the high-water mark came down to RSS.
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    hwm, rss = _read_status_kib("VmHWM"), _read_status_kib("VmRSS")
    return hwm is not None and rss is not None and hwm <= rss + 1024


# ---- capabilities -----------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _capabilities(dev_type: str, index: int) -> Capabilities:
    if dev_type == "cpu":
        fast = measure_cpu_bf16_speedup() >= 0.5
        return Capabilities(bf16=True, bf16_fast=fast, fp16=True, fp8=False)
    if dev_type == "cuda":
        major, minor = torch.cuda.get_device_capability(index)
        bf16 = torch.cuda.is_bf16_supported()
        return Capabilities(bf16=bf16, bf16_fast=bf16, fp16=True, fp8=(major, minor) >= (8, 9))
    if dev_type == "npu":  # Ascend 910B/910C: bf16 and fp16 cube units, no fp8 matmul
        return Capabilities(bf16=True, bf16_fast=True, fp16=True, fp8=False)
    # any other device type (a new vendor's plugin): what its device module says, and bf16 timed
    module = torch.get_device_module(dev_type)
    bf16 = bool(getattr(module, "is_bf16_supported", lambda: True)())
    name = f"{dev_type}:{index}"
    fast = bf16 and measure_cpu_bf16_speedup(device=name) >= 0.5
    return Capabilities(bf16=bf16, bf16_fast=fast, fp16=True, fp8=False)


def measure_cpu_bf16_speedup(n: int = 256, repeats: int = 3, device: str = "cpu") -> float:
    """fp32 matmul time / bf16 matmul time on ``device`` (>1 means bf16 is faster): the CPU, or a
    device type trex has no facts about.

    CPU flags are not enough: some CPUs report AVX512-BF16 while torch's bf16 GEMM still
    runs far slower than fp32, so this times both.
    """
    sync = (lambda: None) if device == "cpu" else torch.get_device_module(device.split(":")[0]).synchronize

    def best(dtype: torch.dtype) -> float:
        a = torch.randn(n, n, device=device).to(dtype)
        a @ a  # warm-up
        times = []
        for _ in range(repeats):
            sync()
            t0 = time.perf_counter()
            a @ a
            sync()
            times.append(time.perf_counter() - t0)
        return min(times)

    return best(torch.float32) / max(best(torch.bfloat16), 1e-9)


def measure_matmul_flops(device: Device, dtype: torch.dtype = torch.float32, n: int = 1024, repeats: int = 5) -> float:
    """Measured dense matmul throughput in FLOP/s, best of ``repeats`` (the MFU peak on CPU)."""
    a = torch.randn(n, n, device=device.torch_device, dtype=dtype)
    a @ a
    best = float("inf")
    for _ in range(repeats):
        device.synchronize()
        t0 = time.perf_counter()
        a @ a
        device.synchronize()
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def cached_peak_flops(device: Device, dtype: torch.dtype, cache_dir: str | None = None) -> tuple[float, str]:
    """A stable MFU denominator where no hardware profile applies: the best dense-matmul rate this
    machine has shown for ``dtype`` at this thread count, kept in ``<cache_dir>/peak_flops.json``
    (default ``$TREX_CACHE_DIR`` or ``~/.cache/trex``). Each call measures (best of 5 at n=512)
    and keeps the maximum, so a measurement taken while the machine was busy is not the
    denominator for long. Returns (FLOP/s, where it came from)."""
    import json
    import platform

    cache_dir = cache_dir or os.environ.get("TREX_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache",
                                                                             "trex")
    path = os.path.join(cache_dir, "peak_flops.json")
    key = f"{platform.machine()} {platform.processor() or _cpu_model()} | {device.type} {str(dtype)} | " \
          f"{torch.get_num_threads()} threads | torch {torch.__version__}"
    try:
        with open(path) as f:
            cache = json.load(f)
    except (OSError, ValueError):
        cache = {}
    measured = measure_matmul_flops(device, dtype, n=512, repeats=5)
    best = max(measured, float(cache.get(key, 0.0)))
    if best > cache.get(key, 0.0):
        cache[key] = best
        try:
            os.makedirs(cache_dir, exist_ok=True)
            atomic.write_json(path, cache, indent=1)
        except OSError:  # a read-only home: the measurement still serves this run
            pass
    return best, f"best measured {str(dtype).replace('torch.', '')} matmul on this machine ({path})"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "cpu")
    except OSError:
        return "cpu"


# ---- environment report -------------------------------------------------------------------------
def _version(module: str) -> str | None:
    try:
        return getattr(importlib.import_module(module), "__version__", "unknown")
    except Exception:  # noqa: BLE001
        return None


def _cann_version() -> str | None:
    home = os.environ.get("ASCEND_TOOLKIT_HOME") or os.environ.get("ASCEND_HOME_PATH")
    if not home:
        return None
    for rel in ("version.cfg", "compiler/version.info", "version.info"):
        path = os.path.join(home, rel)
        if os.path.exists(path):
            with open(path) as f:
                for line in f:
                    if "version" in line.lower():
                        return line.split("=", 1)[-1].strip()
    return "unknown"


def identity(report: dict) -> dict:
    """The device type and name of an :func:`environment_report` (as recorded in a run or a fidelity
    result): what a portability report matches against a hardware profile. Empty when it states none."""
    return {k: report[k] for k in ("device_type", "device_name") if report.get(k)}


def environment_report(device: Device | None = None) -> dict:
    """What `trex doctor` prints: device, versions, backend and capabilities."""
    device = device or detect()
    report = {
        "device": device.name,
        "device_type": device.type,
        "device_count": device.count(),
        "backend": device.backend(),
        "torch": torch.__version__,
        "torch_npu": _version("torch_npu"),
        "cann": _cann_version(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_threads": torch.get_num_threads(),
        "capabilities": asdict(device.capabilities()),
        "default_dtype": str(device.default_dtype()).replace("torch.", ""),
    }
    if device.is_accelerator:
        props = torch.get_device_module(device.type).get_device_properties(device.index)
        report["device_name"] = getattr(props, "name", device.type)
        report["driver_cuda"] = torch.version.cuda if device.type == "cuda" else None
    return report
