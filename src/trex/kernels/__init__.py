"""A small kernel registry: every op has a pure-PyTorch reference; fast paths are optional.

    fn = kernels.get("rms_norm", device_type)

returns the fast path registered for that device type when there is one and it is enabled,
else the vendor-neutral default registered for every device type (``ANY``), else the reference.
A new device type (a vendor plugin, the test suite's virtual device) therefore gets the
vendor-neutral paths with no registration, and overrides what it has faster.

``TREX_KERNELS`` chooses: ``auto`` (the default, as above); ``reference`` (the references everywhere:
fidelity runs, debugging); or per op, comma-separated ``op=impl`` with impl ``reference``, ``auto``
or a named alternative (``sparse_attention=flex``: FlexAttention, trex.kernels.flex_attention;
``rms_norm=fused``: the accelerators' ``F.rms_norm`` on any device).
Each fast path and alternative has an equivalence test against its reference
(tests/test_kernels.py: rms_norm, grouped_mm, sparse_attention, mhc_*; tests/test_flex_attention.py, tests/test_dense_attention.py,
tests/test_latent_attention.py, tests/test_sparse_mla.py). Vendor plugins
register their kernels with ``register``.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from trex.kernels import dense_attention as _dense_attention
from trex.kernels import fp32_matmul as _fp32_matmul
from trex.kernels import latent_attention as _latent_attention
from trex.kernels import mhc as _mhc
from trex.kernels import reference
from trex.kernels import sparse_attention as _sparse_attention
from trex.kernels import sparse_mla as _sparse_mla

_REFERENCE: dict[str, Callable] = {
    "rms_norm": reference.rms_norm,
    "grouped_mm": reference.grouped_mm,
    "sparse_attention": _sparse_attention.reference,
    "dense_attention": _dense_attention.reference,
    "latent_attention": _latent_attention.reference,
    "sparse_mla": _sparse_mla.reference,
    "fp32_matmul": _fp32_matmul.reference,
    "mhc_coefficients": _mhc.reference_coefficients,
    "mhc_collapse": _mhc.reference_collapse,
    "mhc_expand": _mhc.reference_expand,
}
_FAST: dict[tuple[str, str], Callable] = {}
ANY = "*"  # the device type of a vendor-neutral default
# opt-in implementations, never chosen by auto: (op, name) -> function. Imported with the registry, not when
# chosen: `get` runs inside compiled blocks, where torch.compile cannot trace an import (issue 53)
_ALTERNATIVES: dict[tuple[str, str], Callable] = {}


def register(op: str, device_type: str, fn: Callable) -> None:
    """Register ``fn`` as the fast path of ``op`` on ``device_type`` ("cuda", "npu", "cpu", ...;
    ``ANY`` for every device type without a registration of its own)."""
    if op not in _REFERENCE:
        raise KeyError(f"unknown kernel op {op!r}; known ops: {sorted(_REFERENCE)}")
    _FAST[(op, device_type)] = fn


def choice(op: str) -> str:
    """What ``TREX_KERNELS`` chooses for ``op``: "auto", "reference" or an alternative's name."""
    setting = os.environ.get("TREX_KERNELS", "auto").strip()
    if setting in ("auto", "reference"):
        return setting
    for item in filter(None, (part.strip() for part in setting.split(","))):
        name, _, impl = item.partition("=")
        if name not in _REFERENCE or not impl or (impl not in ("auto", "reference")
                                                  and (name, impl) not in _ALTERNATIVES):
            options = sorted({"auto", "reference", *(f"{o}={a}" for o, a in _ALTERNATIVES)})
            raise ValueError(f"TREX_KERNELS={setting!r}: {item!r} is not a choice; use auto, reference, or "
                             f"op=impl with op in {sorted(_REFERENCE)} and impl auto, reference or one of {options}")
        if name == op:
            return impl
    return "auto"


def get(op: str, device_type: str) -> Callable:
    if op not in _REFERENCE:
        raise KeyError(f"unknown kernel op {op!r}; known ops: {sorted(_REFERENCE)}")
    chosen = choice(op)
    if chosen == "reference":
        return _REFERENCE[op]
    if chosen != "auto":
        return _ALTERNATIVES[(op, chosen)]
    return _FAST.get((op, device_type)) or _FAST.get((op, ANY)) or _REFERENCE[op]


def reference_of(op: str) -> Callable:
    return _REFERENCE[op]


def fast_paths() -> dict[tuple[str, str], Callable]:
    return dict(_FAST)


# Vendor-neutral fast paths, from PyTorch's own fused operators and plain PyTorch.
from trex.kernels import flex_attention as _flex_attention  # noqa: E402
from trex.kernels import fused as _fused  # noqa: E402

_ALTERNATIVES[("sparse_attention", "flex")] = _flex_attention.flex_sparse_attention
# the accelerators' RMSNorm (F.rms_norm) on any device: the CPU runs the reference by default
_ALTERNATIVES[("rms_norm", "fused")] = _fused.rms_norm

# grouped matmul with device-side offsets (no host sync), on every device
register("grouped_mm", ANY, _fused.grouped_mm)
# F.rms_norm fuses on accelerators; on CPU the reference's three ops are as fast
register("rms_norm", ANY, _fused.rms_norm)
register("rms_norm", "cpu", reference.rms_norm)
# a hand-written backward in plain PyTorch: faster and leaner than autograd's on every device
register("sparse_attention", ANY, _sparse_attention.fused_backward)
# PyTorch's fused scaled-dot-product attention with the document-causal mask: no [B, H, S, S] fp32 scores;
# on CPU with the values zero-padded to the key width, which its fused kernel needs
register("dense_attention", ANY, _dense_attention.sdpa)
register("dense_attention", "cpu", _dense_attention.sdpa_padded_values)
# MLA's core from the gathered latent under context parallelism: keys and values expanded a chunk at a time,
# an online softmax, recomputed in backward (what a rank holds shrinks with cp)
register("latent_attention", ANY, _latent_attention.chunked)
# DeepSeek-V3.2's MLA over the indexer's picks: chunked gathers, linear in S (the mask form is quadratic)
register("sparse_mla", ANY, _sparse_mla.gathered)
# the LM head's fp32 products from low-precision GEMMs with fp32 accumulation where the device has them
# (the same products, summed in another order; an fp32 operand split in two); elsewhere the reference
register("fp32_matmul", ANY, _fp32_matmul.split_matmul)
# mHC's mixing in fewer passes over the n residual streams (no normalised copy of them; the expand's
# comb^T X added into post (x) y); the collapse keeps its reference (trex.kernels.mhc)
register("mhc_coefficients", ANY, _mhc.fused_coefficients)
register("mhc_expand", ANY, _mhc.fused_expand)


def fp32_products(t: torch.Tensor) -> tuple[Callable, torch.Tensor]:
    """The ``fp32_matmul`` chosen for ``t``'s device, and what to hold of ``t`` for repeated products
    with it: ``t`` itself when they run in its own dtype, else one fp32 copy."""
    matmul = get("fp32_matmul", t.device.type)
    return matmul, (_fp32_matmul.operand(t) if matmul is _fp32_matmul.split_matmul else t.float())


def prepare(device_type: str) -> None:
    """Probe, once per process and before a training step, what the fast paths must know of a device
    type (a probe reads a value back: not inside a step, which has no host read)."""
    for dtype in _fp32_matmul.LOW:
        _fp32_matmul.probe(device_type, dtype)
