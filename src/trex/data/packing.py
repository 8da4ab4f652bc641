"""Packing documents into rows of exactly ``seq_len`` tokens.

Documents are first put in packing order (a permutation seeded with ``data.seed``, or file order),
then the packer fills rows; no document spans two rows. The tail of a row is padding: ``pad_id``
tokens, label IGNORE_INDEX, and a document id of its own, so attention never crosses from one
document (or the padding) into another.

* ``next_fit`` (:func:`pack`): a row takes the next documents while they fit, so a row is a
  contiguous run of the shuffled documents. The packing of runs before ``best_fit`` existed.
* ``best_fit`` (:func:`pack_best_fit`): within each window of ``pack_window`` shuffled documents,
  longest first, each goes into the open row with the least room that still fits it (a new row if
  none does); a window's rows close when it ends. Deterministic: ties go to the row opened first.
"""

from __future__ import annotations

import hashlib
from bisect import bisect_left, insort
from dataclasses import dataclass

import numpy as np

from trex.data.config import DataSection
from trex.data.documents import Documents
from trex.models.common.cross_entropy import IGNORE_INDEX


def pack(lengths: np.ndarray, seq_len: int) -> np.ndarray:
    """Next-fit row boundaries for documents of ``lengths`` (each <= seq_len) in order.

    Returns int64 [R+1]: row r holds documents ``bounds[r]:bounds[r+1]``.
    """
    if len(lengths) and int(lengths.max()) > seq_len:
        raise ValueError(f"a document of {int(lengths.max())} tokens exceeds seq_len {seq_len}")
    bounds = [0]
    used = 0
    for i, n in enumerate(lengths.tolist()):
        if used + n > seq_len:
            bounds.append(i)
            used = 0
        used += n
    if len(lengths):
        bounds.append(len(lengths))
    return np.asarray(bounds, dtype=np.int64)


def pack_best_fit(lengths: np.ndarray, seq_len: int, window: int) -> tuple[np.ndarray, np.ndarray]:
    """Best-fit-decreasing rows of documents of ``lengths`` (each <= seq_len), window by window.

    Returns (perm int64 [N], bounds int64 [R+1]): row r holds documents ``perm[bounds[r]:bounds[r+1]]``
    (indices into ``lengths``); rows in the order they were opened, each row's documents longest first.
    Time O(N log N) per window, memory O(window)."""
    if len(lengths) and int(lengths.max()) > seq_len:
        raise ValueError(f"a document of {int(lengths.max())} tokens exceeds seq_len {seq_len}")
    perm, bounds = [], [0]
    for w0 in range(0, len(lengths), window):
        part = lengths[w0:w0 + window]
        rows: list[list[int]] = []
        room: list[tuple[int, int]] = []  # (free positions, row) of the open rows, sorted
        for i in np.argsort(-part, kind="stable").tolist():
            n = int(part[i])
            k = bisect_left(room, (n, -1))
            if k < len(room):
                free, r = room.pop(k)
            else:
                free, r = seq_len, len(rows)
                rows.append([])
            rows[r].append(w0 + i)
            insort(room, (free - n, r))
        for row in rows:
            perm.extend(row)
            bounds.append(len(perm))
    return np.asarray(perm, dtype=np.int64), np.asarray(bounds, dtype=np.int64)


def plan_rows(lengths: np.ndarray, cfg: DataSection) -> tuple[np.ndarray, np.ndarray]:
    """(order, bounds) of documents of ``lengths`` (file order) under ``cfg``: the documents shuffled
    with ``cfg.seed`` (if ``cfg.shuffle``), then packed by ``cfg.packing``. Row r holds documents
    ``order[bounds[r]:bounds[r+1]]``."""
    n = len(lengths)
    order = np.random.default_rng(cfg.seed).permutation(n) if cfg.shuffle else np.arange(n, dtype=np.int64)
    if cfg.packing_algorithm == "next_fit":
        return order, pack(lengths[order], cfg.seq_len)
    perm, bounds = pack_best_fit(lengths[order], cfg.seq_len, cfg.pack_window)
    return order[perm], bounds


@dataclass
class PackedRows:
    """Documents packed into rows of ``seq_len`` tokens: row r holds documents
    ``order[bounds[r]:bounds[r+1]]`` of ``docs`` (arrays in memory or memory-mapped)."""
    docs: Documents
    order: np.ndarray   # int64 [N]: documents in packing order
    bounds: np.ndarray  # int64 [R+1]
    seq_len: int
    pad_id: int
    fingerprint: str = ""
    """Identifies the rows a loader position refers to (see :meth:`fingerprint_of`); computed if empty."""

    def __post_init__(self):
        if not self.fingerprint:
            self.fingerprint = self.fingerprint_of(self.docs.lengths[self.order], self.bounds, self.seq_len)

    @classmethod
    def build(cls, docs: Documents, cfg: DataSection, pad_id: int) -> "PackedRows":
        order, bounds = plan_rows(docs.lengths, cfg)
        return cls(docs, order, bounds, cfg.seq_len, pad_id)

    @staticmethod
    def fingerprint_of(lengths_in_order: np.ndarray, bounds: np.ndarray, seq_len: int) -> str:
        """A digest of the document lengths in packing order, the row bounds and seq_len (the same for
        next-fit rows as before prepared data existed, so their checkpoints resume)."""
        h = hashlib.blake2b(digest_size=12)
        offsets = np.concatenate([[0], np.cumsum(lengths_in_order, dtype=np.int64)])
        for arr in (offsets, bounds, np.array([seq_len])):
            h.update(np.ascontiguousarray(arr, dtype=np.int64).tobytes())
        return h.hexdigest()

    def __len__(self) -> int:
        return len(self.bounds) - 1

    @property
    def n_tokens(self) -> int:
        return int(self.docs.offsets[-1])

    @property
    def efficiency(self) -> float:
        """Fraction of row positions holding document tokens rather than padding."""
        return self.n_tokens / max(1, len(self) * self.seq_len)

    def used(self, index: np.ndarray) -> np.ndarray:
        """int64 [len(index)]: document tokens (non-padding) in each of the rows in ``index``."""
        return np.array([int(self._lengths(r).sum()) for r in np.asarray(index).tolist()], dtype=np.int64)

    def _lengths(self, r: int) -> np.ndarray:
        docs = self.order[self.bounds[r]:self.bounds[r + 1]]
        return self.docs.offsets[docs + 1] - self.docs.offsets[docs]

    def rows(self, index: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """input_ids, labels, doc_ids: int64 [len(index), seq_len] for the rows in ``index``.

        labels equal input_ids where the token is trained and IGNORE_INDEX elsewhere (not shifted);
        doc_ids number the documents of a row 0, 1, ... and the padding gets the next number.
        """
        n, S = len(index), self.seq_len
        input_ids = np.full((n, S), self.pad_id, dtype=np.int64)
        labels = np.full((n, S), IGNORE_INDEX, dtype=np.int64)
        doc_ids = np.empty((n, S), dtype=np.int64)
        offsets, tokens, mask = self.docs.offsets, self.docs.tokens, self.docs.loss_mask
        for k, r in enumerate(np.asarray(index).tolist()):
            at = 0
            docs = self.order[self.bounds[r]:self.bounds[r + 1]].tolist()
            for j, d in enumerate(docs):
                start, end = int(offsets[d]), int(offsets[d + 1])
                piece = tokens[start:end]
                input_ids[k, at:at + end - start] = piece
                labels[k, at:at + end - start] = np.where(mask[start:end], piece, IGNORE_INDEX)
                doc_ids[k, at:at + end - start] = j
                at += end - start
            doc_ids[k, at:] = len(docs)
        return input_ids, labels, doc_ids
