"""Records -> tokenized documents, stored back to back in packing order.

sft: a record's conversation is rendered in the DeepSeek-V4 chat format (trex.data.chat).
cpt: a record's text becomes ``<BOS>text<EOS>``, every token trained.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from trex.data.chat import RecordError, Segment, check_utf8, encode_segments, render_conversation
from trex.data.config import DataSection
from trex.data.records import BadRecordPolicy, Record
from trex.data.tokenizer import BOS, EOS, Tokenizer


@dataclass
class Documents:
    """N documents back to back: document i is ``tokens[offsets[i]:offsets[i+1]]``."""
    tokens: np.ndarray      # int32 [T]
    loss_mask: np.ndarray   # bool [T]: the token is a training target
    offsets: np.ndarray     # int64 [N+1]
    records_read: int

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)


def record_segments(record: Record, cfg: DataSection) -> list[Segment]:
    """Render one record; raises RecordError if it cannot be used."""
    if isinstance(record.data, RecordError):
        raise record.data
    if cfg.mode == "cpt":
        text = record.data.get(cfg.text_field)
        if not isinstance(text, str):
            raise RecordError("missing_text", f"no string field {cfg.text_field!r}")
        if not text:
            raise RecordError("empty_text", f"field {cfg.text_field!r} is empty")
        check_utf8(text)
        return [Segment(BOS + text + EOS, True)]
    if cfg.messages_field not in record.data:
        raise RecordError("missing_messages", f"no field {cfg.messages_field!r}")
    return render_conversation(record.data[cfg.messages_field], thinking=cfg.thinking,
                               drop_thinking=cfg.drop_thinking, loss_on=cfg.loss_on)


def _encode_chunk(chunk: list[tuple[Record, list[Segment]]], tokenizer: Tokenizer, cfg: DataSection,
                  policy: BadRecordPolicy, out: list[tuple[np.ndarray, np.ndarray]]) -> None:
    for (record, _), (ids, mask) in zip(chunk, encode_segments([segs for _, segs in chunk], tokenizer)):
        if len(ids) > cfg.seq_len:
            if not policy.too_long(record.path, record.line, len(ids), cfg.seq_len):
                continue
            ids, mask = ids[:cfg.seq_len], mask[:cfg.seq_len]
        if not mask[1:].any():  # the first token is never a target
            policy.reject(record.path, record.line, "no_loss_tokens",
                          f"none of its {len(ids)} tokens (after any truncation) is trained")
            continue
        out.append((ids, mask))


def build_documents(cfg: DataSection, tokenizer: Tokenizer, policy: BadRecordPolicy) -> Documents:
    """Read, validate, render and tokenize every record of ``cfg.paths``; bad ones go through
    ``policy``. Documents are shuffled with ``cfg.seed`` (if ``cfg.shuffle``) into packing order."""
    encoded: list[tuple[np.ndarray, np.ndarray]] = []
    chunk: list[tuple[Record, list[Segment]]] = []
    for record, segments in policy.parsed(cfg, lambda rec: record_segments(rec, cfg)):
        chunk.append((record, segments))
        if len(chunk) == cfg.encode_chunk:
            _encode_chunk(chunk, tokenizer, cfg, policy, encoded)
            chunk = []
    if chunk:
        _encode_chunk(chunk, tokenizer, cfg, policy, encoded)
    if not encoded:
        raise ValueError(f"no usable documents in {cfg.paths} ({policy.records_read} records read; "
                         f"skipped: {policy.counter.as_dict()['skipped_by_reason']})")
    order = np.random.default_rng(cfg.seed).permutation(len(encoded)) if cfg.shuffle else range(len(encoded))
    encoded = [encoded[i] for i in order]
    lengths = np.array([len(ids) for ids, _ in encoded], dtype=np.int64)
    return Documents(tokens=np.concatenate([ids for ids, _ in encoded]),
                     loss_mask=np.concatenate([mask for _, mask in encoded]),
                     offsets=np.concatenate([[0], np.cumsum(lengths)]), records_read=policy.records_read)
