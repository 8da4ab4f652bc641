"""The ``latent_attention`` op (MLA's core from the gathered KV latent, context parallelism): the chunked
flash-style path against the pure-PyTorch reference (every row expanded), forward and every gradient (q, the
latent, k_pe, ``wkv_b``'s weight), over packed documents, left padding, a shard of queries and chunks that do
not divide the rows."""

from __future__ import annotations

import pytest
import torch

from trex import kernels
from trex.kernels import latent_attention

H, NOPE, ROPE, DV, R = 3, 16, 8, 12, 20


def _inputs(dtype, S=48, Sq=48, seed=0):
    """Row 0: three packed documents; row 1: a left-padding run (its own segment) then one document."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, Sq, H, NOPE + ROPE, generator=g)
    latent, k_pe = torch.randn(2, S, R, generator=g), torch.randn(2, S, ROPE, generator=g)
    w = torch.randn(H * (NOPE + DV), R, generator=g) / R ** 0.5
    d_out = torch.randn(2, Sq, H, DV, generator=g)
    doc = torch.zeros(2, S, dtype=torch.long)
    doc[0, S // 4:] = 1
    doc[0, S // 2 + 3:] = 2
    doc[1, 13:] = 1
    return [t.to(dtype).requires_grad_() for t in (q, latent, k_pe, w)], doc, d_out.to(dtype)


def _run(fn, dtype, q_start=0, Sq=48, **kw):
    leaves, doc, d_out = _inputs(dtype, Sq=Sq)
    out = fn(*leaves, 0.2, doc, q_start, **kw)
    return [out, *torch.autograd.grad(out, leaves, d_out)]


def _rel(got, expected):
    return ((got.float() - expected.float()).abs().max() / expected.float().abs().max()).item()


NAMES = ("out", "dq", "dlatent", "dk_pe", "dw")


def test_registry_defaults_to_chunked_and_honours_reference(monkeypatch):
    assert kernels.get("latent_attention", "cpu") is latent_attention.chunked
    assert kernels.get("latent_attention", "some_new_vendor") is latent_attention.chunked
    monkeypatch.setenv("TREX_KERNELS", "latent_attention=reference")
    assert kernels.get("latent_attention", "cpu") is latent_attention.reference


@pytest.mark.parametrize("chunk,tile,q_start,Sq", [(16, 48, 0, 48), (20, 7, 0, 48), (5, 16, 0, 48), (20, 7, 16, 16),
                                                   (48, 48, 32, 16), (5, 16, 32, 16)])
def test_chunked_matches_reference_fp32(chunk, tile, q_start, Sq):
    """fp32: the output and the gradients of q, the latent, k_pe and wkv_b's weight within 2e-6 of the
    reference (relative to its largest entry), whole rows and a shard of query rows, chunks and tiles that do
    and do not divide the rows (measured: at most 4.3e-7)."""
    expected = _run(latent_attention.reference, torch.float32, q_start, Sq)
    got = _run(latent_attention.chunked, torch.float32, q_start, Sq, chunk=chunk, tile=tile)
    for name, a, b in zip(NAMES, got, expected):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert _rel(a, b) < 2e-6, (name, _rel(a, b))


def test_chunked_bf16_is_as_close_to_fp64_as_the_reference():
    truth = _run(latent_attention.reference, torch.float64)
    expected = _run(latent_attention.reference, torch.bfloat16)
    got = _run(latent_attention.chunked, torch.bfloat16, chunk=16, tile=16)
    for name, a, b, t in zip(NAMES, got, expected, truth):
        assert a.dtype == torch.bfloat16
        assert _rel(a, t) <= 1.5 * _rel(b, t) + 1e-3, (name, _rel(a, t), _rel(b, t))


def test_chunked_compiles_without_a_graph_break():
    """fullgraph=True (Dynamo traces the autograd.Function's forward and backward, AOTAutograd its joint graph;
    the aot_eager backend keeps the test's CPU seconds to a few, Inductor's codegen being the model tests'
    concern), forward and every gradient equal to eager."""
    eager = _run(latent_attention.chunked, torch.float32, 16, 16, chunk=24, tile=16)
    fn = torch.compile(latent_attention.chunked, fullgraph=True, backend="aot_eager")
    compiled = _run(fn, torch.float32, 16, 16, chunk=24, tile=16)
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
