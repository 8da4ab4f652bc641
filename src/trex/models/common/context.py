"""The per-forward sequence context every architecture's layers read, and what it is built from.

``segments`` (documents as runs of equal ids, positions restarting in each), ``SequenceShard`` (a
context-parallel group's arithmetic), ``SequenceContext`` (ids, documents, positions, the rows this rank
computes and the collectives over them, RoPE tables by kind, the MoE layers' switches), the decode-cache
contract it reads (``DecodeCacheLike``) and the bookkeeping every cache shares (``DecodeSteps``), and
``shift_labels`` (next-token targets within documents). An architecture derives its own context
(DeepSeek-V4: ``deepseek_v4.SeqContext``, with the compressed-window layouts).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from trex.models.common.cross_entropy import IGNORE_INDEX


class SequenceShard(Protocol):
    """This rank's part of sequences split over a context-parallel group of ``size`` ranks: rows
    [rank * S/size, (rank + 1) * S/size) of every row. The model does the arithmetic; the group's two
    collectives come from trex.parallel.context_parallel, both differentiable (gradients go back to the
    rows' owners, summed over the group):

      gather(x)             x [B, s, ...] -> [B, size * s, ...]: every rank's x, in rank order
      exchange(head, tail)  head [B, f, ...], tail [B, b, ...] -> (the previous rank's tail [B, b, ...],
                            the next rank's head [B, f, ...]); zeros where there is no such rank
    """

    rank: int
    size: int

    def gather(self, x: torch.Tensor) -> torch.Tensor: ...

    def exchange(self, head: torch.Tensor, tail: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


class HeadSplit(Protocol):
    """This rank's slice of an attention's heads under tensor parallelism: trex.parallel.tensor_parallel sets one
    as the attention module's ``head_split`` and divides its head count, so the module computes its own heads.
    ``mean(x)``: a mean over this rank's heads (each rank has as many) -> the mean over every head of the group,
    the same on every rank (what a statistic over all heads needs: V3.2's indexer target; no gradient)."""

    def mean(self, x: torch.Tensor) -> torch.Tensor: ...


class DecodeCacheLike(Protocol):
    """What a sequence context and a model's forward read of a decode cache (V4's
    ``trex.models.deepseek_v4.decode.DecodeCache``, V4.1's ``V41DecodeCache``). The cache's module imports the
    model's, so the model names this contract, not the class. ``pos`` [B]: the position of the next token of
    each row, None until the prefill; ``count_step`` is called as each forward with the cache begins. Each
    architecture's attention hands its layer's state to ``prefill`` and takes a decode step's output from
    ``step``, with its own arguments."""

    max_new_tokens: int
    pos: torch.Tensor | None

    @property
    def prefilled(self) -> bool: ...

    def count_step(self) -> None: ...

    def prefill(self, *args: Any) -> Any: ...

    def step(self, *args: Any) -> Any: ...


class DecodeSteps:
    """The bookkeeping of ``DecodeCacheLike`` every architecture's cache shares, for at most
    ``max_new_tokens`` decode steps: ``pos`` (the model's forward sets it), ``steps`` taken since the
    prefill, ``layers`` (each attention module's state, the architecture's own). A plain class (not a
    dataclass), so FSDP passes the object itself through forward hooks; a subclass adds ``prefill`` and
    ``step``."""

    def __init__(self, max_new_tokens: int):
        self.max_new_tokens = max_new_tokens
        self.steps = 0
        self.pos: torch.Tensor | None = None
        self.layers: dict[Any, Any] = {}

    @property
    def prefilled(self) -> bool:
        return self.pos is not None

    def count_step(self) -> None:
        """A forward with this cache begins: after the prefill each one is a decode step; ValueError past
        ``max_new_tokens`` (the cache has no room for more)."""
        if self.prefilled:
            self.steps += 1
            if self.steps > self.max_new_tokens:
                raise ValueError(f"the decode cache was sized for {self.max_new_tokens} decode steps; "
                                 f"this is step {self.steps}")


def segments(doc_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """doc_ids [B, S] -> (segment [B, S] long, position [B, S] long). A document is a run of equal ids:
    an id that comes back after another one starts a new document (segment numbers 1, 2, ... per row),
    so masks that compare segments never join two runs that share an id. Positions restart at 0 in
    each run."""
    B, S = doc_ids.shape
    new_doc = torch.ones(B, S, dtype=torch.bool, device=doc_ids.device)
    new_doc[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    arange = torch.arange(S, device=doc_ids.device)
    doc_start = torch.where(new_doc, arange, torch.zeros_like(arange)).cummax(dim=1).values
    return new_doc.long().cumsum(dim=1), arange - doc_start


class SequenceContext:
    """Per-forward facts shared by all layers: ids, document ids, positions, RoPE tables; an architecture's
    context adds its own (``deepseek_v4.SeqContext``: the compressed-window layouts).

    With a filled ``cache`` (a decode step) input_ids is [B, 1] and positions come from the cache.
    With a ``shard`` (context parallelism; never with a cache) input_ids and doc_ids are the whole
    rows [B, S] and this rank computes rows t0..t1-1: ``input_ids``, ``doc``, ``pos`` and ``rope``
    are those rows', ``full_doc`` and ``full_pos`` the whole rows'. Without one, t0 = 0 and t1 = S.
    ``inv_freq``: the RoPE inverse frequencies [rd/2] of each kind of table (``rope[kind]``, ``rope_at``)."""

    def __init__(self, cfg, input_ids: torch.Tensor, doc_ids: torch.Tensor | None, inv_freq: dict[str, torch.Tensor],
                 cache: DecodeCacheLike | None = None, shard: SequenceShard | None = None):
        B, S = input_ids.shape
        dev = input_ids.device
        self.cfg = cfg
        self.cache = cache
        self.decoding = cache is not None and cache.prefilled
        self.shard = shard = None if cache is not None or (shard is not None and shard.size == 1) else shard
        arange = torch.arange(S, device=dev)
        if self.decoding:
            if S != 1:
                raise ValueError(f"a decode step takes input_ids of shape [B, 1], got {tuple(input_ids.shape)}")
            doc = torch.ones(B, 1, dtype=torch.long, device=dev)
            pos = cache.pos[:, None]
        elif doc_ids is None:
            doc = torch.zeros(B, S, dtype=torch.long, device=dev)
            pos = arange.expand(B, S)
        else:
            if doc_ids.shape != input_ids.shape:
                raise ValueError(f"doc_ids has shape {tuple(doc_ids.shape)}; expected {tuple(input_ids.shape)}")
            doc, pos = segments(doc_ids)
        shards = 1 if shard is None else shard.size
        self.seq_len = S
        self.t0 = 0 if shard is None else shard.rank * (S // shards)
        self.t1 = S if shard is None else self.t0 + S // shards
        self.full_doc, self.full_pos = doc, pos
        self.input_ids = input_ids[:, self.t0:self.t1]
        self.doc, self.pos = doc[:, self.t0:self.t1], pos[:, self.t0:self.t1]
        self._inv_freq = {kind: freqs.to(dev) for kind, freqs in inv_freq.items()}
        self.rope = {kind: self.rope_at(self.pos, kind) for kind in self._inv_freq}
        self.recording = True  # off once the forward returns: a checkpoint's recompute keeps no MoE stats
        # the model's forward sets these: [B, t1 - t0] the real tokens (MoE statistics); routing replay and
        # recording (MoE.forward)
        self.token_mask: torch.Tensor | None = None
        self.routes: dict[str, torch.Tensor] | None = None
        self.route_log: dict[str, torch.Tensor] | None = None

    def rope_at(self, positions: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [*positions.shape, rd/2] in fp32."""
        angles = positions[..., None].float() * self._inv_freq[kind]
        return angles.cos(), angles.sin()

    # ---- context parallelism (each is the identity without a shard) ----
    def extend(self, x: torch.Tensor, before: int, after: int) -> torch.Tensor:
        """This rank's rows x [B, s, ...] -> rows t0 - before .. t1 + after - 1 [B, before + s + after, ...],
        the neighbours' rows exchanged (zeros beyond the sequence)."""
        if self.shard is None:
            return x
        prev_tail, next_head = self.shard.exchange(x[:, :after], x[:, x.shape[1] - before:])
        return torch.cat((prev_tail, x, next_head), dim=1)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """[B, s, ...] per rank -> [B, shards * s, ...], every rank's in rank order."""
        return x if self.shard is None else self.shard.gather(x)

    def shard_sum(self, x: torch.Tensor) -> torch.Tensor:
        """[B, ...] per rank -> the sum over the group's ranks (differentiable)."""
        return x if self.shard is None else self.shard.gather(x.unsqueeze(1)).sum(dim=1)


def shift_labels(labels: torch.Tensor, shift: int, doc: torch.Tensor | None) -> torch.Tensor:
    """targets[t] = labels[t + shift], IGNORE_INDEX past the end or across a document boundary."""
    B, S = labels.shape
    targets = torch.full_like(labels, IGNORE_INDEX)
    if shift < S:
        targets[:, : S - shift] = labels[:, shift:]
        if doc is not None:
            doc = segments(doc)[0]
            crosses = doc[:, shift:] != doc[:, : S - shift]
            targets[:, : S - shift] = targets[:, : S - shift].masked_fill(crosses, IGNORE_INDEX)
    return targets
