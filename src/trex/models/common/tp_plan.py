"""What tensor parallelism splits in the parts every family shares, as plain data (no torch), and how a family's
plan is put together (a family's ``tp_plan`` module: ``Architecture.tp_plan``; trex.parallel.tensor_parallel
applies it and defines the styles).

A SwiGLU MLP (trex.models.common.moe.SharedExpert: the shared experts, V3's dense FFN): its input enters the split
region once, at its parameter-free ``input`` (one backward sum of the input's gradient for ``w1`` and ``w3``
together), ``w1``, ``w3`` by output rows inside it, ``w2`` by input columns (a sum over the group). The embedding
and the head by vocabulary rows (the head with its vocabulary-parallel cross-entropy).
"""

from __future__ import annotations


def swiglu(path: str) -> dict[str, tuple[str, ...]]:
    """The plan of the SharedExpert at ``path`` (below a block)."""
    return {f"{path}.input": ("enter:forward",), f"{path}.w1": ("colwise_within",),
            f"{path}.w3": ("colwise_within",), f"{path}.w2": ("rowwise",)}


SHARED_EXPERTS = swiglu("ffn.shared_experts")


def model_plan(block: dict[str, tuple[str, ...]]) -> dict[str, tuple[str, ...]]:
    """The whole model's plan from one block's (paths below a block -> styles, the shared experts added): the
    embedding and head by vocabulary, every main block (``layers.*``) and MTP block (``mtp.*``) as ``block``."""
    paths = {**block, **SHARED_EXPERTS}
    return {"embed": ("vocab",), "head": ("vocab",),
            **{f"{blocks}.*.{path}": styles for blocks in ("layers", "mtp") for path, styles in paths.items()}}
