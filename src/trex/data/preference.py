"""Preference pairs for DPO: records -> chosen and rejected conversations in the DeepSeek-V4 chat
format -> rank-sharded, resumable batches of pairs.

A record holds a prompt and two responses to it::

    {"prompt": "12+34", "chosen": "46", "rejected": "47"}
    {"messages": [{"role": "system", ...}, {"role": "user", ...}],            # ends with a user/tool turn
     "chosen": [{"role": "assistant", "content": ..., "reasoning_content": ...}], "rejected": "..."}

A response is an assistant string or a list of assistant messages. Both conversations are rendered
like SFT data ([data] thinking, drop_thinking); the response tokens (everything the assistant
writes after the prompt, EOS included) are the ones DPO scores. Bad records go through the
[data] bad_record_policy, counted by reason with their file and line.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch

from trex.data.chat import RecordError, encode_segments, render_conversation, validate_conversation
from trex.data.config import DataSection
from trex.data.records import BadRecordPolicy, Record, SkipCounter
from trex.data.tokenizer import Tokenizer

RESPONSES = ("chosen", "rejected")


@dataclass
class PreferencePairs:
    """N encoded pairs in file order: ``tokens[2i]`` is pair i's chosen conversation, ``tokens[2i+1]``
    its rejected one; ``response[k]`` flags the response tokens of sequence k."""
    tokens: list[np.ndarray]    # int32 [n_k] per sequence
    response: list[np.ndarray]  # bool [n_k] per sequence
    records_read: int
    skips: SkipCounter

    def __len__(self) -> int:
        return len(self.tokens) // 2

    @property
    def fingerprint(self) -> str:
        h = hashlib.blake2b(digest_size=12)
        for ids in self.tokens:
            h.update(np.ascontiguousarray(ids, dtype=np.int64).tobytes())
        return h.hexdigest()

    def summary(self) -> dict:
        return {"records_read": self.records_read, "pairs": len(self),
                "tokens": int(sum(len(t) for t in self.tokens)), **self.skips.as_dict()}


@dataclass
class PairBatch:
    """B pairs as 2B rows of seq_len tokens: rows 0..B-1 chosen, rows B..2B-1 rejected. Rows are padded
    to the fixed seq_len (as packed SFT rows are), so shapes do not depend on the pairs; the padding
    counts in no MoE statistic (the model's ``token_mask``: ``doc_ids == 0``)."""
    index: torch.Tensor      # long [B]: pair numbers
    input_ids: torch.Tensor  # long [2B, seq_len]
    doc_ids: torch.Tensor    # long [2B, seq_len]: 0 on the conversation, 1 on the padding
    scored: torch.Tensor     # bool [2B, seq_len]: position t's next token (t+1) is a response token
    n_tokens: int            # non-padding tokens

    def to(self, device) -> "PairBatch":
        return PairBatch(self.index, self.input_ids.to(device), self.doc_ids.to(device), self.scored.to(device),
                         self.n_tokens)


# ---- records -> pairs --------------------------------------------------------------------------------
def _prompt_messages(data: dict, cfg: DataSection) -> list[dict]:
    if "prompt" in data:
        if not isinstance(data["prompt"], str):
            raise RecordError("bad_prompt", f"prompt is {type(data['prompt']).__name__}; expected a string")
        return [{"role": "user", "content": data["prompt"]}]
    if cfg.messages_field not in data:
        raise RecordError("missing_prompt", f"no field 'prompt' or {cfg.messages_field!r}")
    messages = data[cfg.messages_field]
    validate_conversation(messages, require_assistant=False)
    if messages[-1]["role"] not in ("user", "tool"):
        if not any(key in data for key in RESPONSES):
            raise RecordError("missing_chosen", f"no 'chosen' or 'rejected' field, and {cfg.messages_field} is a whole "
                                                "conversation (SFT data?): a preference record is a prompt ending with "
                                                "a user turn plus 'chosen' and 'rejected' responses")
        raise RecordError("bad_prompt", f"{cfg.messages_field} ends with a {messages[-1]['role']!r} message; "
                                        "expected the prompt to end with a user or tool message")
    return messages


def _response_messages(value, key: str) -> list[dict]:
    if isinstance(value, str):
        return [{"role": "assistant", "content": value}]
    if isinstance(value, list) and value and all(isinstance(m, dict) and m.get("role") == "assistant" for m in value):
        return value
    raise RecordError("bad_response", f"{key} is {type(value).__name__}; expected an assistant string or a "
                                      "non-empty list of assistant messages")


def pair_segments(record: Record, cfg: DataSection) -> list[list]:
    """[chosen segments, rejected segments] of one record; raises RecordError if it cannot be used."""
    if isinstance(record.data, RecordError):
        raise record.data
    data = record.data
    prompt = _prompt_messages(data, cfg)
    for key in RESPONSES:
        if key not in data:
            raise RecordError(f"missing_{key}", f"no field {key!r}")
    if data["chosen"] == data["rejected"]:
        raise RecordError("identical_responses", "chosen and rejected are the same")
    return [render_conversation(prompt + _response_messages(data[key], key), thinking=cfg.thinking,
                                drop_thinking=cfg.drop_thinking, loss_on="last_assistant",
                                chat_format=cfg.chat_format) for key in RESPONSES]


def _fit(record: Record, ids: np.ndarray, mask: np.ndarray, cfg: DataSection, policy: BadRecordPolicy):
    """The sequence cut to seq_len under ``truncate``; None if the record is dropped."""
    if len(ids) > cfg.seq_len:
        if not policy.too_long(record.path, record.line, len(ids), cfg.seq_len):
            return None
        ids, mask = ids[:cfg.seq_len], mask[:cfg.seq_len]
    if not mask[1:].any():
        policy.reject(record.path, record.line, "no_loss_tokens", "a response has no tokens within seq_len")
        return None
    return ids, mask


def read_pairs(cfg: DataSection, tokenizer: Tokenizer, policy: BadRecordPolicy) -> PreferencePairs:
    """Read, validate and encode every pair of ``cfg.paths`` in file order (bad records: ``policy``)."""
    cfg.validate()
    usable: list[tuple[Record, list[list]]] = list(policy.parsed(cfg, lambda rec: pair_segments(rec, cfg)))
    tokens, response = [], []
    for start in range(0, len(usable), cfg.encode_chunk):
        chunk = usable[start:start + cfg.encode_chunk]
        encoded = encode_segments([segs for _, pair in chunk for segs in pair], tokenizer)
        for k, (record, _) in enumerate(chunk):
            fitted = [_fit(record, ids, mask, cfg, policy) for ids, mask in encoded[2 * k:2 * k + 2]]
            if None in fitted:
                continue
            for ids, mask in fitted:
                tokens.append(ids)
                response.append(mask)
    if not tokens:
        raise ValueError(f"no usable preference pairs in {cfg.paths} ({policy.records_read} records read; "
                         f"skipped: {policy.counter.as_dict()['skipped_by_reason']})")
    return PreferencePairs(tokens, response, policy.records_read, policy.counter)


def collate(pairs: PreferencePairs, index: np.ndarray, pad_id: int, length: int) -> PairBatch:
    """The pairs ``index`` as one :class:`PairBatch` of rows of ``length`` tokens."""
    seqs = [2 * int(i) for i in index] + [2 * int(i) + 1 for i in index]
    input_ids = torch.full((len(seqs), length), pad_id, dtype=torch.long)
    doc_ids = torch.ones((len(seqs), length), dtype=torch.long)
    scored = torch.zeros((len(seqs), length), dtype=torch.bool)
    for row, k in enumerate(seqs):
        n = len(pairs.tokens[k])
        input_ids[row, :n] = torch.from_numpy(pairs.tokens[k].astype(np.int64))
        doc_ids[row, :n] = 0
        scored[row, :n - 1] = torch.from_numpy(pairs.response[k][1:])
    return PairBatch(torch.as_tensor(np.asarray(index), dtype=torch.long), input_ids, doc_ids, scored,
                     sum(len(pairs.tokens[k]) for k in seqs))


# ---- batches -----------------------------------------------------------------------------------------
class PairLoader:
    """Deterministic, resumable, rank-sharded iterator of :class:`PairBatch` over all pairs, for ever.

    Each epoch orders the pairs by a permutation seeded with ``(seed, epoch)``; global micro-step k
    takes ``order[k*W*B:(k+1)*W*B]`` and rank r the r-th block of B (the remainder is dropped)."""

    def __init__(self, pairs: PreferencePairs, micro_batch_size: int, rank: int, world_size: int, seed: int,
                 pad_id: int, seq_len: int, shuffle: bool = True):
        if len(pairs) < micro_batch_size * world_size:
            raise ValueError(f"only {len(pairs)} preference pairs; one step needs world_size * micro_batch_size "
                             f"= {micro_batch_size * world_size}")
        self.pairs, self.micro_batch_size, self.rank, self.world_size = pairs, micro_batch_size, rank, world_size
        self.seed, self.pad_id, self.seq_len, self.shuffle = seed, pad_id, seq_len, shuffle
        self.fingerprint = pairs.fingerprint
        self.epoch, self.consumed = 0, 0
        self._order = self._epoch_order(0)

    @property
    def micro_batches_per_epoch(self) -> int:
        return len(self.pairs) // (self.micro_batch_size * self.world_size)

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self.pairs))
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.pairs))

    def __next__(self) -> PairBatch:
        step = self.micro_batch_size * self.world_size
        if self.consumed + step > len(self.pairs):
            self.epoch, self.consumed = self.epoch + 1, 0
            self._order = self._epoch_order(self.epoch)
        start = self.consumed + self.rank * self.micro_batch_size
        self.consumed += step
        return collate(self.pairs, self._order[start:start + self.micro_batch_size], self.pad_id, self.seq_len)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "consumed": self.consumed, "seed": self.seed, "shuffle": self.shuffle,
                "fingerprint": self.fingerprint}

    def load_state_dict(self, state: dict) -> None:
        for key in ("seed", "shuffle", "fingerprint"):
            if state[key] != getattr(self, key):
                raise ValueError(f"preference loader state has {key}={state[key]!r} but this loader has "
                                 f"{getattr(self, key)!r}; resume needs the same data, seed and shuffle")
        if state["consumed"] % (self.micro_batch_size * self.world_size):
            raise ValueError(f"preference loader state consumed {state['consumed']} pairs, not a multiple of "
                             f"world_size * micro_batch_size = {self.micro_batch_size * self.world_size}")
        self.epoch, self.consumed = int(state["epoch"]), int(state["consumed"])
        self._order = self._epoch_order(self.epoch)


def sweep(n: int, micro_batch_size: int, rank: int, world_size: int) -> list[np.ndarray]:
    """Every pair once, in order, as this rank's index batches; every rank gets the same number of
    batches (so sharded forwards stay in step), the last ones possibly empty."""
    per_step = micro_batch_size * world_size
    return [np.arange(n)[k + rank * micro_batch_size:][:micro_batch_size] for k in range(0, n, per_step)]
