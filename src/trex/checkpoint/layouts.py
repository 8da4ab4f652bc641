"""What a saved checkpoint contains: trex tensors -> named, typed, possibly quantised outputs.

``plan_outputs`` turns trex tensors (from a model or from another checkpoint) into groups of
``PlannedTensor`` for one layout; each group is written together (a weight and its scale never
land in different shards) and each tensor is only computed when the writer reaches it.

Precision on disk follows the released checkpoints (reference §4.2/§4.3): with ``quantize``,
the attention, indexer-query, shared-expert and MTP projections are FP8 with 128x128 ue8m0
scales; routed experts are FP8 (``"fp8"``) or packed FP4 with 1x32 scales
(``"fp8+fp4experts"``). Norms, router, compressor and indexer-compressor projections,
``weights_proj``, embedding, head, mHC, sinks, ``ape`` and the gate bias are never quantised.
mHC, ``ape``, sinks and the gate bias stay float32 even in a bf16 save; integer tensors
(``tid2eid``) are written as they are.

DeepSeek-V4.1 (``arch="deepseek_v41"``) as released: the same linears (``wo_a`` included) and Engram's
``wkv`` in FP8 with 32x32 blocks, routed experts in FP4, Engram's tables in FP8 with one scale per row
and 32 columns; the compressor, the indexer's ``wk`` and ``weights_proj`` stay unquantised.

The DeepSeek-V3 family (``arch="deepseek_v3"``: V3, R1, V3.1, V3.2, Kimi-K2) as released (reference §3):
``quantize="fp8"`` stores every attention projection (V3.2's indexer ``wq_b`` and ``wk`` too), the dense
MLPs, shared and routed experts, in the main layers and the MTP layer, as e4m3 with one fp32
``weight_scale_inv`` per 128x128 block (amax / 448); the embedding, head, norms, router ``gate.weight``,
``eh_proj``, ``weights_proj`` stay in ``dtype`` and ``e_score_correction_bias`` in fp32. A checkpoint whose config
says ``scale_fmt: "ue8m0"`` (DeepSeek-V3.1, V3.2) keeps fp32 scales that are powers of two, rounded up
(``quantize_fp8``'s "fp32/ue8m0"), so that an engine which trusts the field reads the weights that were written.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

from trex.kernels import quantize as quant
from trex.checkpoint.naming import hf_name, official_name, scale_name, v3_hf_name, v3_mtp_copies
from trex.checkpoint.safetensors_io import PlannedTensor

QUANTIZE_MODES = (None, "fp8", "fp8+fp4experts")
SAVE_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}

_FP8_LINEARS = re.compile(r"(\.attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|\.attn\.indexer\.wq_b|\.shared_experts\.w[123]"
                          r"|^mtp\.\d+\.(e_proj|h_proj))\.weight$")
_V41_FP8_LINEARS = re.compile(r"(\.attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|\.attn\.indexer\.wq_b|\.shared_experts\.w[123]"
                              r"|\.engram\.wkv|^mtp\.\d+\.main_proj)\.weight$")
_V41_TABLES = re.compile(r"\.engram\.embed\.weight$")
_V3_FP8_LINEARS = re.compile(r"^(layers|mtp)\.\d+\.(attn\.(wq|wq_a|wq_b|wkv_a|wkv_b|wo|indexer\.wq_b|indexer\.wk)"
                             r"|ffn\.(shared_experts\.)?w[123])\.weight$")
_MTP = re.compile(r"^mtp\.(\d+)\.")
_STACKED_EXPERTS = re.compile(r"^(.*\.ffn\.experts)\.(w[123])$")
ScaleHint = Callable[[str], "torch.Tensor | None"]
# codec -> FP8 block (rows, cols) and scale format (DeepSeek-V4's ue8m0, DeepSeek-V3's fp32 amax / 448)
_FP8_CODECS = {"fp8": ((quant.FP8_BLOCK, quant.FP8_BLOCK), "ue8m0"), "fp8/32": ((32, 32), "ue8m0"),
               "fp8/1x32": ((1, 32), "ue8m0"), "fp8/fp32": ((quant.FP8_BLOCK, quant.FP8_BLOCK), "fp32"),
               "fp8/fp32-ue8m0": ((quant.FP8_BLOCK, quant.FP8_BLOCK), "fp32/ue8m0")}
_SCALE_DTYPES = {"ue8m0": torch.float8_e8m0fnu, "fp32": torch.float32, "fp32/ue8m0": torch.float32}
SCALE_FORMATS = ("ue8m0",)  # the config's quantization_config.scale_fmt values trex writes scales in
_KEEP_FP32 = re.compile(r"((^|\.)hc_(attn|ffn|head)\.(fn|base|scale)|\.ape|\.attn_sink|\.gate\.bias)$")


@dataclass(frozen=True)
class TrexTensor:
    """One trex tensor to save. ``get(expert)`` returns it whole (expert None) or expert J's
    slice of a stacked [E, ...] tensor, in any float dtype (it is cast on the way out)."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    get: Callable[[int | None], torch.Tensor]


def codec_for(key: str, quantize: str | None, arch: str = "deepseek_v4", scale_fmt: str | None = None) -> str:
    """plain, fp8 (128x128 blocks), fp8/32 (32x32), fp8/1x32 (a scale per row and 32 columns), fp8/fp32
    (128x128 blocks, fp32 scales: DeepSeek-V3's), fp8/fp32-ue8m0 (the same, powers of two: the V3 family's
    under config ``scale_fmt`` "ue8m0") or fp4: how trex tensor ``key`` of architecture ``arch`` is stored
    under ``quantize``."""
    if quantize not in QUANTIZE_MODES:
        raise ValueError(f"quantize must be one of {QUANTIZE_MODES}, got {quantize!r}")
    if quantize is None:
        return "plain"
    if arch == "deepseek_v3":
        if quantize != "fp8":
            raise ValueError(f"the DeepSeek-V3 family is released as FP8 (quantize 'fp8'), not {quantize!r}")
        fp8 = "fp8/fp32-ue8m0" if scale_fmt == "ue8m0" else "fp8/fp32"
        return fp8 if _STACKED_EXPERTS.match(key) or _V3_FP8_LINEARS.search(key) else "plain"
    if _STACKED_EXPERTS.match(key):
        return "fp4" if quantize == "fp8+fp4experts" else "fp8/32" if arch == "deepseek_v41" else "fp8"
    if arch == "deepseek_v41":
        return "fp8/32" if _V41_FP8_LINEARS.search(key) else "fp8/1x32" if _V41_TABLES.search(key) else "plain"
    return "fp8" if _FP8_LINEARS.search(key) else "plain"


def plan_outputs(tensors: list[TrexTensor], layout: str, dtype: torch.dtype, quantize: str | None,
                 arch: str = "deepseek_v4", scale_hint: ScaleHint | None = None, n_layers: int | None = None,
                 scale_fmt: str | None = None) -> list[list[PlannedTensor]]:
    """Groups of tensors to write for ``layout`` ("official" or "hf"), in the order given. A DeepSeek-V3
    family model (``arch`` "deepseek_v3", ``n_layers`` its num_hidden_layers) is written by ``_plan_v3``. ``scale_hint``
    (a scale's name -> the tensor of that name in the checkpoint the model came from, or None): a
    quantised weight that this scale still represents exactly is written with it (``quantize_fp8_as``).
    ``scale_fmt``: the written config's ``quantization_config.scale_fmt`` (None or one of SCALE_FORMATS), which
    fresh scales follow."""

    if arch == "deepseek_v3":
        return _plan_v3(tensors, layout, dtype, quantize, n_layers, scale_hint, scale_fmt)
    by_key = {t.key: t for t in tensors}
    groups: list[list[PlannedTensor]] = []
    for t in tensors:
        codec = codec_for(t.key, quantize, arch)
        out_dtype = _plain_dtype(t, dtype)
        m = _STACKED_EXPERTS.match(t.key)
        if m and layout == "official":
            for j in range(t.shape[0]):
                groups.append(_encode(official_name(t.key, j), t.shape[1:], out_dtype, codec, layout,
                                      lambda t=t, j=j: t.get(j), scale_hint))
        elif m and layout == "hf":
            base, which = m.groups()
            if which == "w3":
                continue  # written inside gate_up_proj with w1
            if which == "w1":
                up = by_key[f"{base}.w3"]
                shape = (t.shape[0], t.shape[1] + up.shape[1], *t.shape[2:])
                produce = lambda t=t, up=up: torch.cat((t.get(None), up.get(None)), dim=1)  # noqa: E731
            else:
                shape, produce = t.shape, (lambda t=t: t.get(None))
            groups.append(_encode(hf_name(t.key), shape, out_dtype, codec, layout, produce, scale_hint))
        else:
            name = official_name(t.key) if layout == "official" else hf_name(t.key)
            groups.append(_encode(name, t.shape, out_dtype, codec, layout, lambda t=t: t.get(None), scale_hint))
    return groups


def _plan_v3(tensors: list[TrexTensor], layout: str, dtype: torch.dtype, quantize: str | None,
             n_layers: int | None, scale_hint: ScaleHint | None, scale_fmt: str | None = None
             ) -> list[list[PlannedTensor]]:
    """A DeepSeek-V3 family model as released (``naming.v3_hf_name``): routed experts one tensor each, the
    gate bias in fp32, each MTP module ``mtp.j`` as ``model.layers.{n_layers + j}`` followed by its copies
    of the embedding and head; quantised as ``codec_for`` says. Layout "hf" only (DeepSeek's inference
    names are not written)."""
    if layout != "hf":
        raise ValueError(f"DeepSeek-V3 family checkpoints are written in the hf layout (the released names), "
                         f"not {layout!r}")
    if n_layers is None:
        raise ValueError("plan_outputs: a DeepSeek-V3 family model needs n_layers (its num_hidden_layers)")
    by_key = {t.key: t for t in tensors}
    last_of_mtp = {int(m.group(1)): i for i, t in enumerate(tensors) if (m := _MTP.match(t.key))}
    groups: list[list[PlannedTensor]] = []
    for i, t in enumerate(tensors):
        codec, out_dtype = codec_for(t.key, quantize, "deepseek_v3", scale_fmt), _plain_dtype(t, dtype)
        if _STACKED_EXPERTS.match(t.key):
            for j in range(t.shape[0]):
                groups.append(_encode(v3_hf_name(t.key, n_layers, j), t.shape[1:], out_dtype, codec, layout,
                                      lambda t=t, j=j: t.get(j), scale_hint))
        else:
            groups.append(_encode(v3_hf_name(t.key, n_layers), t.shape, out_dtype, codec, layout,
                                  lambda t=t: t.get(None), scale_hint))
        m = _MTP.match(t.key)
        if m and last_of_mtp[int(m.group(1))] == i:  # MTP module j's last tensor: then its copies
            for name, key in v3_mtp_copies(n_layers, int(m.group(1))):
                src = by_key[key]
                groups.append(_encode(name, src.shape, _plain_dtype(src, dtype), "plain", layout,
                                      lambda src=src: src.get(None)))
    return groups


def _plain_dtype(t: TrexTensor, dtype: torch.dtype) -> torch.dtype:
    if not t.dtype.is_floating_point:
        return t.dtype
    return torch.float32 if _KEEP_FP32.search(t.key) else dtype


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


def quantization_config(quantize: str | None, arch: str = "deepseek_v4") -> dict | None:
    """The ``quantization_config`` of config.json for ``quantize`` (None when unquantised)."""
    if quantize is None:
        return None
    if arch == "deepseek_v3":  # as DeepSeek-V3 / R1 and Kimi-K2 release it: fp32 scales, no scale_fmt
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": [quant.FP8_BLOCK, quant.FP8_BLOCK]}
    block = 32 if arch == "deepseek_v41" else quant.FP8_BLOCK
    cfg = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0", "activation_scheme": "dynamic",
           "weight_block_size": [block, block]}
    if quantize == "fp8+fp4experts":
        cfg["expert_dtype"] = "fp4"
        cfg["expert_fmt"] = "e2m1"
        cfg["expert_block_size"] = [1, quant.FP4_BLOCK]
    return cfg
