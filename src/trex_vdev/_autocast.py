"""Autocast for vdev (``torch.autocast("vdev", dtype=...)``).

PyTorch registers autocast kernels in C++ for CPU, CUDA, XPU, MPS, MTIA and MAIA only; an
out-of-tree backend registers its own for ``AutocastPrivateUse1``. Without them every op would
fail under autocast ("Could not run ... with arguments from the 'Autocastvdev' backend"). Here:
a fallthrough for every op, plus Python kernels that apply CUDA's cast policies to op lists
modelled on CUDA's (matmul/conv family in the autocast dtype; reductions, norms, losses and
transcendental ops in fp32; mixed-dtype ops promoted to the widest). CPU autocast has other lists
(e.g. softmax stays in the autocast dtype there), so vdev-under-autocast is not CPU-under-autocast. There is no cast cache: a weight used
twice is cast twice (same numbers, more work).
"""

from __future__ import annotations

import torch

from trex_vdev._tensor import DEVICE_TYPE

aten = torch.ops.aten

LOWER_PRECISION_FP = (
    "_convolution", "_convolution.deprecated", "conv1d", "conv1d.padding", "conv2d", "conv2d.padding",
    "conv3d", "conv3d.padding", "conv_tbc", "conv_transpose1d", "conv_transpose2d.input",
    "conv_transpose3d.input", "convolution", "prelu", "addmm", "addmv", "addr", "matmul", "einsum",
    "mm", "mv", "linalg_vecdot", "linear", "addbmm", "baddbmm", "bmm", "chain_matmul",
    "linalg_multi_dot", "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell", "lstm_cell", "gru_cell",
    "rnn_tanh_cell", "rnn_relu_cell", "_scaled_dot_product_flash_attention",
    "scaled_dot_product_attention",
)
FP32 = (
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal",
    "rsqrt", "sinh", "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar", "softplus",
    "layer_norm", "native_layer_norm", "group_norm", "frobenius_norm.dim", "nuclear_norm",
    "nuclear_norm.dim", "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss", "nll_loss",
    "nll_loss2d", "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss",
    "mse_loss", "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss",
    "triplet_margin_loss", "multi_margin_loss", "binary_cross_entropy_with_logits", "dist", "pdist",
    "cdist", "renorm", "logsumexp", "rms_norm",
)
FP32_SET_OPT_DTYPE = (
    "prod", "prod.dim_int", "softmax.int", "log_softmax.int", "cumprod", "cumsum",
    "linalg_vector_norm", "linalg_matrix_norm", "linalg_matrix_norm.str_ord", "sum",
    "sum.dim_IntList",
)
PROMOTE = (
    "addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler", "index_put",
    "tensordot", "scatter_add",
)

_EXCLUDE = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastPrivateUse1)


def _eligible(t) -> bool:
    return (
        isinstance(t, torch.Tensor)
        and t.device.type == DEVICE_TYPE
        and t.is_floating_point()
        and t.dtype != torch.float64
    )


def _cast(x, dtype):
    if isinstance(x, (list, tuple)):
        return type(x)(_cast(y, dtype) for y in x)
    if _eligible(x) and x.dtype != dtype:
        return x.to(dtype)
    return x


def _tensors(x):
    if isinstance(x, (list, tuple)):
        for y in x:
            yield from _tensors(y)
    elif isinstance(x, torch.Tensor):
        yield x


def _kernel(op, policy: str):
    names = [a.name for a in op._schema.arguments]
    dtype_pos = names.index("dtype") if "dtype" in names else None

    def kernel(*args, **kwargs):
        with torch._C._ExcludeDispatchKeyGuard(_EXCLUDE):
            if policy == "lower":
                dt = torch.get_autocast_dtype(DEVICE_TYPE)
            elif policy == "fp32":
                dt = torch.float32
            elif policy == "promote":
                dt = torch.get_autocast_dtype(DEVICE_TYPE)
                for t in _tensors((args, tuple(kwargs.values()))):
                    if _eligible(t) and t.dtype == torch.float32:
                        dt = torch.float32
            else:  # fp32_set_opt_dtype
                if args and _eligible(args[0]):
                    if dtype_pos is not None and len(args) > dtype_pos:
                        if args[dtype_pos] is None:
                            args = args[:dtype_pos] + (torch.float32,) + args[dtype_pos + 1:]
                    elif kwargs.get("dtype") is None:
                        kwargs = dict(kwargs, dtype=torch.float32)
                return op(*args, **kwargs)
            return op(*_cast(args, dt), **{k: _cast(v, dt) for k, v in kwargs.items()})

    kernel.__name__ = f"vdev_autocast_{policy}_{op.__name__}"
    return kernel


def register(fallback_lib: torch.library.Library, aten_lib: torch.library.Library) -> None:
    fallback_lib.fallback(torch.library.fallthrough_kernel, "AutocastPrivateUse1")
    for policy, names in (("lower", LOWER_PRECISION_FP), ("fp32", FP32),
                          ("fp32_set_opt_dtype", FP32_SET_OPT_DTYPE), ("promote", PROMOTE)):
        for name in dict.fromkeys(names):
            base, _, overload = name.partition(".")
            packet = getattr(aten, base, None)
            op = getattr(packet, overload or "default", None) if packet is not None else None
            if op is None:
                continue
            aten_lib.impl(name if overload else base, _kernel(op, policy), "AutocastPrivateUse1")
