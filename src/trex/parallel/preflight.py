"""Fail fast instead of hanging: the pre-flight check and collective error context.

A rank that runs fewer micro-batches or steps than the others waits forever in a collective (the
classic uneven-data hang on HCCL and NCCL alike). Before the first step every rank publishes what
it is about to do; any difference is reported with the ranks involved. During training, a
collective that fails or times out is re-raised with the step and the phase it was in.
"""

from __future__ import annotations

import contextlib

import torch.distributed as dist

from trex.parallel.mesh import Parallel


class PreflightError(RuntimeError):
    """Ranks disagree on the work ahead; the message names the ranks and values."""


def preflight(par: Parallel, facts: dict) -> None:
    """All-gather ``facts`` (small, comparable values) and raise if any rank differs from rank 0."""
    if not par.distributed:
        return
    gathered: list[dict] = [None] * par.world_size  # type: ignore[list-item]
    dist.all_gather_object(gathered, facts)
    problems = []
    for key in facts:
        values = {rank: g.get(key) for rank, g in enumerate(gathered)}
        if len(set(map(repr, values.values()))) > 1:
            by_value: dict[str, list[int]] = {}
            for rank, value in values.items():
                by_value.setdefault(repr(value), []).append(rank)
            groups = "; ".join(f"ranks {ranks}: {value}" for value, ranks in by_value.items())
            problems.append(f"{key} differs across ranks ({groups})")
    if problems:
        raise PreflightError("pre-flight check failed, the run would hang in a collective:\n  " + "\n  ".join(problems)
                             + "\nEvery rank must see the same data, steps and micro-batches per step.")


@contextlib.contextmanager
def collective_context(par: Parallel, step: int, phase: str):
    """Re-raise a failed or timed-out collective with the rank, step and phase."""
    if not par.distributed:
        yield
        return
    try:
        yield
    except (dist.DistError, RuntimeError) as e:
        if isinstance(e, PreflightError):
            raise
        raise RuntimeError(f"rank {par.rank}: step {step + 1}: {phase} failed: {e}") from e
