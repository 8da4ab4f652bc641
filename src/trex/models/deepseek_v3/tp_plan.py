"""What tensor parallelism splits in a DeepSeek-V3-family model (V3, R1, V3.1, V3.2, Kimi-K2, Moonlight), as plain
data (no torch): module-path patterns (``*`` one path segment) -> styles; trex.parallel.tensor_parallel applies
them (the styles are defined there).

Attention (MLA) by heads: the low-rank down projections (``wq_a``, ``wkv_a``) and their norms are replicated,
the up projections (``wq_b``, or Moonlight's ``wq``; ``wkv_b``) split by output rows, i.e. by heads, the
output ``wo`` by input columns (a sum over the group). The normed KV latent and the rotated k_pe that
``latent_kv`` returns enter the heads' region there (each head reads the whole latent: the core's absorbed
forms, V3.2's sparse MLA and context parallelism's ``latent_attention``, read ``wkv_b``'s weight directly), so
``wkv_b`` takes its input already inside it. Each rank's attention sees ``n_heads`` / tp heads. V3.2's
lightning indexer is replicated: its top-k needs the score summed over all its heads, and it reads only
replicated inputs (x and the query latent, detached).

The dense FFN (the first ``first_k_dense_replace`` layers) and the shared experts (both SharedExpert): the input
enters the split region once, at the parameter-free ``input``, ``w1``, ``w3`` by output rows inside it, ``w2`` by
input columns. The router and the routed experts are replicated over the group (expert
parallelism splits them over ``ep``). The embedding and the head by vocabulary rows (the head with its
vocabulary-parallel cross-entropy). MTP modules as the main blocks; their ``eh_proj`` replicated.
"""

from __future__ import annotations

from trex.models.common.tp_plan import model_plan, swiglu

_BLOCK = {
    "attn": ("heads:n_heads", "enter:latent_kv"),
    "attn.wq": ("colwise",),  # Moonlight: no query latent
    "attn.wq_b": ("colwise",),
    "attn.wkv_b": ("colwise_within",),
    "attn.wo": ("rowwise",),
    **swiglu("ffn"),  # the dense layers' FFN (a MoE layer's ffn has no input, w1, w3 or w2 of its own)
}

TP_PLAN = model_plan(_BLOCK)
