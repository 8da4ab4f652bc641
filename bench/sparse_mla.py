"""DeepSeek-V3.2's MLA over the indexer's picks: the mask forms against the gathered ``sparse_mla``, in one run.

Three attention cores, forward + backward from their inputs to every input's gradient, on k picks per query
(spread over each query's causal prefix, the first k queries see fewer: their extra picks invalid):

  mask, expanded   the former V3.2 default: MLA's expanded keys/values (H heads of nope + rope, values
                   zero-padded for the CPU fused kernel) through PyTorch's fused SDPA with the picks as a
                   [S, S] boolean mask (``dense_attention`` with a keep mask)
  mask, absorbed   ``sparse_mla``'s reference: fp32 [H, S, S] scores over the 576-style latent + rope keys
  gathered         ``sparse_mla``'s default: per query chunk, the picks' rows gathered, [T, H, k] scores

Time: the three cores interleaved in one process, the fastest of 5 rounds after a warm-up (a busy machine
slows them alike). Peak: each core in a fresh process, Linux VmHWM over a warm-up and a step minus VmRSS
before them. fp32, batch 1, the machine's threads.

    .venv/bin/python bench/sparse_mla.py --write                      # S = 1024, 2048, 4096; k = 64
    .venv/bin/python bench/sparse_mla.py --seqs 2048 --topk 256       # printed only
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from model_step import _status_kib, report  # noqa: E402

MARK_BEGIN, MARK_END = "<!-- sparse-mla-bench:begin -->", "<!-- sparse-mla-bench:end -->"
H, LATENT, ROPE, NOPE, V = 8, 64, 32, 64, 64  # heads; MLA's latent, rope, nope and value dims (bench/model_step.py's)
CORES = ("mask, expanded", "mask, absorbed", "gathered")


def build(core: str, S: int, k: int):
    """The core's forward + backward as a function of nothing (inputs made here)."""
    import torch
    import torch.nn.functional as F

    from trex.kernels import sparse_mla

    torch.manual_seed(0)
    t = torch.arange(S)[:, None]
    j = torch.arange(k)[None]
    idx = torch.where(t < k, j, t * j // k)[None]  # distinct picks in 0..t (and, past a short prefix, invalid)
    valid = idx <= t
    scale = (NOPE + ROPE) ** -0.5
    if core == "mask, expanded":
        q = torch.randn(1, H, S, NOPE + ROPE, requires_grad=True)
        key = torch.randn(1, H, S, NOPE + ROPE, requires_grad=True)
        v = torch.randn(1, H, S, V, requires_grad=True)
        leaves = (q, key, v)

        def step():
            keep = sparse_mla.picks_as_mask(valid, idx, S)[:, None]
            out = F.scaled_dot_product_attention(q, key, F.pad(v, (0, NOPE + ROPE - V)), attn_mask=keep, scale=scale)
            return out[..., :V]
    else:
        q = torch.randn(1, S, H, LATENT + ROPE, requires_grad=True)
        kv = torch.randn(1, S, LATENT + ROPE, requires_grad=True)
        leaves = (q, kv)
        fn = sparse_mla.reference if core == "mask, absorbed" else sparse_mla.gathered

        def step():
            return fn(q, kv, scale, idx, valid, LATENT)

    def run():
        out = step()
        torch.autograd.grad(out, leaves, torch.ones_like(out))
    return run


def child(what: str, S: int, k: int) -> None:
    """One measurement, printed as a JSON line: ``what`` a core (its peak memory, in a process of its own) or
    "time" (every core, interleaved over 5 rounds after a warm-up, so a busy machine slows them alike: the
    fastest round of each)."""
    import torch

    if what != "time":
        before = _status_kib("VmRSS")
        run = build(what, S, k)
        run()
        run()
        return print(json.dumps({"peak_mib": (_status_kib("VmHWM") - before) / 1024}))
    runs = {core: build(core, S, k) for core in CORES}
    times = {core: [] for core in CORES}
    for r in range(6):
        for core, run in runs.items():
            t0 = time.perf_counter()
            run()
            if r:
                times[core].append(time.perf_counter() - t0)
    print(json.dumps({"ms": {c: min(t) * 1e3 for c, t in times.items()}, "threads": torch.get_num_threads(),
                      "torch": torch.__version__}))


def measure(what: str, S: int, k: int) -> dict:
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "src")}
    out = subprocess.run([sys.executable, __file__, "--child", what, str(S), str(k)], env=env, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--topk", type=int, default=64)
    parser.add_argument("--write", action="store_true", help="write the table into docs/benchmarks.md")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child[0], int(args.child[1]), int(args.child[2]))
    rows, meta = [], {}
    for S in args.seqs:
        meta = measure("time", S, args.topk)
        ms = meta["ms"]
        peak = {core: measure(core, S, args.topk)["peak_mib"] for core in CORES}
        cells = " | ".join(f"{ms[c]:.1f} | {peak[c]:.0f}" for c in CORES)
        rows.append(f"| {S} | {args.topk} | {cells} | {min(ms[c] for c in CORES[:2]) / ms['gathered']:.1f}x |")
    lines = ["## V3.2 sparse MLA: mask forms vs gathered picks (bench/sparse_mla.py)", "",
             f"Command: `.venv/bin/python bench/sparse_mla.py --seqs {' '.join(map(str, args.seqs))} "
             f"--topk {args.topk}{' --write' if args.write else ''}`", "",
             f"Machine: {platform.machine()}, {os.cpu_count()} cores, torch {meta['torch']}, {meta['threads']} "
             f"threads, fp32, batch 1; {H} heads, latent {LATENT} + rope {ROPE} (expanded: nope {NOPE} + rope "
             f"{ROPE}, value {V}); forward + backward of the core, the three interleaved, the fastest of 5 rounds "
             "after a warm-up; peak = resident-set growth over a warm-up and a step, each core in a process of its "
             "own.", "",
             "| S | k | mask, expanded ms | peak MiB | mask, absorbed ms | peak MiB | gathered ms | peak MiB "
             "| gathered speed-up vs the faster mask form |",
             "|---|---|---|---|---|---|---|---|---|", *rows]
    report(MARK_BEGIN, MARK_END, lines, args.write)


if __name__ == "__main__":
    main()
