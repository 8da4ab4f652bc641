"""Checkpoint tensor names <-> trex names: the generic part, over each architecture's own tables.

A checkpoint is in one of two layouts (``LAYOUTS``): "official" (DeepSeek's own names, as DeepSeek-V4 and V4.1
are released) or "hf" (Hugging Face / transformers names under a ``model.`` prefix, as the V3 family is
released); ``detect_layout`` tells them apart, and "auto" reads as "hf". What each name means is the
architecture's: its family package holds the tables (``Architecture.checkpoint_names``, a
``trex.models.common.checkpoint_names.CheckpointNames``: e.g. ``trex.models.deepseek_v4.checkpoint_names``,
``trex.models.deepseek_v3.checkpoint_names``), which the functions here reach by the config's ``architecture``
(``arch``; DeepSeek-V4 when a caller names none). trex names stack each layer's routed experts
(``layers.3.ffn.experts.w1`` [E, I, d]); a checkpoint may store them one tensor per expert or fused (``Target``
says which slice a tensor fills).

FP8/FP4 scales sit next to their weight: ``X.scale`` (official) or ``X.weight_scale_inv`` (hf; ``X_scale_inv``
for a fused expert tensor ``X``): ``scale_name``, ``scale_candidates``.
"""

from __future__ import annotations

import torch

from trex.models.common.checkpoint_names import CheckpointNames, Target
from trex.models.registry import ARCHITECTURES

__all__ = ["DEFAULT_ARCH", "LAYOUTS", "Target", "checkpoint_names", "detect_layout", "hf_name", "mtp_copy_of",
           "official_name", "scale_candidates", "scale_name", "to_trex", "trex_targets", "written_name"]

LAYOUTS = ("official", "hf")
DEFAULT_ARCH = "deepseek_v4"  # the architecture of a caller that names none


def checkpoint_names(arch: str) -> CheckpointNames:
    """What architecture ``arch`` knows of its checkpoints (its ``Architecture.checkpoint_names``)."""
    return ARCHITECTURES[arch].load("checkpoint_names")


def detect_layout(names: list[str]) -> str:
    """``hf`` if any name has the transformers ``model.`` / ``lm_head.`` prefix, else ``official``."""
    return "hf" if any(n.startswith(("model.", "lm_head.")) for n in names) else "official"


def trex_targets(name: str, layout: str = "auto", arch: str = DEFAULT_ARCH, n_layers: int | None = None
                 ) -> list[Target]:
    """Where checkpoint tensor ``name`` goes (none: a tensor trex does not load). ``layout`` "official"
    applies only the official renames; "hf" and "auto" also strip ``model.`` and undo the transformers
    module names. ``arch``: the config's architecture (DeepSeek-V3's family has its own names and needs
    ``n_layers``, its num_hidden_layers, to tell the MTP layer apart)."""
    return checkpoint_names(arch).trex_targets(name, layout, n_layers)


def mtp_copy_of(name: str, layout: str = "auto", arch: str = DEFAULT_ARCH, n_layers: int | None = None
                ) -> str | None:
    """The trex key (``embed.weight`` or ``head.weight``) that checkpoint tensor ``name`` duplicates: a
    DeepSeek-V3 family MTP layer's ``embed_tokens`` / ``shared_head.head``; None for any other tensor."""
    return checkpoint_names(arch).mtp_copy_of(name, layout, n_layers)


def to_trex(name: str, tensor: torch.Tensor, layout: str = "auto", arch: str = DEFAULT_ARCH,
            n_layers: int | None = None) -> list[tuple[str, int | None, torch.Tensor]]:
    """One checkpoint tensor -> [(trex name, expert index or None, tensor)] (none: not loaded).

    An expert index J means the tensor fills slice J of a stacked [E, ...] expert parameter.
    The fused transformers gate/up tensor yields two entries (w1 and w3, all experts).
    """
    out = []
    for t in trex_targets(name, layout, arch, n_layers):
        value = tensor
        if t.half is not None:
            inter = tensor.shape[1] // 2
            value = tensor[:, t.half * inter:(t.half + 1) * inter]
        out.append((t.key, t.expert, value))
    return out


def written_name(key: str, layout: str, arch: str = DEFAULT_ARCH, n_layers: int | None = None,
                 expert: int | None = None) -> str:
    """The name trex writes trex tensor ``key`` (routed expert ``expert`` of a stacked one, where ``layout``
    stores experts one by one) as, in ``layout``, for architecture ``arch``."""
    return checkpoint_names(arch).written_name(key, layout, n_layers, expert)


def official_name(key: str, expert: int | None = None) -> str:
    """DeepSeek-V4's trex name -> official name; a stacked expert key needs the expert index."""
    return written_name(key, "official", expert=expert)


def hf_name(key: str) -> str:
    """DeepSeek-V4's trex name -> transformers module name. Stacked experts map to the fused tensors: w1 and
    w3 both to ``gate_up_proj`` (w1 rows first), w2 to ``down_proj``."""
    return written_name(key, "hf")


def scale_name(weight_name: str, layout: str) -> str:
    """The name of the block scale of ``weight_name`` in ``layout``."""
    if layout == "official":
        return weight_name[: -len(".weight")] + ".scale" if weight_name.endswith(".weight") else weight_name + ".scale"
    return weight_name + "_scale_inv"


def scale_candidates(weight_name: str) -> tuple[str, ...]:
    """Names under which any layout stores the block scale of ``weight_name``."""
    return tuple(dict.fromkeys((scale_name(weight_name, "official"), scale_name(weight_name, "hf"))))
