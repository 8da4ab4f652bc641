"""The LM head's fp32 products from low-precision GEMMs (trex.kernels.fp32_matmul) against the fp32
reference. The CPU has no fp32-output bf16 GEMM, so here the device GEMM is emulated exactly (its
products and an fp64 sum rounded once); on an accelerator (TREX_DEVICE, bench/accelerator.sh) the
last test runs the device's own."""

from __future__ import annotations

import pytest
import torch

from trex import device as device_layer
from trex import kernels
from trex.kernels import fp32_matmul
from trex.models.common.cross_entropy import head_nll


@pytest.fixture
def emulated(monkeypatch):
    calls = []

    def mm(a, b):
        assert a.dtype == b.dtype == torch.bfloat16
        calls.append((tuple(a.shape), tuple(b.shape)))
        return (a.double() @ b.double()).float()

    def accumulate(acc, a, b):
        return acc.add_(mm(a, b))

    monkeypatch.setattr(fp32_matmul, "mm_fp32_out", mm)
    monkeypatch.setattr(fp32_matmul, "accumulate", accumulate)
    monkeypatch.setattr(fp32_matmul, "fp32_out_supported", lambda device_type, dtype: True)
    return calls


def _rel(x, ref, scale):
    return ((x - ref).abs() / scale).max().item()


def test_low_precision_operands_give_the_reference_products(emulated):
    g = torch.Generator().manual_seed(0)
    a = torch.randn(64, 256, generator=g).bfloat16()
    b = torch.randn(256, 96, generator=g).bfloat16()
    scale = a.float().abs() @ b.float().abs()
    assert _rel(fp32_matmul.split_matmul(a, b), fp32_matmul.reference(a, b), scale) < 2**-20
    assert len(emulated) == 1  # one GEMM


def test_an_fp32_operand_is_split_in_two_and_keeps_16_bits(emulated):
    g = torch.Generator().manual_seed(1)
    d = torch.randn(64, 512, generator=g) * torch.rand(64, 1, generator=g)  # the head's loss gradient: fp32
    w = torch.randn(512, 128, generator=g).bfloat16()
    scale = d.abs() @ w.float().abs()
    ref = fp32_matmul.reference(d, w)
    split = _rel(fp32_matmul.split_matmul(d, w), ref, scale)
    rounded = _rel(d.bfloat16().float() @ w.float(), ref, scale)  # what a plain bf16 GEMM would give
    assert split < 2**-16 and rounded > 2**-13 and rounded > 100 * split, (split, rounded)
    assert len(emulated) == 2
    acc = torch.ones(64, 128)
    assert _rel(fp32_matmul.split_matmul(d, w, acc), ref + 1, scale) < 2**-15  # accumulates in place


def test_without_the_device_gemm_it_is_the_reference_with_one_fp32_copy():
    w = torch.randn(8, 4).bfloat16()
    assert not fp32_matmul.fp32_out_supported("cpu", torch.bfloat16)  # this torch has no CPU kernel
    matmul, held = kernels.fp32_products(w)
    assert held.dtype == torch.float32
    x = torch.randn(3, 4).bfloat16()
    assert torch.equal(matmul(x, held.T), x.float() @ w.float().T)


def test_on_the_meta_device_the_head_takes_the_low_precision_gemms():
    """The meta device has the fp32-output kernel: the step `trex profile --meta` records is the
    device's (bf16 GEMMs into fp32, no fp32 copy of the head)."""
    w = torch.empty(1000, 64, dtype=torch.bfloat16, device="meta")
    matmul, held = kernels.fp32_products(w)
    assert matmul is fp32_matmul.split_matmul and held is w
    assert matmul(torch.empty(5, 64, dtype=torch.bfloat16, device="meta"), held.T).dtype == torch.float32


def test_the_fused_head_loss_and_its_gradients_match_the_reference(emulated, monkeypatch):
    g = torch.Generator().manual_seed(2)
    h = torch.randn(48, 64, generator=g).bfloat16().requires_grad_()
    w = (torch.randn(300, 64, generator=g) * 0.2).bfloat16().requires_grad_()
    t = torch.randint(0, 300, (48,), generator=g)
    fast = head_nll(h, w, t)
    fast.sum().backward()
    grads = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    monkeypatch.setenv("TREX_KERNELS", "fp32_matmul=reference")
    ref = head_nll(h, w, t)
    ref.sum().backward()
    assert emulated  # the fast path ran in the first pass
    torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-5)
    # the gradients come back in bf16: equal up to its rounding
    torch.testing.assert_close(grads[0], h.grad, rtol=2**-7, atol=1e-4)
    torch.testing.assert_close(grads[1], w.grad, rtol=2**-7, atol=1e-4)


def test_on_this_device_the_fast_path_matches_the_reference():
    dev = device_layer.detect()
    if not fp32_matmul.fp32_out_supported(dev.type, torch.bfloat16):
        pytest.skip(f"{dev.type}: this torch has no fp32-output bf16 GEMM here (the emulated tests cover the math)")
    g = torch.Generator().manual_seed(3)
    d = torch.randn(256, 1024, generator=g).to(dev.torch_device)
    w = torch.randn(1024, 512, generator=g).bfloat16().to(dev.torch_device)
    scale = d.abs() @ w.float().abs()
    ref = fp32_matmul.reference(d, w)
    assert _rel(fp32_matmul.split_matmul(d, w), ref, scale) < 2**-14
    acc = torch.ones_like(ref)  # in place where the device adds in place (probed), else from a temporary
    assert _rel(fp32_matmul.split_matmul(d, w, acc), ref + 1, scale) < 2**-14


def test_the_fast_path_compiles_in_one_graph(monkeypatch):
    """Inside a compiled block (the head and the routers are compiled with fullgraph=True) the probe is a
    dict read and the accumulation a GEMM and an add, no out=: one graph."""
    monkeypatch.setitem(fp32_matmul._PROBED, ("cpu", torch.bfloat16), (True, True))
    monkeypatch.setattr(fp32_matmul, "mm_fp32_out", lambda a, b: (a.double() @ b.double()).float())
    d, w = torch.randn(16, 32), torch.randn(32, 8).bfloat16()
    compiled = torch.compile(lambda d, w, acc: fp32_matmul.split_matmul(d, w, acc), backend="eager", fullgraph=True)
    got = compiled(d, w, torch.ones(16, 8))
    assert _rel(got, fp32_matmul.reference(d, w) + 1, d.abs() @ w.float().abs()) < 2**-15
