"""What tensor parallelism splits in the parts every family shares, as plain data (no torch), and how a family's
plan is put together (a family's ``tp_plan`` module: ``Architecture.tp_plan``; trex.parallel.tensor_parallel
applies it and defines the styles).

The shared experts: ``w1``, ``w3`` by output rows, ``w2`` by input columns (a sum over the group). The embedding
and the head by vocabulary rows (the head with its vocabulary-parallel cross-entropy).
"""

from __future__ import annotations

SHARED_EXPERTS = {
    "ffn.shared_experts.w1": ("colwise",),
    "ffn.shared_experts.w3": ("colwise",),
    "ffn.shared_experts.w2": ("rowwise",),
}


def model_plan(block: dict[str, tuple[str, ...]]) -> dict[str, tuple[str, ...]]:
    """The whole model's plan from one block's (paths below a block -> styles, the shared experts added): the
    embedding and head by vocabulary, every main block (``layers.*``) and MTP block (``mtp.*``) as ``block``."""
    paths = {**block, **SHARED_EXPERTS}
    return {"embed": ("vocab",), "head": ("vocab",),
            **{f"{blocks}.*.{path}": styles for blocks in ("layers", "mtp") for path, styles in paths.items()}}
