"""DeepSeek-V4's per-forward sequence context, shared by every layer of V4 and V4.1: the compressed-window
layouts (which entries a query may see) and, under context parallelism, the rows a shard's window sees
before it. Positions within documents, shard rows and RoPE tables: ``trex.models.common.context``; the
split rule (shard_halo, check_shardable): ``config``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from trex.models.common.context import DecodeCacheLike, SequenceContext, SequenceShard
from trex.models.common.rope import rope_inv_freq
from trex.models.deepseek_v4.config import ModelConfig, check_shardable

_BIG = 1 << 40  # sentinel index for padded compressed entries


@dataclass
class WindowLayout:
    """Compression windows of rate m that lie wholly inside one document.

    Entries are grouped by the context-parallel shard their window starts in (one group without
    context parallelism): ``per_shard`` = S / shards // m entries each, a static bound (windows are
    disjoint runs of m tokens), so shapes never depend on where documents start; a shard with fewer
    windows is padded and ``valid`` masks them. N = shards * per_shard (= S // m with one shard).
    starts: [B, N] index of each window's first token (_BIG where padded); valid: [B, N];
    pos: [B, N] position of the first token within its document (RoPE position of the entry);
    has_prev: [B, N] whether the previous window of the same document exists (CSA overlap);
    lo, hi: [B, S] query t sees valid entries e with lo[t] <= e < hi[t] (same document, window closed).
    canonical: [B, N] with more than one shard, the entries in one shard's order (valid ones by start,
    then the padding): the indexer ranks them in that order, so that ``topk`` sees exactly the scores it
    sees in one process and breaks ties (the indexer ties whenever entries score exactly 0) alike.
    """

    m: int
    starts: torch.Tensor
    valid: torch.Tensor
    pos: torch.Tensor
    has_prev: torch.Tensor
    lo: torch.Tensor
    hi: torch.Tensor
    per_shard: int = 0
    canonical: torch.Tensor | None = None
    rope: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def n(self) -> int:
        return self.starts.shape[1]

    def visible(self, t0: int, t1: int) -> torch.Tensor:
        """[B, t1-t0, N] bool: which entries queries t0..t1-1 may attend to."""
        e = torch.arange(self.n, device=self.starts.device)
        seen = (e >= self.lo[:, t0:t1, None]) & (e < self.hi[:, t0:t1, None])
        # padding lies inside [lo, hi) only between shards' entries; with one group it sorts last
        return seen if self.canonical is None else seen & self.valid[:, None, :]


class SeqContext(SequenceContext):
    """Per-forward facts shared by all layers (common.context.SequenceContext: ids, document ids,
    positions, the rows this rank computes), with V4's own: RoPE tables of two kinds ("main", plain, on
    sliding layers; "compress", YaRN, on compressed ones), the compressed-window layouts of every rate
    the layers use (of the whole rows), and the rows a shard's sliding window sees before it."""

    def __init__(self, cfg: ModelConfig, input_ids: torch.Tensor, doc_ids: torch.Tensor | None,
                 cache: DecodeCacheLike | None = None, shard: SequenceShard | None = None):
        rd = cfg.qk_rope_head_dim
        inv_freq = {"main": rope_inv_freq(rd, cfg.rope_theta, None),
                    "compress": rope_inv_freq(rd, cfg.compress_rope_theta, cfg.rope_scaling)}
        super().__init__(cfg, input_ids, doc_ids, inv_freq, cache, shard)
        shard = self.shard
        shards = 1 if shard is None else shard.size
        if shard is not None:
            check_shardable(cfg, self.seq_len, shards)
        # every layout a layer will ask for, built before the first block: blocks only read the context
        # (a compiled block then sees the same context structure in every call, and never recompiles)
        rates = set(cfg.layer_rates()) - {0}
        self._layouts = {m: self._build_layout(m, shards) for m in sorted(rates)}
        # a shard's sliding window also sees the W - 1 rows before it: their document ids and RoPE tables
        self.window_halo = 0 if shard is None else cfg.sliding_window - 1
        self.window_doc, self.window_rope = self.doc, self.rope
        if shard is not None:
            lo = self.t0 - self.window_halo
            pad = max(0, -lo)
            self.window_doc = F.pad(self.full_doc[:, max(lo, 0):self.t1], (pad, 0), value=-1)
            window_pos = F.pad(self.full_pos[:, max(lo, 0):self.t1], (pad, 0))
            self.window_rope = {kind: self.rope_at(window_pos, kind) for kind in self._inv_freq}
        self.align_indexer = False  # the model's forward sets it: CSA layers keep their indexer alignment
        self.measure_recall = False  # and this: CSA layers measure how much attention their picks cover

    def layout(self, m: int) -> WindowLayout:
        return self._layouts[m]

    # ---- context parallelism (each is the identity without a shard) ----
    def own_entries(self, layout: WindowLayout) -> slice:
        """The entries of ``layout`` whose windows start in this rank's rows."""
        if self.shard is None:
            return slice(0, layout.n)
        return slice(self.shard.rank * layout.per_shard, (self.shard.rank + 1) * layout.per_shard)

    def _build_layout(self, m: int, shards: int) -> WindowLayout:
        B, S = self.full_pos.shape
        pos = self.full_pos
        dev = pos.device
        arange = torch.arange(S, device=dev)
        is_start = torch.zeros(B, S, dtype=torch.bool, device=dev)
        if S >= m:
            # a window starts at a multiple of m within its document and stays inside it
            whole = pos[:, m - 1:] == pos[:, : S - m + 1] + (m - 1)
            is_start[:, : S - m + 1] = (pos[:, : S - m + 1] % m == 0) & whole
        L = S // shards
        n = L // m  # per shard, a static bound: windows are disjoint runs of m tokens (no host read of the count)
        key = torch.where(is_start, arange, arange + S)[:, : shards * L].view(B, shards, L)
        order = key.sort(dim=2).values[:, :, :n]  # [B, shards, n]: each shard's window starts, then padding
        valid = order < S
        # search keys that keep increasing across shards: a shard's padding sorts at the shard's end
        shard_end = (torch.arange(shards, device=dev) + 1).view(1, shards, 1) * L
        start_key = torch.where(valid, order, shard_end).flatten(1).contiguous()
        end_key = torch.where(valid, order + (m - 1), shard_end + (m - 2)).flatten(1).contiguous()
        order, valid = order.flatten(1), valid.flatten(1)
        starts = torch.where(valid, order, torch.full_like(order, _BIG))
        entry_pos = pos.gather(1, torch.where(valid, order, torch.zeros_like(order)))
        doc_start = (arange - pos).contiguous()
        lo = torch.searchsorted(start_key, doc_start, right=False)
        hi = torch.searchsorted(end_key, arange.expand(B, S).contiguous(), right=True)
        layout = WindowLayout(m, starts, valid, entry_pos, valid & (entry_pos >= m), lo, hi, n)
        if shards > 1:
            layout.canonical = (~valid).to(torch.uint8).argsort(dim=1, stable=True)
        layout.rope = {"compress": self.rope_at(entry_pos, "compress")}
        return layout
