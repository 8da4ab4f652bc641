"""What a family knows of its checkpoints: the interface ``Architecture.checkpoint_names`` names, and what two
families share of it.

trex.checkpoint (naming, layouts, the reader, the writers) is the generic machinery: layouts ("official",
"hf"), detection, scales, encoding, grouping. It asks the family, through one :class:`CheckpointNames` per
architecture, only what differs between families:

    released_layout        the layout the released checkpoints (and so inference engines) use
    layout_refused(layout) why this architecture is not written in ``layout`` (a one-line message), or None
    trex_targets(name, layout, n_layers) -> [Target]
                           where checkpoint tensor ``name`` goes (none: not loaded); ``layout`` "official", "hf"
                           or "auto" (read as "hf"); ``n_layers``: the config's num_hidden_layers
    mtp_copy_of(name, layout, n_layers) -> str | None
                           the trex key a checkpoint tensor duplicates (the V3 family's MTP copies of the
                           embedding and head), None for any other
    written_name(key, layout, n_layers, expert=None) -> str
                           the name trex writes trex tensor ``key`` (routed expert ``expert`` of a stacked one)
                           as in ``layout``
    fused_experts(layout)  whether ``layout`` stores a layer's routed experts fused (w1 and w3 as one
                           ``gate_up_proj`` [E, 2I, d] under ``written_name(w1)``, w2 as one tensor) rather than
                           one tensor per expert
    mtp_copies(n_layers, j) -> [(name, trex key)]
                           the copies written after MTP module j's last tensor
    codec(key, quantize, scale_fmt) -> str
                           how trex tensor ``key`` is stored under ``quantize`` ("fp8", "fp8+fp4experts"; never
                           None), one of trex.checkpoint.layouts' codecs ("plain", "fp8", "fp8/32", "fp8/1x32",
                           "fp8/fp32", "fp8/fp32-ue8m0", "fp4"); ValueError for a mode the family is not released in
    keeps_fp32(key)        whether floating tensor ``key`` stays float32 in any save
    quantization_config(quantize) -> dict
                           config.json's ``quantization_config`` under ``quantize`` (never None)

trex names stack each layer's routed experts (``layers.3.ffn.experts.w1`` [E, I, d]); :data:`STACKED`,
:func:`expert_targets` and :func:`unstacked` are the part every family shares. No torch is needed here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

STACKED = re.compile(r"^(.*\.ffn\.experts)\.(w[123])$")  # a stacked routed-expert trex key
_EXPERT = re.compile(r"^(.*\.ffn\.experts)\.(\d+)\.(w[123])\.weight$")
_GATE_UP = re.compile(r"^(.*\.ffn\.experts)\.gate_up_proj$")


@dataclass(frozen=True)
class Target:
    """Where a checkpoint tensor goes: trex ``key``; ``expert`` J fills slice J of a stacked
    [E, ...] parameter; ``half`` h takes half h of dim 1 (the fused transformers gate/up)."""

    key: str
    expert: int | None = None
    half: int | None = None


def expert_targets(key: str, layout: str) -> list[Target]:
    """A trex-named ``key``'s targets: transformers' fused gate_up halves (w1, w3), one routed expert's
    slice of the stacked tensor, or the key itself."""
    m = _GATE_UP.match(key)
    if m and layout != "official":
        return [Target(f"{m.group(1)}.w1", half=0), Target(f"{m.group(1)}.w3", half=1)]
    m = _EXPERT.match(key)
    if m:
        return [Target(f"{m.group(1)}.{m.group(3)}", expert=int(m.group(2)))]
    return [Target(key)]


def unstacked(key: str, expert: int | None) -> str | None:
    """Routed expert ``expert``'s own name (``...ffn.experts.7.w1.weight``) of stacked trex key ``key``; None
    when ``key`` is not stacked. ValueError for a stacked key without ``expert``."""
    m = STACKED.match(key)
    if m is None:
        return None
    if expert is None:
        raise ValueError(f"{key} is a stacked expert tensor: name one expert")
    return f"{m.group(1)}.{expert}.{m.group(2)}.weight"


def strip_model(name: str, layout: str) -> str:
    """``name`` without transformers' ``model.`` prefix, unless ``layout`` is "official"."""
    return name[len("model."):] if layout != "official" and name.startswith("model.") else name


class CheckpointNames:
    """The checkpoint knowledge of one architecture (the contract: this module's docstring). The defaults are
    those of a family without MTP copies, written in every layout, one tensor per routed expert."""

    released_layout = "official"

    def layout_refused(self, layout: str) -> str | None:
        return None

    def mtp_copy_of(self, name: str, layout: str, n_layers: int | None) -> str | None:
        return None

    def fused_experts(self, layout: str) -> bool:
        return False

    def mtp_copies(self, n_layers: int, j: int) -> list[tuple[str, str]]:
        return []

    def trex_targets(self, name: str, layout: str, n_layers: int | None) -> list[Target]:
        raise NotImplementedError

    def written_name(self, key: str, layout: str, n_layers: int | None, expert: int | None = None) -> str:
        raise NotImplementedError

    def codec(self, key: str, quantize: str, scale_fmt: str | None) -> str:
        raise NotImplementedError

    def keeps_fp32(self, key: str) -> bool:
        raise NotImplementedError

    def quantization_config(self, quantize: str) -> dict:
        raise NotImplementedError
