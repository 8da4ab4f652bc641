"""What a profiled step would take on a named accelerator, class by class, from its ops alone.

Each op of the trace (trex.profile.classes.Unit: FLOPs, bytes, dtype) is priced on a hardware
profile (trex.hardware) by the roofline: the longer of its FLOPs at the profile's dense peak for its
dtype and its bytes at the profile's memory bandwidth. Two forms:

- **eager**: every op is a kernel of its own and takes at least ``kernel_us`` (launch and tail);
- **compiled**: what Inductor fuses: each run of consecutive memory-bound ops (no FLOPs) of one class
  and phase becomes one kernel that moves as many bytes as the largest op in the run; GEMMs and
  attention kernels stay as they are.

Both are ideal (peak FLOP/s and bandwidth): a measured table on the device calibrates them
(``measured / estimated`` per class). ``as_dtype`` prices the model's fp32 work as if the run were
in that precision (a CPU fp32 trace estimated for a bf16 device run): FLOPs at that peak, bytes
scaled by the element size, except the classes trex keeps in fp32 by design (norms and mHC, the head
and loss, the optimizer). Communication is not priced (no links in one trace): it is left out.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

from trex.hardware import HardwareProfile
from trex.profile.classes import Unit

FP32_BY_DESIGN = ("norm_mhc", "head_loss", "optimizer/")
ITEM_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}


def unit_seconds(u: Unit, hw: HardwareProfile, as_dtype: str | None = None) -> float:
    """The roofline time of one op on ``hw`` (no launch floor)."""
    dtype, nbytes = u.dtype, u.bytes
    if as_dtype and dtype == "fp32" and not u.cls.startswith(FP32_BY_DESIGN):
        dtype, nbytes = as_dtype, nbytes * ITEM_BYTES[as_dtype] / 4
    peak = hw.peak_tflops.get(dtype, hw.peak_tflops.get("fp32", 0.0)) * 1e12
    compute = u.flops / peak if u.flops and peak else 0.0
    return max(compute, nbytes / (hw.memory_gbps * 1e9))


def fused(units: Iterable[Unit]) -> list[Unit]:
    """The kernels a compiler would run: consecutive memory-bound ops of one class and phase merged."""
    out: list[Unit] = []
    for u in units:
        last = out[-1] if out else None
        if (u.flops == 0 and last is not None and last.flops == 0 and last.cls == u.cls
                and last.phase == u.phase):
            last.bytes = max(last.bytes, u.bytes)
            last.launches += 1
            continue
        out.append(Unit(u.name, u.cls, u.phase, u.flops, u.bytes, u.dtype))
    return out


def estimate(units: list[Unit], hw: HardwareProfile, steps: int, as_dtype: str | None = None,
             micro_batches: int = 1) -> dict:
    """Per class and in total, seconds per step on ``hw``, eager and compiled; kernels per step.

    ``units`` are ``steps`` steps' ops (as trex.profile.classes records them). ``micro_batches``: the
    units hold one micro-batch's forward and backward of a step that runs this many (gradient
    accumulation) and one optimizer update."""
    if hw.memory_gbps <= 0:
        raise ValueError(f"hardware profile {hw.name!r} states no memory_gbps: no device estimate")
    floor = hw.kernel_us * 1e-6
    kept = [u for u in units if u.cls != "communication"]
    eager: dict[str, float] = defaultdict(float)
    kernels: dict[str, int] = defaultdict(int)
    for u in kept:
        times = 1 if u.phase == "optimizer" else micro_batches
        eager[u.cls] += max(unit_seconds(u, hw, as_dtype), floor) * times
        kernels[u.cls] += times
    compiled: dict[str, float] = defaultdict(float)
    fused_kernels: dict[str, int] = defaultdict(int)
    for u in fused(kept):
        times = 1 if u.phase == "optimizer" else micro_batches
        compiled[u.cls] += max(unit_seconds(u, hw, as_dtype), floor) * times
        fused_kernels[u.cls] += times
    classes = {c: {"eager_s": eager[c] / steps, "compiled_s": compiled[c] / steps,
                   "kernels_eager": round(kernels[c] / steps), "kernels_compiled": round(fused_kernels[c] / steps)}
               for c in eager}
    return {"hardware": hw.name, "as_dtype": as_dtype, "memory_gbps": hw.memory_gbps, "kernel_us": hw.kernel_us,
            "eager_s": sum(eager.values()) / steps, "compiled_s": sum(compiled.values()) / steps, "classes": classes}
