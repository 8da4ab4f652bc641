"""Causal attention within packed documents over full-length keys (DeepSeek-V3's MLA in its MHA form for
training), registered as the op ``dense_attention``:

* ``reference``: plain PyTorch over [B, H, S, S] scores: scores q.k accumulated and kept in fp32
  (``scores_fp32``), the document-causal mask, fp32 softmax, the probabilities cast to v's dtype (as
  DeepSeek's ``softmax(dtype=float32).type_as(x)``), then the value sum. Memory quadratic in S. The test
  oracle, and what ``TREX_KERNELS=dense_attention=reference`` runs.
* ``sdpa``: ``F.scaled_dot_product_attention`` with the document-causal boolean mask and the softmax scale
  (YaRN's mscale included) as its ``scale``: PyTorch's fused kernels (online softmax, fp32 accumulation,
  a logsumexp saved for backward instead of the probabilities), no [B, H, S, S] fp32 scores. PyTorch picks
  the device's kernel; on an accelerator its fused kernels take a mask and MLA's values narrower than its
  query/key heads (V3: 128 vs 192) as they are. Vendor-neutral: the default on every device type.
* ``sdpa_padded_values``: ``sdpa`` with v zero-padded to the query/key head dim and the padding sliced off
  the output (exact: the extra columns are zeros and their gradient is dropped). PyTorch's CPU fused
  (flash) kernel takes a mask but wants one head dim for q, k and v; with narrower values it falls back to
  the math path, which materialises the scores. The CPU default. Elsewhere padding only costs: measured on
  one accelerator (S = 4096, 16 heads, 192/128, forward + backward), bf16 9.7 ms and 449 MiB padded vs
  5.7 ms and 321 MiB not, fp32 46 vs 37 ms.

Shapes: q [B, Sq, H, dk]; k [B, S, H, dk]; v [B, S, H, dv]; doc [B, S] the keys' segment ids (packed
documents; a left-padding run is a segment of its own, so every query sees at least itself). The queries are
the keys' rows ``q_start`` .. ``q_start + Sq - 1`` (context parallelism: a rank's shard of queries against the
whole rows' keys; Sq = S and q_start 0 otherwise). Returns [B, Sq, H, dv] in v's dtype. (DeepSeek-V3.2's MLA
over its indexer's picks is the op ``sparse_mla``.)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from trex.kernels.sparse_attention import scores_fp32


def document_causal_mask(doc: torch.Tensor, q_start: int = 0, q_len: int | None = None) -> torch.Tensor:
    """doc [B, S] segment ids -> [B, 1, Sq, S] bool: query row t (of rows q_start .. q_start + Sq - 1, Sq =
    ``q_len`` or S) sees key s <= t of its own document."""
    S = doc.shape[1]
    Sq = S if q_len is None else q_len
    causal = torch.ones(Sq, S, dtype=torch.bool, device=doc.device).tril(q_start)
    q_doc = doc[:, q_start:q_start + Sq]
    visible = causal & (q_doc[:, :, None] == doc[:, None, :])
    return visible[:, None]


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, doc: torch.Tensor,
              q_start: int = 0) -> torch.Tensor:
    """fp32 [B, H, Sq, S] scores and softmax, the probabilities in v's dtype (see the module docstring)."""
    visible = document_causal_mask(doc, q_start, q.shape[1])
    scores = scores_fp32(q.transpose(1, 2), k.permute(0, 2, 3, 1)) * scale  # [B, H, Sq, S]
    scores = scores.masked_fill(~visible, float("-inf"))
    p = scores.softmax(dim=-1).to(v.dtype)
    return (p @ v.transpose(1, 2)).transpose(1, 2)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, doc: torch.Tensor,
         q_start: int = 0) -> torch.Tensor:
    """``reference``'s contract through ``F.scaled_dot_product_attention`` (see the module docstring)."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=document_causal_mask(doc, q_start, q.shape[1]), scale=scale)
    return out.transpose(1, 2)


def sdpa_padded_values(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, doc: torch.Tensor,
                       q_start: int = 0) -> torch.Tensor:
    """``sdpa`` with v zero-padded to q's head dim, the padding sliced off (see the module docstring)."""
    dv = v.shape[-1]
    pad = q.shape[-1] - dv
    if pad <= 0:
        return sdpa(q, k, v, scale, doc, q_start)
    return sdpa(q, k, F.pad(v, (0, pad)), scale, doc, q_start)[..., :dv]
