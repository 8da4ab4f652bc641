"""What tensor parallelism splits in a DeepSeek-V4 model, as plain data (no torch): module-path patterns (``*`` one
path segment) -> styles; trex.parallel.tensor_parallel applies them (the styles are defined there).

Attention by heads: ``wq_a`` and ``q_norm`` (the query latent) replicated, ``wq_b`` by output rows (heads), the
per-head ``attn_sink`` with its heads. The one shared K = V head (``wkv``, ``kv_norm``: ``_kv``'s output) and the
compressed entries (the attention's ``compressor``) are replicated and enter the heads' region where every head
reads them. The grouped output projection: ``wo_a`` by its groups' rows (each rank holds ``o_groups`` / tp whole
groups of its heads), ``wo_b`` by input columns (a sum over the group). The lightning indexer (CSA layers) and
its compressor are replicated; its KL target and recall average the main attention over every head of the
group (``head_split``). mHC, the norms and the routers are replicated; the shared experts' input enters the region
once (at their ``input``), ``w1``, ``w3`` by rows inside it, ``w2`` by columns; routed experts replicated (expert
parallelism splits them). The embedding and the head by vocabulary rows. MTP blocks as the main blocks; their
``e_proj``, ``h_proj`` replicated.
"""

from __future__ import annotations

from trex.models.common.tp_plan import model_plan

_BLOCK = {
    "attn": ("heads:n_heads", "heads:o_groups", "heads_param:attn_sink", "enter:_kv"),
    "attn.compressor": ("enter:forward",),
    "attn.indexer": ("head_split",),
    "attn.wq_b": ("colwise",),
    "attn.wo_a": ("colwise_within",),
    "attn.wo_b": ("rowwise",),
}

TP_PLAN = model_plan(_BLOCK)
