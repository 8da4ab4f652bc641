"""What a saved checkpoint contains: trex tensors -> named, typed, possibly quantised outputs.

``plan_outputs`` turns trex tensors (from a model or from another checkpoint) into groups of
``PlannedTensor`` for one layout; each group is written together (a weight and its scale never
land in different shards) and each tensor is only computed when the writer reaches it.

Precision on disk is the architecture's (``Architecture.checkpoint_names``: which codec each tensor is stored in
under a ``quantize`` mode, which tensors stay float32, config.json's ``quantization_config``; e.g. DeepSeek-V4's
FP8 linears with 128x128 ue8m0 scales and FP4 experts, V4.1's 32x32 blocks, the V3 family's fp32 scales); the
codecs themselves are here: ``plain`` (cast to the save's dtype), FP8 e4m3 in blocks (``fp8`` 128x128 ue8m0,
``fp8/32`` 32x32, ``fp8/1x32`` a scale per row and 32 columns, ``fp8/fp32`` 128x128 with fp32 scales
(amax / 448), ``fp8/fp32-ue8m0`` the same rounded up to powers of two) and ``fp4`` (packed e2m1, 1x32 ue8m0
scales). Integer tensors (``tid2eid``) are written as they are.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

from trex.kernels import quantize as quant
from trex.checkpoint.naming import DEFAULT_ARCH, checkpoint_names, scale_name
from trex.checkpoint.safetensors_io import PlannedTensor
from trex.models.common.checkpoint_names import STACKED, CheckpointNames

QUANTIZE_MODES = (None, "fp8", "fp8+fp4experts")
SAVE_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}

_MTP = re.compile(r"^mtp\.(\d+)\.")  # MTP module j's tensors (the copies follow its last)
ScaleHint = Callable[[str], "torch.Tensor | None"]
# codec -> FP8 block (rows, cols) and scale format (DeepSeek-V4's ue8m0, DeepSeek-V3's fp32 amax / 448)
_FP8_CODECS = {"fp8": ((quant.FP8_BLOCK, quant.FP8_BLOCK), "ue8m0"), "fp8/32": ((32, 32), "ue8m0"),
               "fp8/1x32": ((1, 32), "ue8m0"), "fp8/fp32": ((quant.FP8_BLOCK, quant.FP8_BLOCK), "fp32"),
               "fp8/fp32-ue8m0": ((quant.FP8_BLOCK, quant.FP8_BLOCK), "fp32/ue8m0")}
_SCALE_DTYPES = {"ue8m0": torch.float8_e8m0fnu, "fp32": torch.float32, "fp32/ue8m0": torch.float32}
SCALE_FORMATS = ("ue8m0",)  # the config's quantization_config.scale_fmt values trex writes scales in


@dataclass(frozen=True)
class TrexTensor:
    """One trex tensor to save. ``get(expert)`` returns it whole (expert None) or expert J's
    slice of a stacked [E, ...] tensor, in any float dtype (it is cast on the way out)."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    get: Callable[[int | None], torch.Tensor]


def codec_for(key: str, quantize: str | None, arch: str = DEFAULT_ARCH, scale_fmt: str | None = None) -> str:
    """plain, fp8 (128x128 blocks), fp8/32 (32x32), fp8/1x32 (a scale per row and 32 columns), fp8/fp32
    (128x128 blocks, fp32 scales: DeepSeek-V3's), fp8/fp32-ue8m0 (the same, powers of two: the V3 family's
    under config ``scale_fmt`` "ue8m0") or fp4: how trex tensor ``key`` of architecture ``arch`` is stored
    under ``quantize`` (the architecture's ``CheckpointNames.codec``)."""
    if quantize not in QUANTIZE_MODES:
        raise ValueError(f"quantize must be one of {QUANTIZE_MODES}, got {quantize!r}")
    if quantize is None:
        return "plain"
    return checkpoint_names(arch).codec(key, quantize, scale_fmt)


def plan_outputs(tensors: list[TrexTensor], layout: str, dtype: torch.dtype, quantize: str | None,
                 arch: str = DEFAULT_ARCH, scale_hint: ScaleHint | None = None, n_layers: int | None = None,
                 scale_fmt: str | None = None) -> list[list[PlannedTensor]]:
    """Groups of tensors to write for ``layout`` ("official" or "hf"), in the order given, named and quantised
    as architecture ``arch`` says (``CheckpointNames``: a layout it is not written in is a ValueError; routed
    experts one tensor each or fused; after MTP module j's last tensor, the copies it stores, e.g. the V3
    family's embedding and head). ``n_layers``: the config's num_hidden_layers (the V3 family numbers its MTP
    layer after the last). ``scale_hint`` (a scale's name -> the tensor of that name in the checkpoint the model
    came from, or None): a quantised weight that this scale still represents exactly is written with it
    (``quantize_fp8_as``). ``scale_fmt``: the written config's ``quantization_config.scale_fmt`` (None or one of
    SCALE_FORMATS), which fresh scales follow."""
    names = checkpoint_names(arch)
    refused = names.layout_refused(layout)
    if refused:
        raise ValueError(refused)
    by_key = {t.key: t for t in tensors}
    last_of_mtp = {int(m.group(1)): i for i, t in enumerate(tensors) if (m := _MTP.match(t.key))}
    groups: list[list[PlannedTensor]] = []
    for i, t in enumerate(tensors):
        codec, out_dtype = codec_for(t.key, quantize, arch, scale_fmt), _plain_dtype(names, t, dtype)
        m = STACKED.match(t.key)
        if m and not names.fused_experts(layout):
            for j in range(t.shape[0]):
                groups.append(_encode(names.written_name(t.key, layout, n_layers, j), t.shape[1:], out_dtype, codec,
                                      layout, lambda t=t, j=j: t.get(j), scale_hint))
        elif m and m.group(2) == "w3":
            pass  # written inside gate_up_proj with w1
        else:
            shape, produce = t.shape, (lambda t=t: t.get(None))
            if m and m.group(2) == "w1":
                up = by_key[f"{m.group(1)}.w3"]
                shape = (t.shape[0], t.shape[1] + up.shape[1], *t.shape[2:])
                produce = lambda t=t, up=up: torch.cat((t.get(None), up.get(None)), dim=1)  # noqa: E731
            groups.append(_encode(names.written_name(t.key, layout, n_layers), shape, out_dtype, codec, layout,
                                  produce, scale_hint))
        m = _MTP.match(t.key)
        if m and last_of_mtp[int(m.group(1))] == i:  # MTP module j's last tensor: then its copies
            for name, key in names.mtp_copies(n_layers, int(m.group(1))):
                src = by_key[key]
                groups.append(_encode(name, src.shape, _plain_dtype(names, src, dtype), "plain", layout,
                                      lambda src=src: src.get(None)))
    return groups


def _plain_dtype(names: CheckpointNames, t: TrexTensor, dtype: torch.dtype) -> torch.dtype:
    if not t.dtype.is_floating_point:
        return t.dtype
    return torch.float32 if names.keeps_fp32(t.key) else dtype


def _encode(name: str, shape: tuple[int, ...], dtype: torch.dtype, codec: str, layout: str,
            produce: Callable[[], torch.Tensor], scale_hint: ScaleHint | None = None) -> list[PlannedTensor]:
    """The weight (cast, or quantised plus its scale) as planned tensors."""

    if codec == "plain":
        return [PlannedTensor(name, dtype, tuple(shape), lambda: produce().to(dtype))]
    *lead, rows, cols = shape
    if codec in _FP8_CODECS:
        block, scale_fmt = _FP8_CODECS[codec]
        qshape = (*lead, rows, cols), quant.fp8_scale_shape(tuple(shape), block)
        qdtype, sdtype = torch.float8_e4m3fn, _SCALE_DTYPES[scale_fmt]
        fresh, as_given = (lambda w: quant.quantize_fp8(w, block, scale_fmt),
                           lambda w, s: quant.quantize_fp8_as(w, s, block))
    else:
        qshape = (*lead, rows, quant.blocks(cols, 2)), (*lead, rows, quant.blocks(cols, quant.FP4_BLOCK))
        qdtype, sdtype, fresh, as_given = torch.int8, torch.float8_e8m0fnu, quant.quantize_fp4, quant.quantize_fp4_as

    def encode(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hinted = scale_hint(scale_name(name, layout)) if scale_hint is not None else None
        if (hinted is not None and tuple(hinted.shape) == qshape[1] and hinted.dtype == sdtype
                and (codec != "fp8/fp32-ue8m0" or quant.powers_of_two(hinted))):
            kept = as_given(w, hinted)
            if kept is not None:
                return kept
        return fresh(w)

    cache: dict[str, torch.Tensor] = {}

    def weight() -> torch.Tensor:
        q, cache["scale"] = encode(produce())
        return q

    def scale() -> torch.Tensor:
        return cache.pop("scale") if "scale" in cache else encode(produce())[1]

    return [PlannedTensor(name, qdtype, qshape[0], weight),
            PlannedTensor(scale_name(name, layout), sdtype, qshape[1], scale)]


def quantization_config(quantize: str | None, arch: str = DEFAULT_ARCH) -> dict | None:
    """The ``quantization_config`` of config.json for ``quantize`` (None when unquantised)."""
    return None if quantize is None else checkpoint_names(arch).quantization_config(quantize)
