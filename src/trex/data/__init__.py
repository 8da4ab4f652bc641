"""Training data: JSONL/Parquet records -> DeepSeek-V4 chat (or raw text) encoding -> packed rows
-> deterministic, resumable, rank-sharded micro-batches.

    tok = load_tokenizer(cfg.tokenizer)
    loader = build_loader(cfg, rank, world_size, tok)
    batch = next(loader)            # Batch(input_ids, labels, doc_ids [B, S], n_loss_tokens, n_tokens)
    state = loader.state_dict()     # resume: loader.load_state_dict(state)
    loader.summary()                # for summary.json (skips by reason, packing efficiency, ...)
"""

from __future__ import annotations

from trex.data.config import DataSection
from trex.data.documents import Documents, build_documents
from trex.data.loader import Batch, PackedLoader
from trex.data.packing import PackedRows
from trex.data.records import BadRecordError, BadRecordPolicy
from trex.data.tokenizer import Tokenizer, compact_tokenizer, load_tokenizer

__all__ = ["DataSection", "Batch", "PackedLoader", "BadRecordError", "Tokenizer", "Documents",
           "build_loader", "load_tokenizer", "compact_tokenizer"]


def build_loader(cfg: DataSection, rank: int, world_size: int, tokenizer: Tokenizer, *,
                 paths_key: str = "data.paths", batch_key: str = "data.micro_batch_size") -> PackedLoader:
    """Read, encode and pack ``cfg.paths`` (identically on every rank) and return this rank's loader.

    Raises BadRecordError (file:line: reason) under bad_record_policy "fail", and ValueError naming
    ``paths_key`` (the recipe key that listed the files) and ``batch_key`` (what sets the rows per
    rank) when the files pack into fewer rows than one step takes."""
    cfg.validate()
    policy = BadRecordPolicy(cfg.bad_record_policy)
    docs = build_documents(cfg, tokenizer, policy)
    rows = PackedRows.build(docs, cfg.seq_len, tokenizer.pad_id)
    step_rows = cfg.micro_batch_size * world_size
    if len(rows) < step_rows:
        raise ValueError(f"{paths_key} = {list(cfg.paths)}: {len(rows)} packed rows of {cfg.seq_len} tokens, "
                         f"but one step takes {step_rows} ({batch_key} = {cfg.micro_batch_size} x {world_size} "
                         f"rank{'s' if world_size > 1 else ''}); add records or lower {batch_key} or data.seq_len")
    return PackedLoader(rows, cfg.micro_batch_size, rank, world_size, cfg.seed, cfg.shuffle, policy.counter)
