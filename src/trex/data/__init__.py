"""Training data: JSONL/Parquet/Arrow records -> DeepSeek-V4 chat (or raw text) encoding -> packed rows,
prepared once into memory-mapped files (trex.data.prepared) -> deterministic, resumable, rank-sharded
micro-batches.

    tok = load_tokenizer(cfg.tokenizer)
    loader = build_loader(cfg, rank, world_size, tok)
    batch = next(loader)            # Batch(input_ids, labels, doc_ids [B, S], n_loss_tokens, n_tokens)
    state = loader.state_dict()     # resume: loader.load_state_dict(state)
    loader.summary()                # for summary.json (skips by reason, packing efficiency, ...)
    probe = file_order_batch(cfg, tok, rows=4)   # the first rows in file order, from the same prepared data
"""

from __future__ import annotations

import logging

import numpy as np

from trex.data.config import DataSection
from trex.data.documents import Documents
from trex.data.loader import Batch, PackedLoader
from trex.data.packing import PackedRows, pack
from trex.data.prepared import PreparedDataError, ensure, every, open_prepared, skips_of
from trex.data.records import BadRecordError
from trex.data.tokenizer import Tokenizer, compact_tokenizer, load_tokenizer

log = logging.getLogger(__name__)

__all__ = ["DataSection", "Batch", "PackedLoader", "BadRecordError", "PreparedDataError", "Tokenizer", "Documents",
           "build_loader", "file_order_batch", "load_tokenizer", "compact_tokenizer"]


def build_loader(cfg: DataSection, rank: int, world_size: int, tokenizer: Tokenizer, *,
                 paths_key: str = "data.paths", batch_key: str = "data.micro_batch_size") -> PackedLoader:
    """This rank's loader over ``cfg``'s prepared data (trex.data.prepared): ``data.prepared``, or the
    cache entry of the data's content key, prepared by the first process that gets there while the
    others wait; every rank then memory-maps the same files.

    Raises BadRecordError (file:line: reason) under bad_record_policy "fail", PreparedDataError for a
    prepared directory that does not fit the recipe or is damaged, and ValueError naming ``paths_key``
    (the recipe key that listed the files) and ``batch_key`` (what sets the rows per rank) when the
    files pack into fewer rows than one step takes."""
    cfg.validate()
    rows, manifest, path = _open(cfg, tokenizer, paths_key)
    step_rows = cfg.micro_batch_size * world_size
    if len(rows) < step_rows:
        raise ValueError(f"{paths_key} = {list(cfg.paths)}: {len(rows)} packed rows of {cfg.seq_len} tokens, "
                         f"but one step takes {step_rows} ({batch_key} = {cfg.micro_batch_size} x {world_size} "
                         f"rank{'s' if world_size > 1 else ''}); add records or lower {batch_key} or data.seq_len")
    c, p = manifest["counts"], manifest["packing"]
    log.info("%s: %s records -> %s documents, %s tokens, %s rows of %d (%s packing %.1f%%, padding %.1f%%) from %s",
             paths_key, f"{c['records_read']:,}", f"{c['documents']:,}", f"{c['tokens']:,}", f"{c['rows']:,}",
             p["seq_len"], p["algorithm"], 100 * p["efficiency"], 100 * p["padding_share"], path)
    return PackedLoader(rows, cfg.micro_batch_size, rank, world_size, cfg.seed, cfg.shuffle, skips_of(manifest),
                        prepared=str(path), loss_tokens=manifest["counts"]["loss_tokens"])


def file_order_batch(cfg: DataSection, tokenizer: Tokenizer, rows: int, *, paths_key: str = "data.paths",
                     batch_key: str = "fidelity.probe_rows") -> Batch:
    """The first ``rows`` rows of ``cfg``'s documents in file order, packed next-fit (a document never
    spans rows), as one Batch: the same tokens whatever ``data.seed``, ``shuffle`` or ``packing`` say.

    Read from the prepared directory ``build_loader`` uses for ``cfg`` (prepared first if no process
    has), so the training set is never tokenized a second time to build it. Reads the offsets of at
    most ``rows * seq_len`` documents, whatever the data set's size. ValueError naming ``paths_key`` and
    ``batch_key`` when the documents fill fewer rows."""
    cfg.validate()
    packed, _, path = _open(cfg, tokenizer, paths_key)
    docs, seq_len = packed.docs, packed.seq_len
    head = min(len(docs), rows * seq_len)  # every document holds a token: enough for ``rows`` full rows
    bounds = pack(np.diff(docs.offsets[:head + 1]), seq_len)
    if len(bounds) - 1 < rows:
        raise ValueError(f"{paths_key} = {list(cfg.paths)}: {len(bounds) - 1} rows of {seq_len} tokens in file "
                         f"order, but {batch_key} = {rows}; add records or lower {batch_key}")
    first = PackedRows(docs, np.arange(bounds[rows], dtype=np.int64), bounds[:rows + 1], seq_len, tokenizer.pad_id)
    return next(PackedLoader(first, rows, 0, 1, cfg.seed, shuffle=False, prepared=str(path)))


def _open(cfg: DataSection, tokenizer: Tokenizer, paths_key: str):
    """(rows, manifest, path) of ``cfg``'s prepared directory, preparing it here if no process has."""
    report = every(30.0, lambda line: log.info("preparing %s: %s", paths_key, line))
    path, _, _ = ensure(cfg, tokenizer, cfg.prepare_workers, report=report)
    rows, manifest = open_prepared(path, tokenizer.pad_id)
    return rows, manifest, path
