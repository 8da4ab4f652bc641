"""The ``dense_attention`` op (DeepSeek-V3's MLA core): the fused scaled-dot-product path against the
pure-PyTorch reference, forward and every gradient, over packed documents and left-padding rows."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from trex import kernels
from trex.kernels import dense_attention

# every fused backend PyTorch has, the math one (which materialises the scores) left out
FUSED_BACKENDS = [b for name, b in SDPBackend.__members__.items() if name not in ("ERROR", "MATH")]
FAST = [dense_attention.sdpa, dense_attention.sdpa_padded_values]
# the measured bf16 gap (largest |fast - reference| / largest |reference|, forward and gradients) is
# 3e-3 ... 1e-2 on CPU and on one accelerator: bf16 roundings (2^-8) of the probabilities, which the
# reference casts to bf16 before the value sum and the fused kernels keep in fp32; against fp64 both are as
# far (3e-3 ... 7e-3)
BF16_BOUND = 1.5e-2


def _devices():
    devs = ["cpu"]
    if torch.accelerator.is_available():
        devs.append(torch.accelerator.current_accelerator().type)
    return devs


def _inputs(dev, dtype, S=48, H=3, dk=24, dv=16, seed=0):
    """Row 0: three packed documents; row 1: a left-padding run (its own segment) then one document."""
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(2, S, H, dk, generator=g), torch.randn(2, S, H, dk, generator=g)
    v, d_out = torch.randn(2, S, H, dv, generator=g), torch.randn(2, S, H, dv, generator=g)
    doc = torch.zeros(2, S, dtype=torch.long)
    doc[0, S // 4:] = 1
    doc[0, S // 2 + 3:] = 2
    doc[1, 13:] = 1  # 13 padding positions first
    leaves = [t.to(dev, dtype).requires_grad_() for t in (q, k, v)]
    return leaves, doc.to(dev), d_out.to(dev, dtype)


def _run(fn, dev, dtype, scale, **shape):
    (q, k, v), doc, d_out = _inputs(dev, dtype, **shape)
    out = fn(q, k, v, scale, doc)
    return [out, *torch.autograd.grad(out, (q, k, v), d_out)]


def _rel(got, expected):
    return ((got.float() - expected.float()).abs().max() / expected.float().abs().max()).item()


def test_registry_defaults_to_sdpa_and_honours_reference(monkeypatch):
    assert kernels.get("dense_attention", "cpu") is dense_attention.sdpa_padded_values
    assert kernels.get("dense_attention", "some_new_vendor") is dense_attention.sdpa
    assert kernels.reference_of("dense_attention") is dense_attention.reference
    monkeypatch.setenv("TREX_KERNELS", "dense_attention=reference")
    assert kernels.get("dense_attention", "cpu") is dense_attention.reference


@pytest.mark.parametrize("fast", FAST, ids=lambda f: f.__name__)
@pytest.mark.parametrize("dev", _devices())
@pytest.mark.parametrize("dk,dv", [(24, 16), (16, 16), (192, 128)])
def test_sdpa_matches_reference_fp32(fast, dev, dk, dv):
    """fp32: output and the q, k, v gradients within 1e-5 of the reference (relative to its largest entry);
    a YaRN-style scale (head_dim^-0.5 x mscale^2) goes through ``scale``."""
    scale = dk ** -0.5 * 1.37 ** 2
    S = 40 if dk == 192 else 48
    expected = _run(dense_attention.reference, dev, torch.float32, scale, S=S, dk=dk, dv=dv)
    got = _run(fast, dev, torch.float32, scale, S=S, dk=dk, dv=dv)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, expected):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert _rel(a, b) < 1e-5, (name, _rel(a, b))


@pytest.mark.parametrize("fast", FAST, ids=lambda f: f.__name__)
@pytest.mark.parametrize("dev", _devices())
def test_sdpa_matches_reference_bf16(fast, dev):
    """bf16: within BF16_BOUND of the bf16 reference, and no further from the fp64 result than it."""
    truth = _run(dense_attention.reference, dev, torch.float64, 24 ** -0.5)
    expected = _run(dense_attention.reference, dev, torch.bfloat16, 24 ** -0.5)
    got = _run(fast, dev, torch.bfloat16, 24 ** -0.5)
    for name, a, b, t in zip(("out", "dq", "dk", "dv"), got, expected, truth):
        assert a.dtype == torch.bfloat16
        assert _rel(a, b) < BF16_BOUND, (name, _rel(a, b))
        assert _rel(a, t) <= 1.5 * _rel(b, t) + 1e-3, (name, _rel(a, t), _rel(b, t))


@pytest.mark.parametrize("fn", [dense_attention.reference, *FAST], ids=lambda f: f.__name__)
def test_a_shard_of_queries_gives_its_rows_of_the_whole(fn):
    """Context parallelism: queries of rows q_start .. q_start + s - 1 against the whole rows' keys give those
    rows of the whole attention (the causal mask offset by q_start; documents across the shard's edges),
    and the gradients of k and v summed over the shards are the whole's."""
    (q, k, v), doc, d_out = _inputs("cpu", torch.float32)
    whole = fn(q, k, v, 0.2, doc)
    grads = torch.autograd.grad(whole, (k, v), d_out)
    summed = [torch.zeros_like(k), torch.zeros_like(v)]
    for q_start in (0, 16, 32):
        rows = slice(q_start, q_start + 16)
        part = fn(q[:, rows], k, v, 0.2, doc, q_start=q_start)
        assert _rel(part, whole[:, rows]) < 1e-6, q_start
        for acc, g in zip(summed, torch.autograd.grad(part, (k, v), d_out[:, rows])):
            acc += g
    for a, b in zip(summed, grads):
        assert _rel(a, b) < 1e-5


@pytest.mark.parametrize("dev", _devices())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_default_runs_a_fused_kernel_with_the_mask(dev, dtype):
    """With the math backend switched off the device's default still runs, forward and backward: a fused
    kernel (no [B, H, S, S] scores) takes the document mask and MLA's narrower values."""
    (q, k, v), doc, d_out = _inputs(dev, dtype, dk=24, dv=16)
    with sdpa_kernel(FUSED_BACKENDS):
        out = kernels.get("dense_attention", q.device.type)(q, k, v, 0.2, doc)
        out.backward(d_out)
    assert out.shape == (2, 48, 3, 16) and v.grad.shape == v.shape


def test_the_cpu_default_compiles_without_a_graph_break():
    """fullgraph=True through Inductor, forward and backward equal to eager."""
    eager = _run(dense_attention.sdpa_padded_values, "cpu", torch.float32, 0.2)
    compiled = _run(torch.compile(dense_attention.sdpa_padded_values, fullgraph=True), "cpu", torch.float32, 0.2)
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
