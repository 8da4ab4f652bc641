"""DeepSeek-V4 sparse attention: one softmax (with a per-head sink) over the sliding window and the
compressed entries a query may see.

Two implementations with the same signature, registered as the op ``sparse_attention``:

* ``reference``: plain PyTorch ops, differentiated by autograd. The test oracle.
* ``fused_backward``: the same forward, with a hand-written backward (``SparseAttention``). It saves
  q, kv, the compressed entries, the top-k indices and the probabilities only, re-gathers the top-k
  entries in backward (one query chunk at a time, see CHUNK_BYTES) instead of keeping a
  [B, S, k, c] copy, and accumulates each key's gradient from both of its uses (score and value)
  in place. When the top-k picks half or more of the entries (short sequences) it runs them as the
  dense path with a mask (DENSE_TOPK_FRACTION). Vendor-neutral; the default everywhere until a
  vendor registers a fused kernel.

Scores q.k are accumulated and kept in fp32 whatever the compute dtype (``scores_fp32``), as the
official kernels do: a bf16 run rounds neither the scores nor the softmax. The value sums and the
backward's matmuls run in the compute dtype.

Shapes: B batch, S queries, H heads, c head dim, W window, N compressed entries, k top-k.
Sliding-window attention runs on blocks of Q = W/4 queries against the Q + W keys that end with the
block, so memory is O(S * W), never S x S.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class WindowBlocks:
    """Block layout of the sliding window: nb blocks of Q queries, each against K = Q + W keys.

    P = nb * Q (S padded); ``ok`` [B, nb, Q, K]: key in the query's window and document."""

    Q: int
    K: int
    nb: int
    P: int
    ok: torch.Tensor

    @classmethod
    def build(cls, doc: torch.Tensor, window: int) -> WindowBlocks:
        B, S = doc.shape
        W = window
        Q = max(1, W // 4)  # queries per block: a block sees its Q + W keys, of which each query uses W
        K = Q + W
        nb = -(-S // Q)
        P = nb * Q
        key_doc = F.pad(doc, (W, P - S), value=-1).unfold(1, K, Q)  # [B, nb, K]
        t = torch.arange(P, device=doc.device).view(nb, Q, 1)
        s = torch.arange(nb, device=doc.device).view(nb, 1, 1) * Q - W + torch.arange(K, device=doc.device)
        in_window = (s <= t) & (s > t - W) & (s >= 0)  # [nb, Q, K]
        q_doc = F.pad(doc, (0, P - S), value=-2).view(B, nb, Q, 1)
        return cls(Q, K, nb, P, in_window & (key_doc[:, :, None, :] == q_doc))

    def query_blocks(self, x: torch.Tensor) -> torch.Tensor:
        """[B, S, H, c] -> [B, nb, Q * H, c] (zero-padded to P queries)."""
        B, S, H, c = x.shape
        return F.pad(x, (0, 0, 0, 0, 0, self.P - S)).view(B, self.nb, self.Q * H, c)

    def key_blocks(self, kv: torch.Tensor, window: int) -> torch.Tensor:
        """[B, S, c] -> [B, nb, K, c]: block j holds keys j*Q - W ... j*Q + Q - 1 (a view)."""
        kvp = F.pad(kv, (0, 0, window, self.P - kv.shape[1]))  # [B, W + P, c]
        return kvp.unfold(1, self.K, self.Q).transpose(-1, -2)

    def scores(self, x: torch.Tensor, S: int) -> torch.Tensor:
        """Block scores [B, nb, Q, H, K] -> per-query [B, S, H, K]."""
        return x.reshape(x.shape[0], self.P, x.shape[3], self.K)[:, :S]

    def unblock(self, x: torch.Tensor, S: int, H: int) -> torch.Tensor:
        """[B, nb, Q * H, D] -> [B, S, H, D]."""
        return x.reshape(x.shape[0], self.P, H, x.shape[-1])[:, :S]


def scores_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b with fp32 accumulation and an fp32 result: [..., M, c] @ [..., c, N] -> fp32 [..., M, N].
    Below fp32 the operands are widened first (exact: bf16 and fp16 embed in fp32), which a fused
    vendor kernel does in its registers instead."""
    if a.dtype.itemsize >= 4:
        return (a @ b).float()
    return a.float() @ b.float()


def gather_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x: [B, N, C], index: [B, *rest] -> [B, *rest, C]."""
    B, C = x.shape[0], x.shape[-1]
    flat = index.reshape(B, -1, 1).expand(-1, -1, C)
    return x.gather(1, flat).view(*index.shape, C)


def reference(
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
    blk = WindowBlocks.build(doc, window)
    kb = blk.key_blocks(kv, window)
    local = scores_fp32(blk.query_blocks(q), kb.transpose(-1, -2)).view(B, blk.nb, blk.Q, H, blk.K) * scale
    parts = [blk.scores(local.masked_fill(~blk.ok[:, :, :, None, :], float("-inf")), S)]
    if compressed is not None and compressed.shape[1] > 0:
        if comp_idx is None:
            comp = scores_fp32(q.reshape(B, S * H, c), compressed.transpose(1, 2)).view(B, S, H, -1) * scale
        else:
            gathered = gather_rows(compressed, comp_idx)  # [B, S, k, c]
            comp = scores_fp32(q, gathered.transpose(-1, -2)) * scale  # [B, S, H, k]
        parts.append(comp.masked_fill(~comp_mask[:, :, None, :], float("-inf")))
    parts.append(sink.float().view(1, 1, H, 1).expand(B, S, H, 1))
    probs = torch.cat(parts, dim=-1).softmax(dim=-1).to(q.dtype)
    out = blk.unblock(blk.query_blocks(probs[..., : blk.K]) @ kb, S, H)
    if len(parts) == 3:
        p_comp = probs[..., blk.K : -1]
        if comp_idx is None:
            out = out + (p_comp.reshape(B, S * H, -1) @ compressed).view(B, S, H, c)
        else:
            out = out + p_comp @ gathered
    return out


class SparseAttention(torch.autograd.Function):
    """``reference`` with a hand-written backward (see the module docstring)."""

    @staticmethod
    def forward(ctx, q, kv, sink, compressed, comp_mask, comp_idx, doc, scale: float, window: int):
        B, S, H, c = q.shape
        blk = WindowBlocks.build(doc, window)
        kb = blk.key_blocks(kv, window)
        local = scores_fp32(blk.query_blocks(q), kb.transpose(-1, -2)).view(B, blk.nb, blk.Q, H, blk.K)
        local = local.mul_(scale).masked_fill_(~blk.ok[:, :, :, None, :], float("-inf"))
        parts = [blk.scores(local, S)]
        has_comp = compressed is not None and compressed.shape[1] > 0
        if has_comp:
            comp = entry_scores(q, compressed, comp_idx, fp32=True).mul_(scale)
            parts.append(comp.masked_fill_(~comp_mask[:, :, None, :], float("-inf")))
        parts.append(sink.float().view(1, 1, H, 1).expand(B, S, H, 1))
        probs = torch.cat(parts, dim=-1).softmax(dim=-1)
        p = probs.to(q.dtype)
        out = blk.unblock(blk.query_blocks(p[..., : blk.K]) @ kb, S, H)
        if has_comp:
            out = out + _values(p[..., blk.K : -1], compressed, comp_idx)
        ctx.save_for_backward(q, kv, compressed, comp_idx, doc, probs)
        ctx.scale, ctx.window, ctx.has_comp = scale, window, has_comp
        return out

    @staticmethod
    def backward(ctx, d_out):
        q, kv, compressed, comp_idx, doc, probs = ctx.saved_tensors
        scale, window = ctx.scale, ctx.window
        B, S, H, c = q.shape
        dtype = q.dtype
        blk = WindowBlocks.build(doc, window)
        kb = blk.key_blocks(kv, window)
        d_out = d_out.to(dtype)
        dob = blk.query_blocks(d_out)  # [B, nb, Q*H, c]
        K = blk.K
        # dP for every score, then the softmax backward: dS = P * (dP - sum(P * dP)); the sink has dP = 0
        dp_local = blk.unblock(dob @ kb.transpose(-1, -2), S, H).float()  # [B, S, H, K]
        p_local = probs[..., :K]
        rowsum = (p_local * dp_local).sum(-1, keepdim=True)
        if ctx.has_comp:
            p_comp = probs[..., K:-1]
            dp_comp = entry_scores(d_out, compressed, comp_idx).float()
            rowsum += (p_comp * dp_comp).sum(-1, keepdim=True)
            ds_comp = (p_comp * (dp_comp - rowsum)).to(dtype)
        ds_local = (p_local * (dp_local - rowsum)).to(dtype)
        d_sink = -(probs[..., -1:] * rowsum).sum(dim=(0, 1, 3)).to(probs.dtype)
        # queries: dq = scale * dS @ keys
        dsb = blk.query_blocks(ds_local)  # [B, nb, Q*H, K]
        dq = blk.unblock(dsb @ kb, S, H) * scale
        # window keys: each key block's gradient from its value use (P^T dO) plus its score use (scale dS^T Q)
        pb = blk.query_blocks(p_local.to(dtype)).flatten(0, 1)
        dkb = torch.bmm(pb.transpose(1, 2), dob.flatten(0, 1))
        dkb = dkb.baddbmm_(dsb.flatten(0, 1).transpose(1, 2), blk.query_blocks(q).flatten(0, 1), alpha=scale)
        dkb = dkb.view(B, blk.nb, K, c)
        dkvp = torch.ops.aten.unfold_backward(dkb.transpose(-1, -2), [B, window + blk.P, c], 1, K, blk.Q)
        dkv = dkvp[:, window : window + S]
        d_comp = None
        if ctx.has_comp:
            dq = dq + _values(ds_comp, compressed, comp_idx) * scale
            d_comp = _entry_grads(ds_comp * scale, p_comp.to(dtype), q, d_out, compressed, comp_idx)
        return dq, dkv, d_sink, d_comp, None, None, None, None, None


# The top-k (CSA) path works on query chunks: each chunk gathers its [B, T, k, c] entries, uses them and
# drops them, so the transient stays near CHUNK_BYTES instead of growing with S (a fresh allocation of
# hundreds of MB also costs more in page faults than the gather itself).
CHUNK_BYTES = 8 << 20


def query_chunks(S: int, per_query_bytes: int, budget: int = CHUNK_BYTES):
    """Query ranges [t0, t1) of at most budget // per_query_bytes queries (budget: CHUNK_BYTES)."""
    step = max(1, budget // max(1, per_query_bytes))
    return [(t0, min(S, t0 + step)) for t0 in range(0, S, step)]


def take_rows(compressed: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """compressed [B, N, c], idx [B, T, k] -> [B, T, k, c] by one row lookup."""
    B, N, c = compressed.shape
    flat = (idx + torch.arange(B, device=idx.device).view(B, 1, 1) * N).reshape(-1)
    return compressed.reshape(B * N, c).index_select(0, flat).view(*idx.shape, c)


def entry_scores(x: torch.Tensor, compressed: torch.Tensor, idx: torch.Tensor | None, fp32: bool = False) -> torch.Tensor:
    """x [B, S, H, c] against the entries [B, N, c] (all of them, or idx [B, S, k]) -> [B, S, H, N|k],
    in x's dtype, or accumulated and returned in fp32 with ``fp32`` (``scores_fp32``)."""
    B, S, H, c = x.shape
    mm = scores_fp32 if fp32 else torch.matmul
    if idx is None:
        return mm(x.reshape(B, S * H, c), compressed.transpose(1, 2)).view(B, S, H, -1)
    out = x.new_empty(B, S, H, idx.shape[-1], dtype=torch.float32 if fp32 else x.dtype)
    for t0, t1 in query_chunks(S, B * idx.shape[-1] * c * x.element_size()):
        entries = take_rows(compressed, idx[:, t0:t1]).flatten(0, 1)  # [B*T, k, c]
        out[:, t0:t1] = mm(x[:, t0:t1].flatten(0, 1), entries.transpose(1, 2)).unflatten(0, (B, -1))
    return out


def _values(p: torch.Tensor, compressed: torch.Tensor, idx: torch.Tensor | None) -> torch.Tensor:
    """p [B, S, H, N|k] weights the entries [B, N, c] (all of them, or idx [B, S, k]) -> [B, S, H, c]."""
    B, S, H, _ = p.shape
    c = compressed.shape[-1]
    if idx is None:
        return (p.reshape(B, S * H, -1) @ compressed).view(B, S, H, c)
    out = p.new_empty(B, S, H, c)
    for t0, t1 in query_chunks(S, B * idx.shape[-1] * c * p.element_size()):
        entries = take_rows(compressed, idx[:, t0:t1]).flatten(0, 1)  # [B*T, k, c]
        out[:, t0:t1] = torch.bmm(p[:, t0:t1].flatten(0, 1), entries).unflatten(0, (B, -1))
    return out


def _entry_grads(ds: torch.Tensor, p: torch.Tensor, q: torch.Tensor, d_out: torch.Tensor,
                 compressed: torch.Tensor, idx: torch.Tensor | None) -> torch.Tensor:
    """Gradient of the compressed entries [B, N, c] from both uses: sum over queries of
    ds^T q (scores) + p^T d_out (values), with ds, p [B, S, H, N|k] and q, d_out [B, S, H, c]: over
    all entries, a matmul and a fused multiply-add (no stacked [S, 2H, N] copy); for picked entries,
    one matmul per query chunk over the stacked 2H rows, scattered back through idx."""
    B, S, H, c = q.shape
    N = compressed.shape[1]
    if idx is None:
        grad = ds.reshape(B, S * H, N).transpose(1, 2) @ q.reshape(B, S * H, c)
        return grad.baddbmm_(p.reshape(B, S * H, N).transpose(1, 2), d_out.reshape(B, S * H, c))
    k = idx.shape[-1]
    grad = torch.zeros(B * N, c, dtype=q.dtype, device=q.device)
    offset = torch.arange(B, device=idx.device).view(B, 1, 1) * N
    for t0, t1 in query_chunks(S, B * k * c * q.element_size()):
        w = torch.cat((ds[:, t0:t1], p[:, t0:t1]), dim=2).flatten(0, 1)  # [B*T, 2H, k]
        per_pick = torch.bmm(w.transpose(1, 2), torch.cat((q[:, t0:t1], d_out[:, t0:t1]), dim=2).flatten(0, 1))
        grad.index_add_(0, (idx[:, t0:t1] + offset).reshape(-1), per_pick.reshape(-1, c))
    return grad.view(B, N, c)


# A top-k (CSA) call whose picks are at least this fraction of the entries runs as the dense (HCA) path
# over all N entries, the picks as its mask: at most 1 / fraction times the score FLOPs, as large
# matmuls instead of a gather and a small matmul per query (S = 512, N = 128, k = 64, 2 CPU threads:
# forward + backward 35 -> 20 ms; at k = N / 4 dense is still a little faster, at N / 8 twice slower).
# Memory stays linear in S: dense is only taken while N <= k / fraction, a constant.
DENSE_TOPK_FRACTION = 0.5


def picks_as_mask(comp_mask: torch.Tensor, comp_idx: torch.Tensor, n: int) -> torch.Tensor:
    """Top-k picks (comp_idx [B, S, k], comp_mask [B, S, k]) -> the dense mask [B, S, n] they select."""
    dense = torch.zeros(*comp_idx.shape[:2], n, dtype=torch.bool, device=comp_idx.device)
    return dense.scatter_(2, comp_idx, comp_mask)


def fused_backward(q, kv, sink, scale, window, doc, compressed=None, comp_mask=None, comp_idx=None):
    """``reference``'s signature and result, with ``SparseAttention``'s backward."""
    if comp_idx is not None and comp_idx.shape[-1] >= DENSE_TOPK_FRACTION * compressed.shape[1]:
        comp_mask, comp_idx = picks_as_mask(comp_mask, comp_idx, compressed.shape[1]), None
    return SparseAttention.apply(q, kv, sink, compressed, comp_mask, comp_idx, doc, scale, window)
