"""Records -> tokenized documents, stored back to back in file order, a chunk of records at a time.

sft: a record's conversation is rendered in the DeepSeek-V4 chat format (trex.data.chat); the
conversation is ``data.messages_field`` (OpenAI ``role``/``content`` or ShareGPT ``from``/``value``
messages), else ``conversations`` (either form), else a ``prompt``/``response`` pair (an optional
``system`` beside them).
cpt: a record's text becomes ``<BOS>text<EOS>``, every token trained.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import numpy as np

from trex.data.chat import RecordError, Segment, check_utf8, encode_segments, render_conversation
from trex.data.config import DataSection
from trex.data.records import BadRecordPolicy, Record, SkipCounter, iter_records, parsed
from trex.data.tokenizer import BOS, EOS, Tokenizer

# ShareGPT speakers -> roles
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
                  "model": "assistant", "bing": "assistant", "system": "system", "tool": "tool"}


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
    return render_conversation(conversation(record.data, cfg.messages_field), thinking=cfg.thinking,
                               drop_thinking=cfg.drop_thinking, loss_on=cfg.loss_on,
                               chat_format=cfg.chat_format)


def conversation(data: dict, field: str = "messages"):
    """A record's conversation as OpenAI messages: ``field``, else ``conversations``, else a
    ``prompt``/``response`` pair; ShareGPT ``{"from", "value"}`` messages are mapped (human -> user,
    gpt -> assistant, ...). What it finds is returned unchecked (trex.data.chat validates it)."""
    for name in dict.fromkeys((field, "conversations")):
        if name in data:
            messages = data[name]
            if isinstance(messages, list) and messages and all(isinstance(m, dict) and "from" in m and "role" not in m
                                                              for m in messages):
                return [_from_sharegpt(m) for m in messages]
            return messages
    if "prompt" in data and "response" in data:
        system = [{"role": "system", "content": data["system"]}] if data.get("system") else []
        return [*system, {"role": "user", "content": data["prompt"]}, {"role": "assistant", "content": data["response"]}]
    raise RecordError("missing_messages", f"no field {field!r} (nor conversations, nor prompt and response)")


def _from_sharegpt(message: dict) -> dict:
    role = SHAREGPT_ROLES.get(str(message["from"]).lower())
    if role is None:
        raise RecordError("unknown_role", f"ShareGPT speaker {message['from']!r}; expected one of "
                                          f"{', '.join(sorted(SHAREGPT_ROLES))}")
    return {"role": role, "content": message.get("value")}


@dataclass
class EncodedChunk:
    """One chunk of records, encoded: its documents back to back, and what was dropped or cut."""
    tokens: np.ndarray      # int32 [t]
    loss_mask: np.ndarray   # bool [t]
    lengths: np.ndarray     # int64 [n]: the chunk's documents, in record order
    events: list[tuple[str, int, str, str]]  # (path, line, reason, detail) in record order; "truncated" or a skip
    n_records: int
    n_bytes: float  # the records' share of their files' bytes (Record.size): the prepare's progress


def record_chunks(cfg: DataSection, counter: SkipCounter) -> Iterator[list[Record]]:
    """``cfg.paths``' records (JSONL lines still raw bytes) in chunks of ``cfg.encode_chunk``."""
    chunk: list[Record] = []
    for record in iter_records(cfg.paths, cfg.format, counter, raw=True):
        chunk.append(record)
        if len(chunk) == cfg.encode_chunk:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def encode_chunk(records: list[Record], cfg: DataSection, tokenizer: Tokenizer) -> EncodedChunk:
    """Parse, render and tokenize ``records`` in one batched tokenizer call. A record that cannot be
    used, or whose document is longer than seq_len (cut to it under ``truncate``), or that trains no
    token, becomes an event for the caller's policy, in record order; nothing here raises for one."""
    kept, segments, events = [], [], []
    for record in records:
        try:
            segments.append(record_segments(parsed(record), cfg))
            kept.append(record)
        except RecordError as err:
            events.append((record.path, record.line, err.reason, err.detail))
    docs, masks, lengths = [], [], []
    for record, (ids, mask) in zip(kept, encode_segments(segments, tokenizer)):
        if len(ids) > cfg.seq_len:
            if cfg.bad_record_policy != "truncate":
                events.append((record.path, record.line, "too_long", f"{len(ids)} tokens; seq_len is {cfg.seq_len}"))
                continue
            events.append((record.path, record.line, "truncated", ""))
            ids, mask = ids[:cfg.seq_len], mask[:cfg.seq_len]
        if not mask[1:].any():  # the first token is never a target
            events.append((record.path, record.line, "no_loss_tokens",
                           f"none of its {len(ids)} tokens (after any truncation) is trained"))
            continue
        docs.append(ids)
        masks.append(mask)
        lengths.append(len(ids))
    order = {(r.path, r.line): k for k, r in enumerate(records)}
    events.sort(key=lambda e: order[(e[0], e[1])])
    empty = np.zeros(0, dtype=np.int32)
    return EncodedChunk(np.concatenate(docs) if docs else empty,
                        np.concatenate(masks) if masks else empty.astype(bool),
                        np.asarray(lengths, dtype=np.int64), events, len(records),
                        sum(r.size for r in records))


def account(chunk: EncodedChunk, policy: BadRecordPolicy) -> None:
    """Count ``chunk``'s records and pass its events to ``policy`` in record order (under ``fail`` the
    first bad record raises, whichever process encoded it)."""
    policy.records_read += chunk.n_records
    for path, line, reason, detail in chunk.events:
        if reason == "truncated":
            policy.counter.truncate(f"{path}:{line}")
        else:
            policy.reject(path, line, reason, detail)


def build_documents(cfg: DataSection, tokenizer: Tokenizer, policy: BadRecordPolicy) -> Documents:
    """Read, validate, render and tokenize every record of ``cfg.paths`` into memory, in file order;
    bad ones go through ``policy`` (as `trex.data.prepared` does for files on disk)."""
    tokens, masks, lengths = [], [], []
    for records in record_chunks(cfg, policy.counter):
        chunk = encode_chunk(records, cfg, tokenizer)
        account(chunk, policy)
        tokens.append(chunk.tokens)
        masks.append(chunk.loss_mask)
        lengths.append(chunk.lengths)
    n = np.concatenate(lengths) if lengths else np.zeros(0, dtype=np.int64)
    if not len(n):
        raise ValueError(f"no usable documents in {cfg.paths} ({policy.records_read} records read; "
                         f"skipped: {policy.counter.as_dict()['skipped_by_reason']})")
    return Documents(tokens=np.concatenate(tokens), loss_mask=np.concatenate(masks),
                     offsets=np.concatenate([[0], np.cumsum(n)]), records_read=policy.records_read)
