"""``trex doctor``: check a machine (or a whole job) before launching training.

Single process: the device and how many, the torch, accelerator plugin, toolkit and driver
versions the device layer finds, the process-group backend, and bf16 / fp16 / fp8 matmul
measured on the device (accuracy against fp32 and speed relative to fp32), never assumed.

Under torchrun (``WORLD_SIZE`` > 1) it also runs a collective smoke test on the backend the device
layer picks: all-reduce and all-to-all with exact expected values, then their bus bandwidth, and
names every rank whose result was wrong or whose collective raised.

    trex doctor --format json
    torchrun --nproc-per-node 8 -m trex doctor
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import sys
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from trex import device as device_layer
from trex import logs
from trex.atomic import strict_json

# Relative Frobenius error of an n x n matmul against fp32 that still counts as working.
_TOLERANCE = {"bf16": 3e-2, "fp16": 5e-3, "fp8": 1.5e-1}
# speedup over fp32 above which a precision counts as fast: half fp32 speed for bf16/fp16 (the device layer's
# bf16_fast threshold: they halve memory and traffic); fp8 only when it beats fp32, the one reason to use it
# (a CPU's FP8 kernel runs at ~0.5x fp32, which a half-speed threshold would call fast one run in two)
_FAST = {"bf16": 0.5, "fp16": 0.5, "fp8": 1.0}
_CHUNK = 4  # elements each rank sends to each other rank in the all-to-all check


# ---- precision ----------------------------------------------------------------------------------
@dataclass
class PrecisionProbe:
    supported: bool
    rel_error: float | None = None  # ||low - fp32|| / ||fp32|| for one matmul
    speedup_vs_fp32: float | None = None  # fp32 time / low-precision time; > 1 is faster
    fast: bool = False  # at least _FAST[name] x fp32 speed
    error: str | None = None  # why it is unsupported


def _best_time(dev: device_layer.Device, fn, repeats: int) -> float:
    fn()  # warm-up
    dev.synchronize()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        dev.synchronize()
        best = min(best, time.perf_counter() - t0)
    return max(best, 1e-9)


def probe_precision(dev: device_layer.Device, name: str, n: int = 256, repeats: int = 3) -> PrecisionProbe:
    """Run one n x n matmul in ``name`` (bf16, fp16 or fp8 e4m3 with unit scales) on the device."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=gen).to(dev.torch_device)
    b = torch.randn(n, n, generator=gen).to(dev.torch_device)
    reference = a @ b
    if name == "fp8":
        a_lp, b_lp = a.to(torch.float8_e4m3fn), b.t().contiguous().t().to(torch.float8_e4m3fn)
        one = torch.ones((), device=dev.torch_device)

        def matmul():
            return torch._scaled_mm(a_lp, b_lp, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    else:
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[name]
        a_lp, b_lp = a.to(dtype), b.to(dtype)

        def matmul():
            return a_lp @ b_lp
    try:
        out = matmul().float()
    except Exception as exc:  # noqa: BLE001 - any failure of the kernel means "unsupported here"
        return PrecisionProbe(supported=False, error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
    rel = float((out - reference).norm() / reference.norm())
    if not torch.isfinite(out).all() or rel > _TOLERANCE[name]:
        return PrecisionProbe(supported=False, rel_error=rel,
                              error=f"result off by {rel:.3g} (tolerance {_TOLERANCE[name]})")
    speedup = _best_time(dev, lambda: a @ b, repeats) / _best_time(dev, matmul, repeats)
    return PrecisionProbe(supported=True, rel_error=rel, speedup_vs_fp32=speedup, fast=speedup >= _FAST[name])


def precision_report(dev: device_layer.Device) -> dict[str, dict]:
    return {name: asdict(probe_precision(dev, name)) for name in ("bf16", "fp16", "fp8")}


# ---- collectives ----------------------------------------------------------------------------------
def all_reduce_error(result: torch.Tensor, world: int) -> str | None:
    """Check a SUM all-reduce of ``arange(n) * (rank + 1)`` over ``world`` ranks; None if exact."""
    result = result.cpu()
    expected = torch.arange(result.numel(), dtype=result.dtype) * (world * (world + 1) // 2)
    wrong = (result != expected).nonzero()
    if len(wrong) == 0:
        return None
    i = int(wrong[0])
    return f"{len(wrong)} of {result.numel()} elements wrong; element {i}: expected {expected[i].item()}, got {result[i].item()}"


def all_to_all_input(rank: int, world: int, chunk: int = _CHUNK) -> torch.Tensor:
    """Chunk j (sent to rank j) holds ``rank * 1000 + j``."""
    return (rank * 1000 + torch.arange(world, dtype=torch.float32)).repeat_interleave(chunk)


def all_to_all_error(result: torch.Tensor, rank: int, world: int, chunk: int = _CHUNK) -> str | None:
    """Chunk i received from rank i must hold ``i * 1000 + rank``; names the senders whose chunk was wrong."""
    received = result.cpu().view(world, chunk)
    bad = [i for i in range(world) if not bool((received[i] == i * 1000 + rank).all())]
    if not bad:
        return None
    return "; ".join(f"chunk from rank {i}: expected {i * 1000 + rank}, got {received[i].tolist()}" for i in bad)


def _bus_bandwidth(dev: device_layer.Device, op: str, numel: int, iters: int, world: int) -> float:
    """Bus bandwidth in GB/s, slowest rank's time: all-reduce moves 2(n-1)/n of the message, all-to-all (n-1)/n."""
    x = torch.ones(numel, device=dev.torch_device)
    y = torch.empty_like(x)

    def run():
        if op == "all_reduce":
            dist.all_reduce(x)
        else:
            dist.all_to_all_single(y, x)

    run()
    dev.synchronize()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        run()
    dev.synchronize()
    elapsed = torch.tensor([(time.perf_counter() - t0) / iters], device=dev.torch_device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    factor = 2 * (world - 1) / world if op == "all_reduce" else (world - 1) / world
    return x.numel() * x.element_size() * factor / float(elapsed) / 1e9


def _rank_checks(dev: device_layer.Device, rank: int, world: int, numel: int, iters: int) -> dict:
    """Run each collective on this rank; errors (wrong values or exceptions) are kept per check."""
    errors: dict[str, str] = {}
    bandwidth: dict[str, float] = {}
    try:
        x = (torch.arange(1024, dtype=torch.float32) * (rank + 1)).to(dev.torch_device)
        dist.all_reduce(x)
        if problem := all_reduce_error(x, world):
            errors["all_reduce"] = problem
    except Exception as exc:  # noqa: BLE001 - a failing collective is the finding
        errors["all_reduce"] = f"raised {type(exc).__name__}: {exc}"
    try:
        out = torch.empty(world * _CHUNK, device=dev.torch_device)
        dist.all_to_all_single(out, all_to_all_input(rank, world).to(dev.torch_device))
        if problem := all_to_all_error(out, rank, world):
            errors["all_to_all"] = problem
    except Exception as exc:  # noqa: BLE001
        errors["all_to_all"] = f"raised {type(exc).__name__}: {exc}"
    if not errors:
        for op in ("all_reduce", "all_to_all"):
            bandwidth[op] = _bus_bandwidth(dev, op, numel, iters, world)
    return {"rank": rank, "host": socket.gethostname(), "device": dev.name, "errors": errors,
            "busbw_GBps": bandwidth}


def failed_ranks(per_rank: list[dict]) -> list[str]:
    """One line per failing rank and check: 'rank 3 (host, cpu): all_to_all: ...'."""
    return [f"rank {r['rank']} ({r['host']}, {r['device']}): {check}: {problem}"
            for r in sorted(per_rank, key=lambda r: r["rank"]) for check, problem in r["errors"].items()]


def collective_report(dev: device_layer.Device, size_mb: float, iters: int, timeout_s: float) -> dict:
    """Initialise the default process group from torchrun's environment and test it."""
    backend = dev.backend()
    dev.set_current()
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        numel = max(int(size_mb * 2**20) // 4 // world * world, world)
        mine = _rank_checks(dev, rank, world, numel, iters)
        per_rank: list = [None] * world
        try:
            dist.all_gather_object(per_rank, mine)
        except Exception as exc:  # noqa: BLE001 - cannot collect: report this rank alone, loudly
            print(f"trex doctor: rank {rank}: could not gather results ({exc}); "
                  f"this rank: {failed_ranks([mine]) or 'ok'}", file=sys.stderr)
            per_rank = [mine]
        bandwidth = {op: min((r["busbw_GBps"].get(op, 0.0) for r in per_rank), default=0.0)
                     for op in ("all_reduce", "all_to_all")}
        return {"backend": backend, "world_size": world, "message_mb": numel * 4 / 2**20,
                "ok": not failed_ranks(per_rank), "failures": failed_ranks(per_rank),
                "busbw_GBps": bandwidth, "ranks": per_rank}
    finally:
        dist.destroy_process_group()


# ---- command ----------------------------------------------------------------------------------------
def under_torchrun() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def doctor_report(dev: device_layer.Device, size_mb: float, iters: int, timeout_s: float) -> dict:
    report = {"environment": device_layer.environment_report(dev), "precision": precision_report(dev)}
    if under_torchrun():
        report["distributed"] = collective_report(dev, size_mb, iters, timeout_s)
    else:
        report["distributed"] = {"skipped": "not launched by torchrun (WORLD_SIZE unset or 1); "
                                            "run `torchrun --nproc-per-node N -m trex doctor` for the collective test"}
    report["ok"] = report["distributed"].get("ok", True)
    return report


def to_text(report: dict) -> str:
    out = ["environment"]
    out += [f"  {k:>16}: {v}" for k, v in report["environment"].items()]
    out.append("precision (matmul measured on the device)")
    for name, probe in report["precision"].items():
        if probe["supported"] and probe["fast"]:
            out.append(f"  {name:>16}: ok and fast, rel. error {probe['rel_error']:.2e}, "
                       f"{probe['speedup_vs_fp32']:.2f}x fp32 speed")
        elif probe["supported"]:  # computes, but emulated or slow: the capabilities above say False
            out.append(f"  {name:>16}: computes correctly but slowly (rel. error {probe['rel_error']:.2e}, "
                       f"{probe['speedup_vs_fp32']:.2f}x fp32 speed): not a capability of this device")
        else:
            out.append(f"  {name:>16}: unsupported ({probe['error']})")
    dist_report = report["distributed"]
    out.append("collectives")
    if "skipped" in dist_report:
        out.append(f"  skipped: {dist_report['skipped']}")
    else:
        out.append(f"  {dist_report['backend']} across {logs.plural(dist_report['world_size'], 'rank')}: "
                   + ("all-reduce and all-to-all correct" if dist_report["ok"] else "FAILED"))
        out += [f"  {line}" for line in dist_report["failures"]]
        for op, bw in dist_report["busbw_GBps"].items():
            out.append(f"  {op} bus bandwidth: {bw:.2f} GB/s ({dist_report['message_mb']:.1f} MB messages)")
    out.append("ok" if report["ok"] else "NOT OK")
    return "\n".join(out)


def run(args: argparse.Namespace) -> int:
    """``trex doctor`` (its parser lives in trex.cli, which imports this module only to run it)."""
    dev = device_layer.detect(args.device)
    report = doctor_report(dev, args.size_mb, args.iters, args.timeout)
    if int(os.environ.get("RANK", "0")) == 0:
        print(strict_json(report) if args.format == "json" else to_text(report))  # a NaN error: null
    return 0 if report["ok"] else 1
