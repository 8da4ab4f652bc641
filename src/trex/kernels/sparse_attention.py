"""DeepSeek-V4 sparse attention: one softmax (with a per-head sink) over the sliding window and the
compressed entries a query may see.

Two implementations with the same signature, registered as the op ``sparse_attention``:

* ``reference``: plain PyTorch ops, differentiated by autograd. The test oracle.
* ``fused_backward``: the same forward, with a hand-written backward (``SparseAttention``). It saves
  q, kv, the compressed entries, the top-k indices and the probabilities only, re-gathers the top-k
  entries in backward instead of keeping the [B, S, k, c] copy, and computes each key's gradient
  from both of its uses (score and value) in one matmul. Vendor-neutral; the default everywhere
  until a vendor registers a fused kernel.

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
    local = (blk.query_blocks(q) @ kb.transpose(-1, -2)).view(B, blk.nb, blk.Q, H, blk.K) * scale
    parts = [blk.scores(local.masked_fill(~blk.ok[:, :, :, None, :], float("-inf")), S)]
    if compressed is not None and compressed.shape[1] > 0:
        if comp_idx is None:
            comp = (q.reshape(B, S * H, c) @ compressed.transpose(1, 2)).view(B, S, H, -1) * scale
        else:
            gathered = gather_rows(compressed, comp_idx)  # [B, S, k, c]
            comp = (q @ gathered.transpose(-1, -2)) * scale  # [B, S, H, k]
        parts.append(comp.masked_fill(~comp_mask[:, :, None, :], float("-inf")))
    parts.append(sink.float().view(1, 1, H, 1).expand(B, S, H, 1))
    probs = torch.cat([p.float() for p in parts], dim=-1).softmax(dim=-1).to(q.dtype)
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
        local = (blk.query_blocks(q) @ kb.transpose(-1, -2)).view(B, blk.nb, blk.Q, H, blk.K)
        local = local.float().mul_(scale).masked_fill_(~blk.ok[:, :, :, None, :], float("-inf"))
        parts = [blk.scores(local, S)]
        entries = None
        if compressed is not None and compressed.shape[1] > 0:
            entries = compressed if comp_idx is None else _take(compressed, comp_idx)
            comp = _scores(q, entries, comp_idx is None).float().mul_(scale)
            parts.append(comp.masked_fill_(~comp_mask[:, :, None, :], float("-inf")))
        parts.append(sink.float().view(1, 1, H, 1).expand(B, S, H, 1))
        probs = torch.cat(parts, dim=-1).softmax(dim=-1)
        p = probs.to(q.dtype)
        out = blk.unblock(blk.query_blocks(p[..., : blk.K]) @ kb, S, H)
        if entries is not None:
            out = out + _values(p[..., blk.K : -1], entries, comp_idx is None)
        ctx.save_for_backward(q, kv, compressed, comp_idx, doc, probs)
        ctx.scale, ctx.window, ctx.has_comp = scale, window, entries is not None
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
        entries = None
        if ctx.has_comp:
            dense = comp_idx is None
            entries = compressed if dense else _take(compressed, comp_idx)
            p_comp = probs[..., K:-1]
            dp_comp = _scores(d_out, entries, dense).float()
            rowsum += (p_comp * dp_comp).sum(-1, keepdim=True)
            ds_comp = (p_comp * (dp_comp - rowsum)).to(dtype)
        ds_local = (p_local * (dp_local - rowsum)).to(dtype)
        d_sink = -(probs[..., -1:] * rowsum).sum(dim=(0, 1, 3)).to(probs.dtype)
        # queries: dq = scale * dS @ keys
        dsb = blk.query_blocks(ds_local)  # [B, nb, Q*H, K]
        dq = blk.unblock(dsb @ kb, S, H) * scale
        # window keys: each key block's gradient from its score and value uses in one matmul
        pb = blk.query_blocks(p_local.to(dtype))
        dkb = torch.cat((dsb * scale, pb), dim=2).transpose(-1, -2) @ torch.cat((blk.query_blocks(q), dob), dim=2)
        dkvp = torch.ops.aten.unfold_backward(dkb.transpose(-1, -2), [B, window + blk.P, c], 1, K, blk.Q)
        dkv = dkvp[:, window : window + S]
        d_comp = None
        if entries is not None:
            dq = dq + _values(ds_comp, entries, dense) * scale
            d_comp = _entry_grads(torch.cat((ds_comp * scale, p_comp.to(dtype)), dim=2),
                                  torch.cat((q, d_out), dim=2), compressed, comp_idx)
        return dq, dkv, d_sink, d_comp, None, None, None, None, None


def _take(compressed: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """compressed [B, N, c], idx [B, S, k] -> [B, S, k, c] by one row lookup."""
    B, N, c = compressed.shape
    flat = (idx + torch.arange(B, device=idx.device).view(B, 1, 1) * N).reshape(-1)
    return compressed.reshape(B * N, c).index_select(0, flat).view(*idx.shape, c)


def _scores(x: torch.Tensor, entries: torch.Tensor, dense: bool) -> torch.Tensor:
    """x [B, S, H, c] against entries (dense [B, N, c] or gathered [B, S, k, c]) -> [B, S, H, N|k]."""
    B, S, H, c = x.shape
    if dense:
        return (x.reshape(B, S * H, c) @ entries.transpose(1, 2)).view(B, S, H, -1)
    return torch.bmm(x.reshape(B * S, H, c), entries.flatten(0, 1).transpose(1, 2)).view(B, S, H, -1)


def _values(p: torch.Tensor, entries: torch.Tensor, dense: bool) -> torch.Tensor:
    """p [B, S, H, N|k] weights entries -> [B, S, H, c]."""
    B, S, H, _ = p.shape
    if dense:
        return (p.reshape(B, S * H, -1) @ entries).view(B, S, H, -1)
    return torch.bmm(p.reshape(B * S, H, -1), entries.flatten(0, 1)).view(B, S, H, -1)


def _entry_grads(weights: torch.Tensor, inputs: torch.Tensor, compressed: torch.Tensor,
                 idx: torch.Tensor | None) -> torch.Tensor:
    """Gradient of the compressed entries: sum over queries of weights^T @ inputs.

    weights [B, S, 2H, N|k] (score gradients and probabilities), inputs [B, S, 2H, c] (queries and
    output gradients); scattered back to [B, N, c] through ``idx`` when the entries were gathered."""
    B, S, H2, c = inputs.shape
    N = compressed.shape[1]
    if idx is None:
        return weights.reshape(B, S * H2, N).transpose(1, 2) @ inputs.reshape(B, S * H2, c)
    per_pick = torch.bmm(weights.reshape(B * S, H2, -1).transpose(1, 2), inputs.reshape(B * S, H2, c))  # [B*S, k, c]
    flat = (idx + torch.arange(B, device=idx.device).view(B, 1, 1) * N).reshape(-1)
    grad = torch.zeros(B * N, c, dtype=per_pick.dtype, device=per_pick.device)
    return grad.index_add_(0, flat, per_pick.reshape(-1, c)).view(B, N, c)


def fused_backward(q, kv, sink, scale, window, doc, compressed=None, comp_mask=None, comp_idx=None):
    """``reference``'s signature and result, with ``SparseAttention``'s backward."""
    return SparseAttention.apply(q, kv, sink, compressed, comp_mask, comp_idx, doc, scale, window)
