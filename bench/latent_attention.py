"""MLA's attention core under context parallelism: per-rank memory of expanding every row's keys and values
(the path before ``latent_attention``) against ``latent_attention.chunked`` (keys and values a chunk at a time).

One rank of a cp group, as MLA runs it: the rank's s = S / cp query rows (rows of the last shard) against the
gathered latent and k_pe of all S rows, forward + backward, at the released per-head shape (qk 128 + 64, v 128,
latent 512 + 64) with fewer heads, fp32, CPU, one thread. Before: ``wkv_b`` over all S rows, then the
``dense_attention`` default (PyTorch's fused attention; on CPU with the values zero-padded). After: the
``latent_attention`` default. Each measurement runs in its own process. Held: the bytes autograd keeps for
backward (saved_tensors_hooks, storage-deduplicated, the weight left out); peak: Linux VmHWM during the
second forward + backward (reset before it; it allocates the gradients afresh) minus VmRSS before it, with glibc
returning freed tensors to the system (``MALLOC_MMAP_THRESHOLD_``), so the peak is what was alive at once;
time: the median of the timed steps after it.

    .venv/bin/python bench/latent_attention.py --write     # S = 8192, 8 heads, cp = 2, 4, 8
    .venv/bin/python bench/latent_attention.py --seq 4096 --cp 4  # printed only
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from model_step import _status_kib, write_docs_section  # noqa: E402

MARK_BEGIN, MARK_END = "<!-- latent-attention-bench:begin -->", "<!-- latent-attention-bench:end -->"
NOPE, ROPE, DV, RANK = 128, 64, 128, 512


def child(method: str, seq: int, cp: int, heads: int, steps: int) -> dict:
    import torch

    from trex import kernels
    from trex.kernels import latent_attention

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    s = seq // cp
    q = torch.randn(1, s, heads, NOPE + ROPE, generator=g).requires_grad_()
    latent = torch.randn(1, seq, RANK, generator=g).requires_grad_()
    k_pe = torch.randn(1, seq, ROPE, generator=g).requires_grad_()
    w = (torch.randn(heads * (NOPE + DV), RANK, generator=g) / RANK ** 0.5).requires_grad_()
    doc = (torch.arange(seq) // (seq // 3 + 1))[None]  # three documents
    d_out = torch.randn(1, s, heads, DV, generator=g)
    q_start = seq - s  # the last shard

    def forward():
        if method == "chunked":
            return latent_attention.chunked(q, latent, k_pe, w, 0.1, doc, q_start)
        k, v = latent_attention.expand(latent, k_pe, w, heads, NOPE)
        return kernels.get("dense_attention", "cpu")(q, k, v, 0.1, doc, q_start=q_start)

    held: dict[int, int] = {}

    def pack(t):
        if t.untyped_storage().data_ptr() != w.untyped_storage().data_ptr():
            held[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward().backward(d_out)  # warm-up (the libraries' first-call set-up); what is saved
    q.grad = latent.grad = k_pe.grad = w.grad = None
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    before = _status_kib("VmRSS")
    forward().backward(d_out)
    peak = _status_kib("VmHWM") - before
    times = []
    for _ in range(steps):
        q.grad = latent.grad = k_pe.grad = w.grad = None
        t0 = time.perf_counter()
        forward().backward(d_out)
        times.append(time.perf_counter() - t0)
    return {"held_mib": sum(held.values()) / 2**20, "peak_mib": peak / 1024,
            "step_s": sorted(times)[len(times) // 2]}


def run(method: str, seq: int, cp: int, heads: int, steps: int) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", method, str(seq), str(cp), str(heads), str(steps)]
    # glibc hands tensors of 64 KiB and more back to the system when freed, so RSS follows what is alive
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536"}
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{method} cp = {cp} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def table(seq: int, heads: int, rows: dict[int, dict[str, dict]]) -> str:
    lines = [f"S = {seq} tokens, {heads} heads (qk 192, v 128, latent 512 + 64), batch 1, fp32, one thread, "
             f"{os.cpu_count()} CPU cores; the last shard's rows",
             "",
             "| cp | rows a rank | held MiB before | held MiB after | peak MiB before | peak MiB after | step s before "
             "| step s after |",
             "|---|---|---|---|---|---|---|---|"]
    for cp, r in rows.items():
        old, new = r["expand"], r["chunked"]
        lines.append(f"| {cp} | {seq // cp} | {old['held_mib']:.0f} | {new['held_mib']:.0f} | {old['peak_mib']:.0f} | "
                     f"{new['peak_mib']:.0f} | {old['step_s']:.2f} | {new['step_s']:.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--cp", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--write", action="store_true", help="put the table into docs/benchmarks.md (default: print)")
    parser.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        method, seq, cp, heads, steps = args.child
        print(json.dumps(child(method, int(seq), int(cp), int(heads), int(steps))))
        return
    rows = {cp: {m: run(m, args.seq, cp, args.heads, args.steps) for m in ("expand", "chunked")} for cp in args.cp}
    text = table(args.seq, args.heads, rows)
    print(text)
    if args.write:
        write_docs_section(MARK_BEGIN, MARK_END, "## MLA under context parallelism: memory per rank (CPU)\n\n"
                           "Command: `.venv/bin/python bench/latent_attention.py --write`\n\n" + text)


if __name__ == "__main__":
    main()
