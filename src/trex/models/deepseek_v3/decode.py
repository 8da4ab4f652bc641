"""Generation with DeepSeek-V3: the MLA decode cache and one decode step of each attention layer.

``model(ids, doc_ids=docs, cache=V3DecodeCache(n))`` runs the training forward over the prompts (the
prefill); each ``MLA.forward`` hands its layer's normed latent and rotated k_pe to ``cache.prefill``.
Each later call feeds one token per row, [B, 1], and ``MLA.forward`` hands it to ``cache.step``
(:func:`mla_step`).

What is cached is what DeepSeek's official code (``attn_impl = "absorb"``), vLLM and SGLang cache: per
token and layer the normed latent (kv_lora_rank) and the rotated k_pe (qk_rope_head_dim), 512 + 64
numbers at the released shapes, in the activations' dtype. The step attends in the absorbed MQA form:
``wkv_b``'s key rows fold into the query (q_nope W_uk: a query in latent space, scored against the
cached latents, plus q_pe against the cached k_pe), the probabilities sum the latents, and ``wkv_b``'s
value rows lift that sum to each head's value. Scores and softmax in fp32 (as the training core); the
same numbers as the MHA form up to rounding. With ``QuantSim.activations`` the MHA form puts the latent
through FP8 before ``wkv_b`` and the absorbed form does not (as DeepSeek's two ``attn_impl``s differ).

Shapes are static: the buffers hold the prompt batch's width plus ``max_new_tokens`` slots from the
prefill on; a step writes its slot and attends to every slot under a mask. Everything visible belongs
to the LAST document of each row (left padding is an earlier document). The MTP layer takes no part in
decoding. tests/test_rollout_cache.py checks it against the whole row's forward, and
tests/test_official_v3.py against the official ``Transformer.forward(tokens, start_pos)`` loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from trex.kernels.sparse_attention import scores_fp32
from trex.models.common.context import DecodeSteps, SequenceContext
from trex.models.deepseek_v3.attention import MLA


@dataclass
class LatentCache:
    """One MLA layer's cache for B rows: latent [B, N, kv_lora_rank] normed, k_pe [B, N, rope] rotated;
    N = prompt width + max_new_tokens slots, the prompt's first."""

    latent: torch.Tensor
    k_pe: torch.Tensor


class V3DecodeCache(DecodeSteps):
    """Incremental generation state of a DeepSeek-V3 model for at most ``max_new_tokens`` decode steps
    (``pos``, ``steps``, ``layers`` as DecodeSteps'). After the prefill: ``width`` the prompt batch's S
    (a python int, decode step k writes slot width + k - 1) and ``start`` [B] each row's first slot of
    its last document."""

    def __init__(self, max_new_tokens: int):
        super().__init__(max_new_tokens)
        self.width = 0
        self.start: torch.Tensor | None = None

    def prefill(self, attn: MLA, latent: torch.Tensor, k_pe: torch.Tensor, ctx: SequenceContext) -> None:
        """Keep ``attn``'s latents after the prefill (``MLA.forward`` calls it): latent [B, S, kv_lora_rank]
        normed, k_pe [B, S, rope] rotated."""
        B, S, _ = latent.shape
        self.width = S
        self.start = (ctx.doc != ctx.doc[:, -1:]).sum(dim=1)  # the last document is each row's tail
        room = (0, 0, 0, self.max_new_tokens)
        self.layers[attn] = LatentCache(F.pad(latent, room), F.pad(k_pe, room))

    def step(self, attn: MLA, x: torch.Tensor, ctx: SequenceContext) -> torch.Tensor:
        """``attn``'s output for one token per row, x [B, 1, d] (``MLA.forward`` calls it)."""
        return mla_step(attn, x, ctx)


def mla_step(attn: MLA, x: torch.Tensor, ctx: SequenceContext) -> torch.Tensor:
    """One token per row, x [B, 1, d] (normed) at positions ctx.pos, against and into ctx.cache -> [B, 1, d]."""
    cache, H, nope = ctx.cache, attn.n_heads, attn.nope
    state = cache.layers[attn]
    cos, sin = attn.rope_table(ctx)
    q_nope, q_pe = attn.query(x, cos, sin)[:, 0].split([nope, attn.rope], dim=-1)  # [B, H, nope], [B, H, rope]
    latent, k_pe = attn.latent_kv(x, cos, sin)
    slot = cache.width + cache.steps - 1
    state.latent[:, slot] = latent[:, 0]
    state.k_pe[:, slot] = k_pe[:, 0]
    wkv_b = attn.wkv_b.quantized_weight().view(H, nope + attn.v_dim, attn.kv_lora)  # per head [W_uk | W_uv]
    q_latent = torch.einsum("bhd,hdc->bhc", q_nope, wkv_b[:, :nope])  # the key rows absorbed into the query
    scores = (scores_fp32(q_latent, state.latent.transpose(1, 2))
              + scores_fp32(q_pe, state.k_pe.transpose(1, 2))) * attn.softmax_scale  # [B, H, N] fp32
    slots = torch.arange(state.latent.shape[1], device=x.device)
    visible = (slots >= cache.start[:, None]) & (slots <= slot)  # the last document, up to this token
    probs = scores.masked_fill(~visible[:, None], float("-inf")).softmax(dim=-1).to(x.dtype)
    o = torch.einsum("bhc,hdc->bhd", probs @ state.latent, wkv_b[:, nope:])  # the value rows lift the latent sum
    return attn.wo(o.flatten(1)[:, None])
