"""The training-side iterator: packed rows -> rank-sharded, resumable micro-batches.

Each epoch orders the rows by a permutation seeded with ``(seed, epoch)``. Global micro-step ``k``
takes the rows ``order[k*W*B:(k+1)*W*B]`` (W ranks, B rows each) and rank ``r`` gets the r-th block
of B. Every rank therefore sees disjoint rows and exactly ``rows // (W*B)`` micro-batches per epoch;
the remainder of the permutation is dropped (different rows each epoch). The iterator runs over
epochs without end; the position (epoch, rows consumed in the epoch) is the same on every rank and is
all that a resumed run needs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from trex.data.packing import IGNORE_INDEX, PackedRows
from trex.data.records import SkipCounter


@dataclass
class Batch:
    """One micro-batch for one rank."""
    input_ids: torch.Tensor  # long [B, S]
    labels: torch.Tensor     # long [B, S], aligned with input_ids (the model shifts), IGNORE_INDEX = no loss
    doc_ids: torch.Tensor    # long [B, S], document number within each row; padding has its own
    n_loss_tokens: int       # targets the model's next-token loss counts (labels after the in-document shift)
    n_tokens: int            # non-padding tokens
    token_mask: torch.Tensor  # bool [B, S]: the non-padding tokens (the model's MoE statistics count only these)

    def to(self, device) -> "Batch":
        return Batch(self.input_ids.to(device), self.labels.to(device), self.doc_ids.to(device),
                     self.n_loss_tokens, self.n_tokens, self.token_mask.to(device))


def count_loss_tokens(labels: np.ndarray, doc_ids: np.ndarray) -> int:
    """Targets with a label that stay inside their document after the shift by one."""
    return int(((labels[:, 1:] != IGNORE_INDEX) & (doc_ids[:, 1:] == doc_ids[:, :-1])).sum())


class PackedLoader:
    """Deterministic, resumable, rank-sharded iterator of :class:`Batch` over ``rows``."""

    def __init__(self, rows: PackedRows, micro_batch_size: int, rank: int, world_size: int,
                 seed: int, shuffle: bool = True, skips: SkipCounter | None = None, prepared: str = "",
                 loss_tokens: int | None = None):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        step_rows = micro_batch_size * world_size
        if len(rows) < step_rows:
            raise ValueError(f"only {len(rows)} packed rows of {rows.seq_len} tokens; one step needs "
                             f"world_size * micro_batch_size = {step_rows}. Add data or shrink seq_len/batch")
        self.rows = rows
        self.micro_batch_size = micro_batch_size
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.shuffle = shuffle
        self.skips = skips if skips is not None else SkipCounter()
        self.prepared = prepared  # the prepared directory the rows are mapped from ("": built in memory)
        self._loss_tokens = loss_tokens  # its manifest's count (else counted from the loss mask when asked)
        self.epoch = 0
        self.rows_consumed = 0  # in this epoch, over all ranks
        self._order = self._epoch_order(0)

    @property
    def micro_batches_per_epoch(self) -> int:
        """Micro-batches each rank yields per epoch (identical on all ranks)."""
        return len(self.rows) // (self.micro_batch_size * self.world_size)

    @property
    def loss_tokens(self) -> int:
        """Tokens that are training targets, over all documents."""
        if self._loss_tokens is None:
            self._loss_tokens = int(self.rows.docs.loss_mask.sum())
        return self._loss_tokens

    @property
    def fingerprint(self) -> str:
        """Identifies the packed data (document lengths, row layout, seq_len) a position refers to."""
        return self.rows.fingerprint

    def summary(self) -> dict:
        """Data facts for summary.json: records, documents, tokens, skips by reason, packing."""
        docs = self.rows.docs
        return {"records_read": docs.records_read, "documents": len(docs),
                "tokens": self.rows.n_tokens, "loss_tokens": self.loss_tokens,
                "rows": len(self.rows), "seq_len": self.rows.seq_len,
                "packing_efficiency": round(self.rows.efficiency, 4),
                "padding_share": round(1 - self.rows.efficiency, 4),
                "micro_batches_per_epoch": self.micro_batches_per_epoch, "prepared": self.prepared,
                **self.skips.as_dict()}

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self.rows))
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.rows))

    def __iter__(self) -> "PackedLoader":
        return self

    def __next__(self) -> Batch:
        step_rows = self.micro_batch_size * self.world_size
        if self.rows_consumed + step_rows > len(self.rows):
            self.epoch += 1
            self.rows_consumed = 0
            self._order = self._epoch_order(self.epoch)
        start = self.rows_consumed + self.rank * self.micro_batch_size
        index = self._order[start:start + self.micro_batch_size]
        self.rows_consumed += step_rows
        input_ids, labels, doc_ids = self.rows.rows(index)
        used = np.asarray(self.rows.used(index), dtype=np.int64)  # host arrays: no device read
        mask = torch.from_numpy(np.arange(input_ids.shape[1])[None, :] < used[:, None])
        return Batch(torch.from_numpy(input_ids), torch.from_numpy(labels), torch.from_numpy(doc_ids),
                     count_loss_tokens(labels, doc_ids), int(used.sum()), mask)

    def state_dict(self) -> dict:
        """The exact position; the same on every rank. JSON-serialisable."""
        return {"epoch": self.epoch, "rows_consumed": self.rows_consumed, "seed": self.seed,
                "shuffle": self.shuffle, "fingerprint": self.fingerprint}

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state``; the next batch is the one that followed when it was saved.

        The data, seed and shuffle must match; world_size * micro_batch_size may change only if it
        divides the rows already consumed in the epoch."""
        for key in ("seed", "shuffle", "fingerprint"):
            if state[key] != getattr(self, key):
                raise ValueError(f"data loader state has {key}={state[key]!r} but this loader has "
                                 f"{getattr(self, key)!r}; resume needs the same data, seed and shuffle")
        step_rows = self.micro_batch_size * self.world_size
        if state["rows_consumed"] % step_rows:
            raise ValueError(f"data loader state consumed {state['rows_consumed']} rows of epoch "
                             f"{state['epoch']}, not a multiple of world_size * micro_batch_size = {step_rows}")
        self.epoch = int(state["epoch"])
        self.rows_consumed = int(state["rows_consumed"])
        self._order = self._epoch_order(self.epoch)
