"""How fast the data pipeline runs, for ``trex bench data RECIPE``.

Two phases are timed separately: the build (read, validate, render, tokenize and pack into the
prepared-data cache on a first run; on a later one only mapping the cached files) and the per-step
iteration (rows -> Batch tensors). The iteration rate is what a training step competes
with; ``headroom`` = iteration tokens/s over the training step's tokens/s (above 1: data keeps up).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

from trex.data import build_loader
from trex.data.config import DataSection
from trex.data.tokenizer import Tokenizer


@dataclass
class DataBenchResult:
    build_seconds: float
    """Wall time to prepare every record (or, on a cache hit, to map the prepared files)."""
    build_tokens_per_s: float
    """Document tokens produced per second of build time."""
    batches: int
    """Micro-batches timed in the iteration phase."""
    iter_seconds: float
    iter_tokens_per_s: float
    """Row positions (micro_batch_size * seq_len per batch, padding included) yielded per second."""
    summary: dict
    """The loader's summary (records, documents, skips, packing efficiency)."""

    def report(self, step_tokens_per_s: float | None = None) -> dict:
        """A flat dict; with the training step's tokens/s it adds ``headroom`` (iteration / step)."""
        out = asdict(self)
        if step_tokens_per_s:
            out["step_tokens_per_s"] = step_tokens_per_s
            out["headroom"] = self.iter_tokens_per_s / step_tokens_per_s
        return out


def bench_data(cfg: DataSection, tokenizer: Tokenizer, n_batches: int = 200) -> DataBenchResult:
    """Build rank 0's loader of a single-rank run, then time ``n_batches`` micro-batches."""
    t0 = time.perf_counter()
    loader = build_loader(cfg, rank=0, world_size=1, tokenizer=tokenizer)
    build_s = time.perf_counter() - t0
    summary = loader.summary()
    t0 = time.perf_counter()
    for _ in range(n_batches):
        next(loader)
    iter_s = time.perf_counter() - t0
    return DataBenchResult(build_s, summary["tokens"] / build_s, n_batches, iter_s,
                           n_batches * cfg.micro_batch_size * cfg.seq_len / iter_s, summary)
