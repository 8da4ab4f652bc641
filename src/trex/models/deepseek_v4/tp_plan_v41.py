"""What tensor parallelism splits in a DeepSeek-V4.1 model, as plain data (no torch): module-path patterns (``*`` one
path segment) -> styles; trex.parallel.tensor_parallel applies them (the styles are defined there).

Attention (CSA2) as V4's: ``wq_a`` and ``q_norm`` replicated, ``wq_b`` by output rows (heads), the per-head
``attn_sink`` with its heads; the one shared K = V head (``_kv``'s output) and a KV source's compressed entries
(its ``compressor``'s latents, which the later layers of its ratio read through ``Shared``) replicated, entering
the heads' region where every head reads them; the grouped ``wo_a`` by whole groups, ``wo_b`` by input columns.
The indexer and the candidate pool are replicated (they run without autograd on replicated inputs, and a top-k
needs every head's score). Engram is replicated over the group: its tables stay split by rows over every rank
(trex.parallel.engram, which counts a tp group's identical look-ups once), its ``wkv`` and gate whole on each
rank; under sequence parallelism it runs on the whole rows (gathered before it, this rank's rows kept after).
mHC, the norms, the routers and the routed experts replicated; the shared experts' input entering the region once
(at their ``input``), ``w1``, ``w3`` by rows, ``w2`` by columns; the embedding and the head by vocabulary rows.
The DSpark drafter's taps are the residual streams (gathered whole under sequence parallelism); the drafter reads
the head and embedding whole (trex.train.drafters.dspark).
"""

from __future__ import annotations

from trex.models.common.tp_plan import model_plan

_BLOCK = {
    "attn": ("heads:n_heads", "heads:o_groups", "heads_param:attn_sink", "enter:_kv"),
    "attn.compressor": ("enter:forward",),
    "attn.wq_b": ("colwise",),
    "attn.wo_a": ("colwise_within",),
    "attn.wo_b": ("rowwise",),
    "engram": ("rows_whole",),  # sequence parallelism: Engram reads the whole rows (its hashes are the whole rows')
}

TP_PLAN = model_plan(_BLOCK)
