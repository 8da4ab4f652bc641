"""Greedy packing of documents into rows of exactly ``seq_len`` tokens.

Documents stay in packing order; each row takes the next documents while they fit (next-fit), so a
row is a contiguous run of documents and no document spans two rows. The tail of a row is padding:
``pad_id`` tokens, label IGNORE_INDEX, and a document id of its own, so attention never crosses from
one document (or the padding) into another.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from trex.data.documents import Documents
from trex.models.deepseek_v4 import IGNORE_INDEX


def pack(lengths: np.ndarray, seq_len: int) -> np.ndarray:
    """Row boundaries for documents of ``lengths`` (each <= seq_len) in order.

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


@dataclass
class PackedRows:
    """Documents packed into rows of ``seq_len`` tokens."""
    docs: Documents
    bounds: np.ndarray  # int64 [R+1], see pack()
    seq_len: int
    pad_id: int

    @classmethod
    def build(cls, docs: Documents, seq_len: int, pad_id: int) -> "PackedRows":
        return cls(docs, pack(docs.lengths, seq_len), seq_len, pad_id)

    def __len__(self) -> int:
        return len(self.bounds) - 1

    @property
    def efficiency(self) -> float:
        """Fraction of row positions holding document tokens rather than padding."""
        return float(self.docs.offsets[-1]) / max(1, len(self) * self.seq_len)

    def used(self, index: np.ndarray) -> np.ndarray:
        """int64 [len(index)]: document tokens (non-padding) in each of the rows in ``index``."""
        offsets = self.docs.offsets
        return offsets[self.bounds[index + 1]] - offsets[self.bounds[index]]

    def rows(self, index: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """input_ids, labels, doc_ids: int64 [len(index), seq_len] for the rows in ``index``.

        labels equal input_ids where the token is trained and IGNORE_INDEX elsewhere (not shifted);
        doc_ids number the documents of a row 0, 1, ... and the padding gets the next number.
        """
        n, S = len(index), self.seq_len
        input_ids = np.full((n, S), self.pad_id, dtype=np.int64)
        labels = np.full((n, S), IGNORE_INDEX, dtype=np.int64)
        doc_ids = np.empty((n, S), dtype=np.int64)
        offsets = self.docs.offsets
        for k, r in enumerate(index.tolist()):
            a, b = int(self.bounds[r]), int(self.bounds[r + 1])
            start, end = int(offsets[a]), int(offsets[b])
            used = end - start
            tokens = self.docs.tokens[start:end]
            input_ids[k, :used] = tokens
            labels[k, :used] = np.where(self.docs.loss_mask[start:end], tokens, IGNORE_INDEX)
            doc_ids[k, :used] = np.repeat(np.arange(b - a), np.diff(offsets[a:b + 1]))
            doc_ids[k, used:] = b - a
        return input_ids, labels, doc_ids
