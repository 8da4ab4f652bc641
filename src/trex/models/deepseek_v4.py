"""DeepSeek-V4 (Flash / Pro) for training, in plain PyTorch.

Read top to bottom: RoPE, the per-sequence context (positions within documents, compressed
window layout), the compressor and lightning indexer, the sparse attention core, attention,
MoE, mHC, the block, MTP, and the model. The math follows the official ``inference/model.py``
as summarised in the project's reference notes; parameter names follow the official checkpoint
(``attn.wq_a``, ``ffn.experts.w1`` ...), with routed experts stacked per layer as [E, out, in].

Shapes: B batch, S sequence, d hidden, H query heads, c head dim, n = hc_mult streams,
m compression rate, N compressed entries, W sliding window, E experts, k experts per token.

Efficiency by construction: sliding-window attention runs on blocks of W/4 queries against the
W/4 + W keys they need (memory O(S*W)); HCA attends densely to the S/m' compressed entries; CSA's indexer
scores S x S/4 in bounded chunks without autograd and the attention gathers only the top-k
entries; experts run as grouped matmuls over tokens sorted by expert.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from trex import kernels
from trex.models.config import CSA, HASH_MOE, MOE, SLIDING, ModelConfig, YarnScaling

IGNORE_INDEX = -100
_BIG = 1 << 40  # sentinel index for padded compressed entries


# ==================================================================================================
# RoPE: interleaved pairs on the last `rd` dims; plain on sliding layers, YaRN on compressed ones.
# ==================================================================================================
def rope_inv_freq(dim: int, theta: float, yarn: YarnScaling | None) -> torch.Tensor:
    """Inverse frequencies [dim/2] (YaRN blend between interpolation and extrapolation; no mscale)."""
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if yarn is None:
        return freqs

    def correction_dim(rotations: float) -> float:
        return dim * math.log(yarn.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(yarn.beta_fast)), 0)
    high = min(math.ceil(correction_dim(yarn.beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp
    return freqs / yarn.factor * (1 - extrapolate) + freqs * extrapolate


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the last 2*cos.shape[-1] dims of x as interleaved pairs (x[2i], x[2i+1]).

    x: [..., D]; cos, sin: broadcastable to [..., rd/2]. ``inverse`` rotates by -angle.
    """
    rd = 2 * cos.shape[-1]
    nope, rope = x[..., :-rd], x[..., -rd:]
    pairs = rope.float().unflatten(-1, (-1, 2))
    x0, x1 = pairs[..., 0], pairs[..., 1]
    if inverse:
        sin = -sin
    rotated = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2).to(x.dtype)
    return torch.cat((nope, rotated), dim=-1)


# ==================================================================================================
# Sequence context: positions within documents and the compressed-window layout, built once per
# forward and shared by every layer.
# ==================================================================================================
@dataclass
class WindowLayout:
    """Compression windows of rate m that lie wholly inside one document.

    starts: [B, N] index of each window's first token (_BIG where padded); valid: [B, N];
    pos: [B, N] position of the first token within its document (RoPE position of the entry);
    has_prev: [B, N] whether the previous window of the same document exists (CSA overlap);
    lo, hi: [B, S] query t sees entries e with lo[t] <= e < hi[t] (same document, window closed).
    """

    m: int
    starts: torch.Tensor
    valid: torch.Tensor
    pos: torch.Tensor
    has_prev: torch.Tensor
    lo: torch.Tensor
    hi: torch.Tensor
    rope: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def n(self) -> int:
        return self.starts.shape[1]

    def safe_starts(self) -> torch.Tensor:
        return torch.where(self.valid, self.starts, torch.zeros_like(self.starts))

    def visible(self, t0: int, t1: int) -> torch.Tensor:
        """[B, t1-t0, N] bool: which entries queries t0..t1-1 may attend to."""
        e = torch.arange(self.n, device=self.starts.device)
        return (e >= self.lo[:, t0:t1, None]) & (e < self.hi[:, t0:t1, None])


class SeqContext:
    """Per-forward facts shared by all layers: ids, document ids, positions, RoPE tables, layouts."""

    def __init__(self, cfg: ModelConfig, input_ids: torch.Tensor, doc_ids: torch.Tensor | None):
        B, S = input_ids.shape
        dev = input_ids.device
        self.cfg = cfg
        self.input_ids = input_ids
        arange = torch.arange(S, device=dev)
        if doc_ids is None:
            self.doc = torch.zeros(B, S, dtype=torch.long, device=dev)
            self.pos = arange.expand(B, S)
        else:
            if doc_ids.shape != input_ids.shape:
                raise ValueError(f"doc_ids has shape {tuple(doc_ids.shape)}; expected {tuple(input_ids.shape)}")
            self.doc = doc_ids.long()
            new_doc = torch.ones(B, S, dtype=torch.bool, device=dev)
            new_doc[:, 1:] = self.doc[:, 1:] != self.doc[:, :-1]
            doc_start = torch.where(new_doc, arange, torch.zeros_like(arange)).cummax(dim=1).values
            self.pos = arange - doc_start
        rd = cfg.qk_rope_head_dim
        self._inv_freq = {
            "main": rope_inv_freq(rd, cfg.rope_theta, None).to(dev),
            "compress": rope_inv_freq(rd, cfg.compress_rope_theta, cfg.rope_scaling).to(dev),
        }
        self.rope = {kind: self.rope_at(self.pos, kind) for kind in self._inv_freq}
        self._layouts: dict[int, WindowLayout] = {}
        self.moe_stats: list[MoEStats] = []

    def rope_at(self, positions: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [*positions.shape, rd/2] in fp32."""
        angles = positions[..., None].float() * self._inv_freq[kind]
        return angles.cos(), angles.sin()

    def layout(self, m: int) -> WindowLayout:
        if m not in self._layouts:
            self._layouts[m] = self._build_layout(m)
        return self._layouts[m]

    def _build_layout(self, m: int) -> WindowLayout:
        B, S = self.pos.shape
        dev = self.pos.device
        arange = torch.arange(S, device=dev)
        is_start = torch.zeros(B, S, dtype=torch.bool, device=dev)
        if S >= m:
            # a window starts at a multiple of m within its document and stays inside it
            whole = self.pos[:, m - 1:] == self.pos[:, : S - m + 1] + (m - 1)
            is_start[:, : S - m + 1] = (self.pos[:, : S - m + 1] % m == 0) & whole
        n = int(is_start.sum(dim=1).max()) if S else 0
        order = torch.where(is_start, arange, arange + S).sort(dim=1).values[:, :n]
        valid = order < S
        starts = torch.where(valid, order, torch.full_like(order, _BIG))
        safe = torch.where(valid, order, torch.zeros_like(order))
        pos = self.pos.gather(1, safe)
        ends = torch.where(valid, starts + (m - 1), torch.full_like(order, _BIG))
        doc_start = (arange - self.pos).contiguous()
        lo = torch.searchsorted(starts.contiguous(), doc_start, right=False)
        hi = torch.searchsorted(ends.contiguous(), arange.expand(B, S).contiguous(), right=True)
        layout = WindowLayout(m, starts, valid, pos, valid & (pos >= m), lo, hi)
        layout.rope = {"compress": self.rope_at(pos, "compress")}
        return layout


# ==================================================================================================
# Norms and small helpers
# ==================================================================================================
class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.get("rms_norm", x.device.type)(x, self.weight, self.eps)


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return kernels.get("rms_norm", x.device.type)(x, None, eps)


def linear_fp32(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.linear(x.float(), weight.float())


def _gather_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x: [B, S, C], index: [B, *rest] -> [B, *rest, C]."""
    B, C = x.shape[0], x.shape[-1]
    flat = index.reshape(B, -1, 1).expand(-1, -1, C)
    return x.gather(1, flat).view(*index.shape, C)


# ==================================================================================================
# Compressor (CSA m=4 with overlapping windows, HCA m'=128 without) and the lightning indexer
# ==================================================================================================
class Compressor(nn.Module):
    """Softmax-gated pooling of each window of m tokens into one entry of width c.

    Overlap (CSA): rows [c:2c] of wkv/wgate/ape are the current window's series, rows [0:c]
    the series the window contributes to the next entry; one softmax runs over the 2m slots
    per channel. Projections and pooling run in fp32.
    """

    def __init__(self, dim: int, c: int, m: int, overlap: bool, eps: float):
        super().__init__()
        self.c, self.m, self.overlap = c, m, overlap
        width = 2 * c if overlap else c
        self.wkv = nn.Linear(dim, width, bias=False)
        self.wgate = nn.Linear(dim, width, bias=False)
        self.ape = nn.Parameter(torch.zeros(m, width))
        self.norm = RMSNorm(c, eps)

    def forward(self, x: torch.Tensor, layout: WindowLayout) -> torch.Tensor:
        """x: [B, S, d] -> entries [B, N, c] (RoPE applied at each window's first position)."""
        B, N, m, c = x.shape[0], layout.n, self.m, self.c
        if N == 0:
            return x.new_zeros(B, 0, c)
        kv = linear_fp32(x, self.wkv.weight)
        score = linear_fp32(x, self.wgate.weight)
        tok = layout.safe_starts()[:, :, None] + torch.arange(m, device=x.device)  # [B, N, m]
        kv_cur, score_cur = _gather_rows(kv, tok), _gather_rows(score, tok) + self.ape.float()
        if self.overlap:
            prev = (tok - m).clamp(min=0)
            kv_prev = _gather_rows(kv[..., :c], prev)
            score_prev = _gather_rows(score[..., :c], prev) + self.ape[:, :c].float()
            score_prev = score_prev.masked_fill(~layout.has_prev[:, :, None, None], float("-inf"))
            kv_cur = torch.cat((kv_prev, kv_cur[..., c:]), dim=2)
            score_cur = torch.cat((score_prev, score_cur[..., c:]), dim=2)
        pooled = (kv_cur * score_cur.softmax(dim=2)).sum(dim=2)
        pooled = self.norm(pooled.to(x.dtype))
        cos, sin = layout.rope["compress"]
        return apply_rope(pooled, cos, sin)


class Indexer(nn.Module):
    """Lightning indexer: I[t, s] = sum_h w[t, h] * relu(q[t, h] . K[s]); keeps the top-k entries.

    Top-k is not differentiable, so the LM loss gives the indexer no gradient; it runs under
    no_grad, in query chunks so the [B, chunk, H_I, N] scores stay bounded.
    """

    chunk_elems = 1 << 24

    def __init__(self, cfg: ModelConfig, m: int):
        super().__init__()
        self.n_heads, self.head_dim, self.topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        self.wq_b = nn.Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.weights_proj = nn.Linear(cfg.hidden_size, self.n_heads, bias=False)
        self.compressor = Compressor(cfg.hidden_size, self.head_dim, m, overlap=True, eps=cfg.rms_norm_eps)

    @torch.no_grad()
    def forward(self, x: torch.Tensor, qr: torch.Tensor, ctx: SeqContext, layout: WindowLayout):
        """Returns (idx [B, S, k] long, valid [B, S, k] bool) with k = min(index_topk, N)."""
        B, S, _ = x.shape
        keys = self.compressor(x, layout).float()  # [B, N, c_I]
        q = self.wq_b(qr).view(B, S, self.n_heads, self.head_dim)
        cos, sin = ctx.rope["compress"]
        q = apply_rope(q, cos[:, :, None], sin[:, :, None]).float()
        w = self.weights_proj(x).float() * (self.head_dim**-0.5 * self.n_heads**-0.5)
        k = min(self.topk, layout.n)
        chunk = max(1, self.chunk_elems // max(1, B * self.n_heads * layout.n))
        idx, valid = [], []
        for t0 in range(0, S, chunk):
            t1 = min(S, t0 + chunk)
            scores = torch.einsum("bthc,bnc->bthn", q[:, t0:t1], keys).relu_()
            scores = torch.einsum("bthn,bth->btn", scores, w[:, t0:t1])
            scores.masked_fill_(~layout.visible(t0, t1), float("-inf"))
            top = scores.topk(k, dim=-1)
            idx.append(top.indices)
            valid.append(top.values > float("-inf"))
        return torch.cat(idx, dim=1), torch.cat(valid, dim=1)


# ==================================================================================================
# Sparse attention core: one softmax (with a per-head sink) over the sliding window and the
# compressed entries the query may see.
# ==================================================================================================
def sparse_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    sink: torch.Tensor,
    scale: float,
    window: int,
    doc: torch.Tensor,
    compressed: torch.Tensor | None = None,
    comp_mask: torch.Tensor | None = None,
    comp_idx: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of q over shared K=V entries.

    q: [B, S, H, c]; kv: [B, S, c] (one KV head, K = V); sink: [H] logits that take
    probability mass but carry no value; doc: [B, S] document ids (no attention across them).
    Compressed entries (optional) are [B, N, c] and either
      dense  (HCA): comp_mask [B, S, N] says which entries each query sees, or
      sparse (CSA): comp_idx [B, S, k] picks entries and comp_mask [B, S, k] says which are valid.
    Query t sees raw keys t-W+1..t of its document. Returns [B, S, H, c].
    """
    B, S, H, c = q.shape
    W = window
    Q = max(1, W // 4)  # queries per block: a block sees its Q + W keys, of which each query uses W
    K = Q + W
    nb = -(-S // Q)
    P = nb * Q
    # --- sliding window: block j of Q queries against the K keys that end with it -----------------
    qb = F.pad(q, (0, 0, 0, 0, 0, P - S)).view(B, nb, Q * H, c)
    kvp = F.pad(kv, (0, 0, W, P - S))  # [B, W + P, c]
    kb = kvp.unfold(1, K, Q).transpose(-1, -2)  # [B, nb, K, c]: keys j*Q - W ... j*Q + Q - 1
    local = (qb @ kb.transpose(-1, -2)).view(B, nb, Q, H, K) * scale
    docp = F.pad(doc, (W, P - S), value=-1)
    key_doc = docp.unfold(1, K, Q)  # [B, nb, K]
    t = torch.arange(P, device=q.device).view(nb, Q, 1)
    s = torch.arange(nb, device=q.device).view(nb, 1, 1) * Q - W + torch.arange(K, device=q.device)
    in_window = (s <= t) & (s > t - W) & (s >= 0)  # [nb, Q, K]
    q_doc = F.pad(doc, (0, P - S), value=-2).view(B, nb, Q, 1)
    ok = in_window & (key_doc[:, :, None, :] == q_doc)  # [B, nb, Q, K]
    local = local.masked_fill(~ok[:, :, :, None, :], float("-inf")).view(B, P, H, K)[:, :S]
    # --- compressed entries ------------------------------------------------------------------
    parts = [local]
    if compressed is not None and compressed.shape[1] > 0:
        if comp_idx is None:
            comp = (q.reshape(B, S * H, c) @ compressed.transpose(1, 2)).view(B, S, H, -1) * scale
        else:
            gathered = _gather_rows(compressed, comp_idx)  # [B, S, k, c]
            comp = (q @ gathered.transpose(-1, -2)) * scale  # [B, S, H, k]
        parts.append(comp.masked_fill(~comp_mask[:, :, None, :], float("-inf")))
    parts.append(sink.float().view(1, 1, H, 1).expand(B, S, H, 1))
    probs = torch.cat([p.float() for p in parts], dim=-1).softmax(dim=-1).to(q.dtype)
    # --- weighted values -----------------------------------------------------------------------
    p_local = F.pad(probs[..., :K], (0, 0, 0, 0, 0, P - S)).view(B, nb, Q * H, K)
    out = (p_local @ kb).view(B, P, H, c)[:, :S]
    if len(parts) == 3:
        p_comp = probs[..., K:-1]
        if comp_idx is None:
            out = out + (p_comp.reshape(B, S * H, -1) @ compressed).view(B, S, H, c)
        else:
            out = out + p_comp @ gathered
    return out


# ==================================================================================================
# Attention
# ==================================================================================================
class Attention(nn.Module):
    """Shared-KV MQA with low-rank queries, partial RoPE, sinks and a grouped output projection."""

    def __init__(self, cfg: ModelConfig, layer_type: str):
        super().__init__()
        d, H, c = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
        self.cfg, self.layer_type, self.n_heads, self.head_dim = cfg, layer_type, H, c
        self.m = cfg.compress_rate(layer_type)
        self.rope_kind = "main" if layer_type == SLIDING else "compress"
        self.wq_a = nn.Linear(d, cfg.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.wq_b = nn.Linear(cfg.q_lora_rank, H * c, bias=False)
        self.wkv = nn.Linear(d, c, bias=False)
        self.kv_norm = RMSNorm(c, cfg.rms_norm_eps)
        self.wo_a = nn.Linear(H * c // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank, bias=False)
        self.wo_b = nn.Linear(cfg.o_groups * cfg.o_lora_rank, d, bias=False)
        self.attn_sink = nn.Parameter(torch.zeros(H))
        self.compressor = Compressor(d, c, self.m, layer_type == CSA, cfg.rms_norm_eps) if self.m else None
        self.indexer = Indexer(cfg, self.m) if layer_type == CSA else None

    def forward(self, x: torch.Tensor, ctx: SeqContext) -> torch.Tensor:
        """x: [B, S, d] (already attn_norm'ed) -> [B, S, d]."""
        B, S, _ = x.shape
        cfg, H, c = self.cfg, self.n_heads, self.head_dim
        cos, sin = ctx.rope[self.rope_kind]
        cos_h, sin_h = cos[:, :, None], sin[:, :, None]
        qr = self.q_norm(self.wq_a(x))
        q = unweighted_rms_norm(self.wq_b(qr).view(B, S, H, c), cfg.rms_norm_eps)
        q = apply_rope(q, cos_h, sin_h)
        kv = apply_rope(self.kv_norm(self.wkv(x)), cos, sin)

        compressed = comp_mask = comp_idx = None
        if self.compressor is not None:
            layout = ctx.layout(self.m)
            compressed = self.compressor(x, layout)
            if self.indexer is not None:
                comp_idx, comp_mask = self.indexer(x, qr, ctx, layout)
            else:
                comp_mask = layout.visible(0, S)
        o = sparse_attention(q, kv, self.attn_sink, c**-0.5, cfg.sliding_window, ctx.doc,
                             compressed, comp_mask, comp_idx)
        o = apply_rope(o, cos_h, sin_h, inverse=True)
        g = cfg.o_groups
        o = torch.einsum("bsgi,goi->bsgo", o.reshape(B, S, g, -1), self.wo_a.weight.view(g, cfg.o_lora_rank, -1))
        return self.wo_b(o.flatten(2))


# ==================================================================================================
# Mixture of experts
# ==================================================================================================
@dataclass
class MoEStats:
    """Per-layer routing facts for the training loop (balance loss, bias update, load metrics)."""

    layer: str
    counts: torch.Tensor  # [E] tokens routed to each expert (detached)
    balance_loss: torch.Tensor | None  # sequence-wise balance loss (score-routed layers, training only)


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    return F.silu(gate.float().clamp(max=limit)) * up.float().clamp(-limit, limit)


class SharedExpert(nn.Module):
    def __init__(self, dim: int, inter: int, limit: float):
        super().__init__()
        self.limit = limit
        self.w1 = nn.Linear(dim, inter, bias=False)
        self.w2 = nn.Linear(inter, dim, bias=False)
        self.w3 = nn.Linear(dim, inter, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(clamped_swiglu(self.w1(x), self.w3(x), self.limit).to(x.dtype))


class Experts(nn.Module):
    """E routed experts stacked as w1, w3: [E, I, d] and w2: [E, d, I]."""

    def __init__(self, n: int, dim: int, inter: int, limit: float):
        super().__init__()
        self.limit = limit
        self.w1 = nn.Parameter(torch.empty(n, inter, dim))
        self.w2 = nn.Parameter(torch.empty(n, dim, inter))
        self.w3 = nn.Parameter(torch.empty(n, inter, dim))

    def forward(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x: [T, d]; idx, weights: [T, k] -> sum_k weights * expert_idx(x): [T, d]."""
        T, k = idx.shape
        flat = idx.reshape(-1)
        order = flat.argsort(stable=True)
        token = order // k
        counts = torch.bincount(flat, minlength=self.w1.shape[0]).tolist()
        mm = kernels.get("grouped_mm", x.device.type)
        xs = x[token]
        h = clamped_swiglu(mm(xs, self.w1, counts), mm(xs, self.w3, counts), self.limit)
        h = (h * weights.reshape(-1)[order, None].float()).to(x.dtype)
        return torch.zeros_like(x).index_add_(0, token, mm(h, self.w2, counts))


class Gate(nn.Module):
    """Router: sqrt(softplus) affinities in fp32; top-k with the aux-loss-free bias, or a hash table."""

    def __init__(self, cfg: ModelConfig, hashed: bool):
        super().__init__()
        self.cfg, self.hashed = cfg, hashed
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size))
        if hashed:
            self.register_buffer("tid2eid", torch.zeros(cfg.vocab_size, cfg.num_experts_per_tok, dtype=torch.long))
        else:
            self.register_buffer("bias", torch.zeros(cfg.n_routed_experts, dtype=torch.float32))

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        logits = linear_fp32(x, self.weight)
        fn = self.cfg.scoring_func
        if fn == "sqrtsoftplus":
            return F.softplus(logits).sqrt()
        return logits.sigmoid() if fn == "sigmoid" else logits.softmax(dim=-1)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor):
        """x: [T, d] -> (weights [T, k] fp32, idx [T, k], scores [T, E] fp32)."""
        s = self.scores(x)
        if self.hashed:
            idx = self.tid2eid[input_ids.reshape(-1)].long()
        else:
            idx = (s + self.bias).topk(self.cfg.num_experts_per_tok, dim=-1, sorted=False).indices
        w = s.gather(1, idx)
        if self.cfg.norm_topk_prob and self.cfg.scoring_func != "softmax":
            w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        return w * self.cfg.routed_scaling_factor, idx, s


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, mlp_type: str, name: str):
        super().__init__()
        self.name = name
        self.gate = Gate(cfg, hashed=mlp_type == HASH_MOE)
        self.experts = Experts(cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.swiglu_limit)
        self.shared_experts = SharedExpert(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts,
                                           cfg.swiglu_limit)

    def forward(self, x: torch.Tensor, ctx: SeqContext) -> torch.Tensor:
        B, S, d = x.shape
        flat = x.reshape(-1, d)
        weights, idx, scores = self.gate(flat, ctx.input_ids)
        y = self.experts(flat, idx, weights) + self.shared_experts(flat)
        E = scores.shape[-1]
        counts = torch.bincount(idx.reshape(-1), minlength=E).detach()
        ctx.moe_stats.append(MoEStats(self.name, counts, self._balance_loss(scores, idx, B, S) if self.training
                                      and not self.gate.hashed else None))
        return y.view(B, S, d)

    @staticmethod
    def _balance_loss(scores: torch.Tensor, idx: torch.Tensor, B: int, S: int) -> torch.Tensor:
        """Sequence-wise balance loss sum_i f_i * P_i averaged over sequences (DeepSeek-V3 form)."""
        E, k = scores.shape[-1], idx.shape[-1]
        chosen = torch.zeros_like(scores).scatter_(1, idx, 1.0).view(B, S, E)
        f = chosen.sum(dim=1) * (E / (k * S))
        p = (scores / scores.sum(dim=-1, keepdim=True)).view(B, S, E).mean(dim=1)
        return (f * p).sum(dim=-1).mean()


# ==================================================================================================
# mHC: manifold-constrained hyper-connections around every sublayer
# ==================================================================================================
class HyperConnection(nn.Module):
    """Mixes n residual streams: pre (collapse), post (expand), comb (Sinkhorn, applied as comb^T)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        n = cfg.hc_mult
        self.n, self.iters, self.hc_eps, self.norm_eps = n, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps
        self.fn = nn.Parameter(torch.empty((2 + n) * n, n * cfg.hidden_size))
        self.base = nn.Parameter(torch.zeros((2 + n) * n))
        self.scale = nn.Parameter(torch.ones(3))

    def forward(self, X: torch.Tensor, sublayer) -> torch.Tensor:
        """X: [B, S, n, d] -> [B, S, n, d]; sublayer maps [B, S, d] -> [B, S, d]."""
        n = self.n
        xf = X.flatten(-2).float()
        mixes = F.linear(unweighted_rms_norm(xf, self.norm_eps), self.fn.float())
        base, scale = self.base.float(), self.scale.float()
        pre = torch.sigmoid(mixes[..., :n] * scale[0] + base[:n]) + self.hc_eps
        post = 2 * torch.sigmoid(mixes[..., n : 2 * n] * scale[1] + base[n : 2 * n])
        logits = mixes[..., 2 * n :].unflatten(-1, (n, n)) * scale[2] + base[2 * n :].view(n, n)
        comb = logits.softmax(dim=-1) + self.hc_eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.hc_eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        y = sublayer((pre.unsqueeze(-1) * X.float()).sum(dim=2).to(X.dtype))
        mixed = post.unsqueeze(-1) * y.float().unsqueeze(-2) + comb.transpose(-1, -2) @ X.float()
        return mixed.to(X.dtype)


class HyperHead(nn.Module):
    """Collapses the n streams into one: sigmoid pre-weights, no Sinkhorn."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        n = cfg.hc_mult
        self.hc_eps, self.norm_eps = cfg.hc_eps, cfg.rms_norm_eps
        self.fn = nn.Parameter(torch.empty(n, n * cfg.hidden_size))
        self.base = nn.Parameter(torch.zeros(n))
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, X: torch.Tensor) -> torch.Tensor:
        mixes = F.linear(unweighted_rms_norm(X.flatten(-2).float(), self.norm_eps), self.fn.float())
        pre = torch.sigmoid(mixes * self.scale.float() + self.base.float()) + self.hc_eps
        return (pre.unsqueeze(-1) * X.float()).sum(dim=2).to(X.dtype)


# ==================================================================================================
# Block, MTP, model
# ==================================================================================================
class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_type: str, mlp_type: str, name: str):
        super().__init__()
        self.layer_type = layer_type
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg, layer_type)
        self.ffn = MoE(cfg, mlp_type, name)
        self.hc_attn = HyperConnection(cfg)
        self.hc_ffn = HyperConnection(cfg)

    def forward(self, X: torch.Tensor, ctx: SeqContext) -> torch.Tensor:
        X = self.hc_attn(X, lambda x: self.attn(self.attn_norm(x), ctx))
        return self.hc_ffn(X, lambda x: self.ffn(self.ffn_norm(x), ctx))


class MTPBlock(Block):
    """Multi-token prediction: a full block fed with e_proj(enorm(embed(next token))) + h_proj(hnorm(X))."""

    def __init__(self, cfg: ModelConfig, name: str):
        super().__init__(cfg, cfg.mtp_layer_type, MOE, name)
        d = cfg.hidden_size
        self.e_proj = nn.Linear(d, d, bias=False)
        self.h_proj = nn.Linear(d, d, bias=False)
        self.enorm = RMSNorm(d, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(d, cfg.rms_norm_eps)
        self.norm = RMSNorm(d, cfg.rms_norm_eps)
        self.hc_head = HyperHead(cfg)

    def forward(self, X: torch.Tensor, next_emb: torch.Tensor, ctx: SeqContext) -> tuple[torch.Tensor, torch.Tensor]:
        """X: [B, S, n, d] previous stream; next_emb: [B, S, d] embedding of the token one ahead.

        Returns (the module's stream [B, S, n, d], normed hidden state for the shared head [B, S, d]).
        Every parameter of the module is used here, so it can be one FSDP unit."""
        Z = self.e_proj(self.enorm(next_emb)).unsqueeze(2) + self.h_proj(self.hnorm(X))
        Z = super().forward(Z, ctx)
        return Z, self.norm(self.hc_head(Z))


@dataclass
class ModelOutput:
    """logits [B, S, V] fp32; loss: mean next-token CE over labelled tokens; mtp_logits[j] predicts
    token t + 2 + j and mtp_loss averages their CE; moe_stats per MoE layer (main, then MTP)."""

    logits: torch.Tensor
    loss: torch.Tensor | None = None
    mtp_logits: list[torch.Tensor] = field(default_factory=list)
    mtp_loss: torch.Tensor | None = None
    moe_stats: list[MoEStats] = field(default_factory=list)


def shift_labels(labels: torch.Tensor, shift: int, doc: torch.Tensor | None) -> torch.Tensor:
    """targets[t] = labels[t + shift], IGNORE_INDEX past the end or across a document boundary."""
    B, S = labels.shape
    targets = torch.full_like(labels, IGNORE_INDEX)
    if shift < S:
        targets[:, : S - shift] = labels[:, shift:]
        if doc is not None:
            crosses = doc[:, shift:] != doc[:, : S - shift]
            targets[:, : S - shift] = targets[:, : S - shift].masked_fill(crosses, IGNORE_INDEX)
    return targets


def causal_lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over targets != IGNORE_INDEX (0 if there are none)."""
    loss_sum = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX,
                               reduction="sum")
    return loss_sum / (targets != IGNORE_INDEX).sum().clamp(min=1)


class DeepseekV4(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        d = cfg.hidden_size
        self.embed = nn.Embedding(cfg.vocab_size, d)
        self.layers = nn.ModuleList(
            Block(cfg, lt, mt, f"layers.{i}") for i, (lt, mt) in enumerate(zip(cfg.layer_types, cfg.mlp_layer_types))
        )
        self.hc_head = HyperHead(cfg)
        self.norm = RMSNorm(d, cfg.rms_norm_eps)
        self.head = nn.Linear(d, cfg.vocab_size, bias=False)
        self.mtp = nn.ModuleList(MTPBlock(cfg, f"mtp.{j}") for j in range(cfg.num_nextn_predict_layers))
        self.init_weights()

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """Normal(0, initializer_range) for matrices, ones for norms and mHC scales, zeros for biases,
        sinks and ``ape``; a random hash table with k distinct experts per token."""
        std = self.cfg.initializer_range
        gen = None
        if seed is not None and self.embed.weight.device.type != "meta":
            gen = torch.Generator(device=self.embed.weight.device).manual_seed(seed)
        for name, p in self.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if leaf in ("base", "attn_sink", "ape"):
                p.zero_()
            elif leaf == "scale" or (leaf == "weight" and p.dim() == 1):
                p.fill_(1.0)
            else:
                p.normal_(0.0, std, generator=gen)
        for module in self.modules():
            if isinstance(module, Gate):
                if module.hashed:
                    V, E, k = self.cfg.vocab_size, self.cfg.n_routed_experts, self.cfg.num_experts_per_tok
                    rand = torch.rand(V, E, device=module.tid2eid.device, generator=gen)
                    module.tid2eid.copy_(rand.argsort(dim=-1)[:, :k])
                else:
                    module.bias.zero_()

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                doc_ids: torch.Tensor | None = None) -> ModelOutput:
        """input_ids, labels, doc_ids: [B, S]. ``labels`` are aligned with input_ids (the shift happens
        here, as in Hugging Face); IGNORE_INDEX (-100) marks unlabelled tokens. Tokens of different
        ``doc_ids`` never attend to each other, share no compression window, and positions restart."""
        ctx = SeqContext(self.cfg, input_ids, doc_ids)
        emb = self.embed(input_ids)
        X = emb.unsqueeze(2).expand(-1, -1, self.cfg.hc_mult, -1)
        for layer in self.layers:
            X = layer(X, ctx)
        logits = self.logits(self.norm(self.hc_head(X)))
        out = ModelOutput(logits=logits)
        if labels is not None:
            out.loss = causal_lm_loss(logits, shift_labels(labels, 1, doc_ids))
        mtp_losses = []
        for j, mtp in enumerate(self.mtp):
            next_ids = F.pad(input_ids[:, j + 1 :], (0, j + 1), value=0)
            X, h = mtp(X, self.embed(next_ids), ctx)
            mtp_logits = self.logits(h)
            out.mtp_logits.append(mtp_logits)
            if labels is not None:
                mtp_losses.append(causal_lm_loss(mtp_logits, shift_labels(labels, j + 2, doc_ids)))
        if mtp_losses:
            out.mtp_loss = torch.stack(mtp_losses).mean()
        out.moe_stats = ctx.moe_stats
        return out

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """LM head in fp32: [B, S, d] -> [B, S, V]."""
        return linear_fp32(h, self.head.weight)
