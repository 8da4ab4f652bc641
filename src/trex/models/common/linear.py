"""Linears: the fp32 product that keeps its inputs' dtypes for backward (``linear_fp32``: LM heads,
routers, compressors), and the served model's quantisation simulated in the forward
(quantisation-aware training): ``QuantSim`` (which parts), ``QuantLinear`` (a linear stored in FP8),
``spread_quant`` (a model's switch)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from trex import kernels
from trex.kernels import quantize


class _LinearFP32(torch.autograd.Function):
    """x.float() @ weight.float().T that keeps x and weight in their own dtype for backward: at bf16
    an fp32 copy of the weight (the LM head's [V, d]: 3.5 GiB on V4-Pro, per head call) is re-made
    in backward instead of kept. Gradients come back in the inputs' dtypes, as autograd's casts do."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        matmul, w = kernels.fp32_products(weight)
        return matmul(x.reshape(-1, x.shape[-1]), w.T).view(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        matmul, w = kernels.fp32_products(weight)
        g = grad.reshape(-1, grad.shape[-1])
        dx = matmul(g, w).view(x.shape).to(x.dtype) if ctx.needs_input_grad[0] else None
        dw = matmul(g.T, x.reshape(-1, x.shape[-1])).to(weight.dtype) if ctx.needs_input_grad[1] else None
        return dx, dw


def linear_fp32(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """[..., in] x [out, in] -> [..., out] in fp32 whatever the inputs' dtype."""
    return _LinearFP32.apply(x, weight)


@dataclass(frozen=True)
class QuantSim:
    """Which quantisations of the official inference code the forward reproduces, each with the
    official quantiser's rules (trex.kernels.quantize) and a straight-through gradient:

    experts: routed experts' weights through FP4 (e2m1, 1x32 ue8m0 scales), as released;
    linears: the FP8-stored linears' weights (``QuantLinear``; block scales of the architecture's
        ``fp8_block``: V4 128x128, V4.1 32x32, and V4.1's Engram table rows 1x32);
    activations: the inputs of those linears and of the experts through FP8 (1 x ``fp8_block``), as the
        official ``linear`` quantises them before its FP8 / FP4 GEMM (``wo_a``, dequantised to bf16
        by the official converter, takes its input as it is);
    kv: the non-RoPE dims of the attention KV and of the main compressor's entries through FP8
        (blocks of 64);
    indexer: the indexer's queries and keys rotated by a Hadamard transform and put through FP4
        (blocks of 32).
    All off is the unquantised model."""

    experts: bool = False
    linears: bool = False
    activations: bool = False
    kv: bool = False
    indexer: bool = False

    PARTS = ("experts", "linears", "activations", "kv", "indexer")

    @property
    def active(self) -> bool:
        return any(getattr(self, part) for part in self.PARTS)


class QuantLinear(nn.Linear):
    """A linear the released checkpoints store in FP8 (``block`` x ``block`` scales: the config's
    ``fp8_block``); with ``quant`` it computes as the official ``linear`` does on such a weight."""

    quant = QuantSim()

    def __init__(self, in_features: int, out_features: int, bias: bool = False, block: int = quantize.FP8_BLOCK):
        super().__init__(in_features, out_features, bias=bias)
        self.block = block

    def quantized_weight(self) -> torch.Tensor:
        return quantize.fake_fp8_weight(self.weight, (self.block, self.block)) if self.quant.linears else self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant.activations:
            x = quantize.fake_fp8_act(x, self.block)
        return F.linear(x, self.quantized_weight())


def spread_quant(model: nn.Module, quant: QuantSim, kinds: tuple[type, ...]) -> None:
    """``quant`` on ``model`` and on each of its modules of ``kinds`` (the ones whose forward reads it)."""
    model.quant = quant
    for module in model.modules():
        if isinstance(module, kinds):
            module.quant = quant
