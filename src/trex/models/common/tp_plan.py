"""What tensor parallelism splits in the parts every family shares, as plain data (no torch), and how a family's
plan is put together (a family's ``tp_plan`` module: ``Architecture.tp_plan``; trex.parallel.tensor_parallel
applies it and defines the styles).

A SwiGLU MLP (trex.models.common.moe.SharedExpert: the shared experts, V3's dense FFN): its input enters the split
region once, at its parameter-free ``input`` (one backward sum of the input's gradient for ``w1`` and ``w3``
together), ``w1``, ``w3`` by output rows inside it, ``w2`` by input columns (a sum over the group). The embedding
and the head by vocabulary rows (the head with its vocabulary-parallel cross-entropy). Sequence parallelism's
boundaries (``SEQUENCE_PARALLEL``), the same in every family's block.
"""

from __future__ import annotations


def swiglu(path: str) -> dict[str, tuple[str, ...]]:
    """The plan of the SharedExpert at ``path`` (below a block)."""
    return {f"{path}.input": ("enter:forward",), f"{path}.w1": ("colwise_within",),
            f"{path}.w3": ("colwise_within",), f"{path}.w2": ("rowwise",)}


SHARED_EXPERTS = swiglu("ffn.shared_experts")

# Sequence parallelism (applied with ``[parallel] sequence_parallel``): the residual stream between the split regions
# holds this rank's rows; the norm before each region gathers the whole rows the region reads, the region's output
# (its row-parallel linears' partial sums; the routed experts', whole on every rank, made a partial) is
# reduce-scattered back to this rank's rows.
SEQUENCE_PARALLEL = {"attn_norm": ("rows_gather",), "ffn_norm": ("rows_gather",), "attn": ("rows_reduce",),
                     "ffn": ("rows_reduce",), "ffn.experts": ("rows_partial",)}


def merged(*plans: dict[str, tuple[str, ...]]) -> dict[str, tuple[str, ...]]:
    """The plans' styles together, a path's styles from every plan that names it, in order."""
    out: dict[str, tuple[str, ...]] = {}
    for plan in plans:
        for path, styles in plan.items():
            out[path] = out.get(path, ()) + styles
    return out


def model_plan(block: dict[str, tuple[str, ...]]) -> dict[str, tuple[str, ...]]:
    """The whole model's plan from one block's (paths below a block -> styles, the shared experts and sequence
    parallelism added): the embedding and head by vocabulary, every main block (``layers.*``) and MTP block
    (``mtp.*``) as ``block``."""
    paths = merged(block, SHARED_EXPERTS, SEQUENCE_PARALLEL)
    return {"embed": ("vocab",), "head": ("vocab",),
            **{f"{blocks}.*.{path}": styles for blocks in ("layers", "mtp") for path, styles in paths.items()}}
