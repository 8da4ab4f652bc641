"""Model FLOPs per token, the numerator of MFU (docs/mfu.md): the per-part record every family's count fills
(each family's ``flops`` module; trex.models.flops dispatches) and the attention-key averages they share.

Counts the useful work of the architecture, not of a particular kernel: masked or padded
entries that an implementation computes and throws away are not counted. A multiply-add is
2 FLOPs; training counts each trained matmul three times (forward, input gradient, weight
gradient). The indexer has no gradient, so it counts once.

Attention keys per query are averaged over the positions t = 0..S-1 of a sequence (or document)
of length S: min(t+1, W) window keys; HCA sees floor((t+1)/m) compressed entries; CSA sees the
indexer's top-k of its floor((t+1)/4) entries.
"""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class FlopsPerToken:
    """FLOPs per token, by part (all already multiplied by 3 for trained parts when training)."""

    dense_matmuls: float  # attention projections, mHC, compressors, router, shared expert
    routed_experts: float  # k routed experts
    attention_core: float  # q.k and p.v over window and compressed entries
    indexer: float  # lightning indexer projections and scores (forward only)
    head: float  # LM head(s)
    mtp: float  # MTP block(s), excluding their LM head

    @property
    def total(self) -> float:
        return sum(getattr(self, f.name) for f in fields(self))


def mean_window_keys(S: int, W: int) -> float:
    # sum_{t<S} min(t+1, W) / S
    if S <= W:
        return (S + 1) / 2
    return (W * (W + 1) / 2 + (S - W) * W) / S


def floor_sum(n: int, m: int) -> int:
    """sum_{u=1..n} floor(u / m), in closed form: m q (q - 1) / 2 + q (r + 1) for n = q m + r."""
    q, r = divmod(n, m)
    return m * q * (q - 1) // 2 + q * (r + 1)


def mean_closed_windows(S: int, m: int) -> float:
    # sum_{t<S} floor((t+1)/m) / S
    return floor_sum(S, m) / S if S < 1 << 16 else (S + 1) / (2 * m)


def mean_topk(S: int, m: int, k: int) -> float:
    # sum_{t<S} min(k, floor((t+1)/m)) / S: floor(u/m) below u = k m, then k
    if S >= 1 << 16:
        return float(k)  # nearly every query has more than k entries
    below = min(S, k * m - 1)
    return (floor_sum(below, m) + k * (S - below)) / S
