"""``a @ b`` in fp32 for operands that may be bf16, fp16 or fp32: the LM head's products.

The reference casts both to fp32 and multiplies: what DeepSeek's code does for the logits
(``x.float() @ head.weight.float()``). A bf16 or fp16 value is exact in fp32 and so is the product of
two of them, so a GEMM that multiplies the low-precision operands and accumulates and returns fp32
(``torch.mm(a, b, out_dtype=torch.float32)``, tensor cores) forms the same products and sums them in
another order, at the low-precision peak instead of the fp32 one (an H200: 989 against 67 TFLOP/s).
An fp32 operand (the loss gradient in the head's backward) is split into two low-precision parts,
``hi = low(x)`` and ``lo = low(x - hi)``, which hold 16 of its 24 mantissa bits (bf16): the products
become two or three such GEMMs, each sum within about 2^-16 of the fp32 one, relative to the sum of
the products' magnitudes (tests/test_fp32_matmul.py).

``split_matmul`` is the vendor-neutral fast path: on a device whose torch has no fp32-output
low-precision GEMM (the CPU), it is the reference. ``operand(t)`` is what a caller keeps for
repeated products with ``t``: ``t`` itself where the fast path runs, one fp32 copy where it does not.
"""

from __future__ import annotations

import torch

LOW = (torch.bfloat16, torch.float16)


def reference(a: torch.Tensor, b: torch.Tensor, acc: torch.Tensor | None = None) -> torch.Tensor:
    """[m, k] @ [k, n] -> fp32 [m, n], computed in fp32; with ``acc`` (fp32 [m, n]) the product is
    added into it in place and ``acc`` returned."""
    if acc is not None:
        return acc.addmm_(a.float(), b.float())
    return a.float() @ b.float()


def mm_fp32_out(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Low-precision [m, k] @ [k, n] with fp32 accumulation and output."""
    return torch.mm(a, b, out_dtype=torch.float32)


# (device type, dtype) -> (fp32-output GEMM, in-place accumulation): probed once, before a step (kernels.prepare)
_PROBED: dict[tuple[str, torch.dtype], tuple[bool, bool]] = {}


def _probe(device_type: str, dtype: torch.dtype) -> tuple[bool, bool]:
    try:
        x = torch.ones(2, 2, dtype=dtype, device=device_type)
        if mm_fp32_out(x, x).dtype != torch.float32:
            return False, False
    except (NotImplementedError, RuntimeError, TypeError):
        return False, False
    try:  # the value is read back where there is one: the in-place form must add, not overwrite
        acc = torch.ones(2, 2, dtype=torch.float32, device=device_type)
        torch.addmm(acc, x, x, out_dtype=torch.float32, out=acc)
        return True, device_type == "meta" or bool((acc == 3).all())
    except (NotImplementedError, RuntimeError, TypeError):
        return True, False


def probe(device_type: str, dtype: torch.dtype) -> tuple[bool, bool]:
    """(whether this torch multiplies ``dtype`` operands into fp32 on ``device_type``, whether it adds
    such a product into an fp32 tensor in place), probed on first use. Inside a compiled region an
    unprobed device reads (False, False): probe first (trex.kernels.prepare)."""
    key = (device_type, dtype)
    if key not in _PROBED:
        if torch.compiler.is_compiling():
            return False, False
        _PROBED[key] = _probe(device_type, dtype)
    return _PROBED[key]


def fp32_out_supported(device_type: str, dtype: torch.dtype) -> bool:
    return probe(device_type, dtype)[0]


def accumulate(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """acc += a @ b for low-precision a, b and fp32 acc, in place (in a compiled region, from a
    temporary: the compiler sees a plain GEMM and an add, no ``out=``)."""
    if probe(acc.device.type, a.dtype)[1] and not torch.compiler.is_compiling():
        return torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    return acc.add_(mm_fp32_out(a, b))


def _low_dtype(a: torch.Tensor, b: torch.Tensor) -> torch.dtype | None:
    low = next((t.dtype for t in (a, b) if t.dtype in LOW), None)
    return low if low is not None and fp32_out_supported(a.device.type, low) else None


def split(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 x as hi + lo, both in ``dtype``: hi = dtype(x), lo = dtype(x - hi)."""
    hi = x.to(dtype)
    return hi, (x - hi.float()).to(dtype)


def split_matmul(a: torch.Tensor, b: torch.Tensor, acc: torch.Tensor | None = None) -> torch.Tensor:
    """As ``reference``, from fp32-output low-precision GEMMs (see the module); the second and third
    products are added in place (``accumulate``)."""
    low = _low_dtype(a, b)
    if low is None:
        return reference(a, b, acc)
    parts_a = [a] if a.dtype == low else list(split(a.float(), low))
    parts_b = [b] if b.dtype == low else list(split(b.float(), low))
    out = acc
    for i, pa in enumerate(parts_a):
        for j, pb in enumerate(parts_b):
            if i and j:  # lo x lo: below the sum's rounding
                continue
            out = mm_fp32_out(pa, pb) if out is None else accumulate(out, pa, pb)
    return out


def operand(t: torch.Tensor) -> torch.Tensor:
    """What to hold for repeated ``split_matmul`` products with ``t``: ``t`` where they run in its own
    dtype, else one fp32 copy (so the reference does not cast it again for every product)."""
    if t.dtype in LOW and fp32_out_supported(t.device.type, t.dtype):
        return t
    return t.float()
