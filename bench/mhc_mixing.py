"""mHC's mixing around one sublayer, forward + backward: the references against the registry's fast paths.

One HyperConnection site as V4 runs it (trex.kernels.mhc): coefficients (RMS factor, mixes, sigmoids, 20
Sinkhorn rounds), collapse, a [d, d] sublayer, expand, then backward through all of it. Reference: every op's
reference; fused: ``mhc_coefficients`` and ``mhc_expand``'s fast paths (the collapse has only its reference).
One thread; time is the thread's CPU time (``time.thread_time``), so that other jobs on a shared machine do
not count; the minimum over interleaved rounds.

    .venv/bin/python bench/mhc_mixing.py                      # the tiny model's width and a wider one
    .venv/bin/python bench/mhc_mixing.py --shape 1,4096,4,1024  # B,S,n,d
"""

from __future__ import annotations

import argparse
import time

import torch

from trex.kernels import mhc

IMPLS = {"reference": (mhc.reference_coefficients, mhc.reference_collapse, mhc.reference_expand),
         "fused": (mhc.fused_coefficients, mhc.reference_collapse, mhc.fused_expand)}


def site(impl: str, X, fn, base, scale, W) -> None:
    coefficients, collapse, expand = IMPLS[impl]
    pre, post, comb = coefficients(X, fn, base, scale, 20, 1e-6, 1e-6)
    expand(collapse(X, pre) @ W, X, post, comb).float().sum().backward()


def measure(B: int, S: int, n: int, d: int, dtype: torch.dtype, rounds: int) -> dict[str, float]:
    """The minimum CPU ms of one site's forward + backward per implementation."""
    g = torch.Generator().manual_seed(0)
    X = torch.randn(B, S, n, d, generator=g).to(dtype).requires_grad_()
    fn = (torch.randn((2 + n) * n, n * d, generator=g) * 0.02).requires_grad_()
    base, scale = torch.zeros((2 + n) * n, requires_grad=True), torch.ones(3, requires_grad=True)
    W = (torch.randn(d, d, generator=g) / d ** 0.5).to(dtype)
    reps = max(1, 2 ** 16 // (B * S * d) * 16)
    best = {impl: float("inf") for impl in IMPLS}
    for _ in range(rounds):
        for impl in IMPLS:
            t = time.thread_time()
            for _ in range(reps):
                site(impl, X, fn, base, scale, W)
            best[impl] = min(best[impl], (time.thread_time() - t) / reps * 1e3)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", action="append", help="B,S,n,d (repeatable); default 4,64,4,64 and 1,1024,4,512")
    parser.add_argument("--rounds", type=int, default=5,
                        help="interleaved rounds; the minimum counts (default: %(default)s)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    shapes = [tuple(int(v) for v in s.split(",")) for s in args.shape or ["4,64,4,64", "1,1024,4,512"]]
    print("| B, S, n, d | dtype | reference ms | fused ms | speed-up |\n|---|---|---|---|---|")
    for shape in shapes:
        for dtype in (torch.float32, torch.bfloat16):
            ms = measure(*shape, dtype, args.rounds)
            print(f"| {', '.join(map(str, shape))} | {str(dtype).removeprefix('torch.')} | {ms['reference']:.2f} | "
                  f"{ms['fused']:.2f} | {ms['reference'] / ms['fused']:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
