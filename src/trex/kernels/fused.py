"""Fast paths built from PyTorch's own fused operators (no vendor names, any accelerator)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from trex.kernels import reference

_GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """``F.rms_norm`` in fp32 (fused on accelerators); same contract as the reference."""
    w = None if weight is None else weight.float()
    return F.rms_norm(x.float(), (x.shape[-1],), w, eps).to(x.dtype)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm`` over expert-sorted rows with device-side offsets (no host read); same
    contract as the reference. ``_grouped_mm`` wants rows of a multiple of 16 bytes: other widths
    (tiny test models) are zero-padded, which leaves the products unchanged. It has no fp64 kernel:
    fp64 (precision tests) takes the reference."""
    if x.dtype not in _GROUPED_MM_DTYPES:
        return reference.grouped_mm(x, w, offsets)
    align = max(1, 16 // x.element_size())
    K, M = x.shape[-1], w.shape[1]
    pad_k, pad_m = -K % align, -M % align
    if pad_k or pad_m:
        x = F.pad(x, (0, pad_k))
        w = F.pad(w, (0, pad_k, 0, pad_m))
    out = _grouped_mm_op(x, w, offsets)
    return out[:, :M] if pad_m else out


# torch._grouped_mm as an opaque op for torch.compile: its own shape function accepts bf16 only (as its
# CUDA kernel does), while the CPU kernel takes fp32 too; the op below states the shapes itself, so a
# compiled block keeps the grouped matmul in its graph on every device and dtype.
@torch.library.custom_op("trex::grouped_mm", mutates_args=())
def _grouped_mm_op(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """x [N, K] (aligned), w [E, M, K], offsets [E] int32 -> [N, M]."""
    return torch._grouped_mm(x, w.transpose(-2, -1), offs=offsets)


@_grouped_mm_op.register_fake
def _(x, w, offsets):
    return x.new_empty(x.shape[0], w.shape[1])


@torch.library.custom_op("trex::grouped_mm_weight_grad", mutates_args=())
def _grouped_mm_weight_grad(grad: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """dw[e] = grad_e^T x_e: grad [N, M], x [N, K] -> [E, M, K] (the 2-D x 2-D grouped form)."""
    return torch._grouped_mm(grad.t(), x, offs=offsets)


@_grouped_mm_weight_grad.register_fake
def _(grad, x, offsets):
    return x.new_empty(offsets.shape[0], grad.shape[1], x.shape[1])


def _grouped_mm_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _grouped_mm_backward(ctx, grad):
    """dx = grad @ w[e] per group (the forward op on w^T); dw from the weight-gradient op."""
    x, w, offsets = ctx.saved_tensors
    grad = grad.contiguous()
    dx = _grouped_mm_op(grad, w.transpose(-2, -1), offsets) if ctx.needs_input_grad[0] else None
    dw = _grouped_mm_weight_grad(grad, x, offsets) if ctx.needs_input_grad[1] else None
    return dx, dw, None


_grouped_mm_op.register_autograd(_grouped_mm_backward, setup_context=_grouped_mm_setup)
