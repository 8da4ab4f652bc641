"""Every registered fast path against its pure-PyTorch reference."""

from __future__ import annotations

import pytest
import torch

from trex import kernels
from trex.kernels import fused, reference, sparse_attention


def test_registry_falls_back_to_reference_and_honours_override(monkeypatch):
    assert kernels.get("rms_norm", "cpu") is reference.rms_norm
    assert kernels.get("grouped_mm", "cuda") is fused.grouped_mm
    # a device type nobody registered for gets the vendor-neutral defaults
    assert kernels.get("grouped_mm", "some_new_vendor") is fused.grouped_mm
    assert kernels.get("rms_norm", "some_new_vendor") is fused.rms_norm
    monkeypatch.setenv("TREX_KERNELS", "reference")
    assert kernels.get("grouped_mm", "cuda") is reference.grouped_mm
    with pytest.raises(KeyError, match="unknown kernel op"):
        kernels.get("flash", "cpu")


def _devices():
    devs = ["cpu"]
    if torch.accelerator.is_available():
        devs.append(torch.accelerator.current_accelerator().type)
    return devs


@pytest.mark.parametrize("dev", _devices())
@pytest.mark.parametrize("weighted", [True, False])
def test_fused_rms_norm_matches_reference(dev, weighted):
    x = torch.randn(3, 5, 48, device=dev)
    w = torch.randn(48, device=dev) if weighted else None
    torch.testing.assert_close(fused.rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dev", _devices())
def test_fused_grouped_mm_matches_reference(dev):
    counts = [5, 0, 11, 16]
    offsets = torch.tensor(counts, device=dev).cumsum(0).to(torch.int32)
    x = torch.randn(sum(counts), 32, device=dev)
    w = torch.randn(4, 16, 32, device=dev)
    expected = reference.grouped_mm(x, w, offsets)
    try:
        got = fused.grouped_mm(x, w, offsets)
    except RuntimeError as e:  # torch._grouped_mm is not implemented for this device/dtype
        pytest.skip(f"torch._grouped_mm unavailable on {dev}: {e}")
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    manual = torch.cat([x[:5] @ w[0].T, x[5:16] @ w[2].T, x[16:] @ w[3].T])
    torch.testing.assert_close(expected, manual)


def _attention_inputs(dev, dtype, kind: str, S=37, H=3, c=8, N=9):
    g = torch.Generator().manual_seed(0)
    q, kv = torch.randn(2, S, H, c, generator=g), torch.randn(2, S, c, generator=g)
    sink, comp = torch.randn(H, generator=g), torch.randn(2, N, c, generator=g)
    doc = torch.zeros(2, S, dtype=torch.long)
    doc[0, S // 3:] = 1  # two packed documents in row 0
    if kind == "dense":
        idx, mask = None, torch.rand(2, S, N, generator=g) > 0.3
    elif kind == "topk":  # k < N / 2: the gathered path (indices may repeat)
        idx, mask = torch.randint(0, N, (2, S, 4), generator=g), torch.rand(2, S, 4, generator=g) > 0.2
    else:  # "topk-wide": distinct picks, k >= N / 2: run as the dense path with the picks as its mask
        k = 5
        assert k >= sparse_attention.DENSE_TOPK_FRACTION * N
        idx, mask = torch.rand(2, S, N, generator=g).argsort(-1)[..., :k], torch.rand(2, S, k, generator=g) > 0.2
    grads = [t.to(dev, dtype).requires_grad_() for t in (q, kv, sink, comp)]
    return grads, doc.to(dev), mask.to(dev), None if idx is None else idx.to(dev)


@pytest.mark.parametrize("dev", _devices())
@pytest.mark.parametrize("kind", ["sliding", "dense", "topk", "topk-wide"])
@pytest.mark.parametrize("window", [8, 7])
def test_sparse_attention_backward_matches_autograd_reference(dev, kind, window):
    """The hand-written backward against autograd through the reference: output and every gradient."""
    results = []
    for fn in (sparse_attention.reference, sparse_attention.fused_backward):
        (q, kv, sink, comp), doc, mask, idx = _attention_inputs(dev, torch.float64, kind)
        args = (comp, mask, idx) if kind != "sliding" else (None, None, None)
        out = fn(q, kv, sink, 8**-0.5, window, doc, *args)
        out.backward(torch.linspace(-1, 1, out.numel(), dtype=out.dtype, device=dev).view_as(out))
        results.append([out, q.grad, kv.grad, sink.grad, comp.grad])
    for name, ref, got in zip(["out", "q", "kv", "sink", "compressed"], *results):
        if ref is None:
            assert got is None and kind == "sliding", name
            continue
        torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-5, msg=name)
    assert results[0][4] is None or results[0][4].abs().sum() > 0  # the compressed entries do get gradient


def test_sparse_attention_is_registered_with_its_reference(monkeypatch):
    assert kernels.get("sparse_attention", "cpu") is sparse_attention.fused_backward
    monkeypatch.setenv("TREX_KERNELS", "reference")
    assert kernels.get("sparse_attention", "cpu") is sparse_attention.reference


def test_kernel_choice_per_op(monkeypatch):
    from trex.kernels import flex_attention

    monkeypatch.setenv("TREX_KERNELS", "sparse_attention=flex, grouped_mm=reference")
    assert kernels.get("sparse_attention", "cuda") is flex_attention.flex_sparse_attention
    assert kernels.get("grouped_mm", "cuda") is reference.grouped_mm
    assert kernels.get("rms_norm", "cuda") is fused.rms_norm  # not named: the usual choice
    monkeypatch.setenv("TREX_KERNELS", "sparse_attention=fast")
    with pytest.raises(ValueError, match="sparse_attention=flex"):
        kernels.get("sparse_attention", "cpu")


def test_an_alternative_chosen_by_name_compiles_in_a_full_graph(monkeypatch):
    """Issue 53: `kernels.get` runs inside compiled blocks; an alternative imported when chosen broke
    torch.compile (an import cannot be traced), so `--switches`' compiled accelerator set crashed."""
    monkeypatch.setenv("TREX_KERNELS", "rms_norm=fused")
    torch._dynamo.reset()

    def norm(x):
        return kernels.get("rms_norm", x.device.type)(x, None, 1e-6)

    x = torch.randn(4, 8)
    assert torch.equal(torch.compile(norm, fullgraph=True, backend="eager")(x), fused.rms_norm(x, None, 1e-6))


def _mhc_inputs(dev, dtype, B=2, S=5, n=4, d=24):
    g = torch.Generator().manual_seed(0)
    X = torch.randn(B, S, n, d, generator=g)
    params = (torch.randn((2 + n) * n, n * d, generator=g) * 0.1, torch.randn((2 + n) * n, generator=g),
              torch.rand(3, generator=g) + 0.5)
    y, post, comb = torch.randn(B, S, d, generator=g), torch.rand(B, S, n, generator=g) * 2, torch.rand(B, S, n, n, generator=g)
    return [t.to(dev, dtype if t is X or t is y else torch.float32).requires_grad_() for t in (X, *params, y, post, comb)]


@pytest.mark.parametrize("dev", _devices())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mhc_fused_mixing_matches_reference_forward_and_backward(dev, dtype):
    """The fused mHC ops (one RMS factor on the mixes, one sigmoid for pre and post, the expand as one baddbmm)
    against the reference: every output and every input's gradient, in
    fp32 (the math's own precision) to its rounding, and with bf16 streams to the rounding of a bf16 result."""
    from trex.kernels import mhc

    results = []
    for coefficients, expand in ((mhc.reference_coefficients, mhc.reference_expand),
                                 (mhc.fused_coefficients, mhc.fused_expand)):
        X, fn, base, scale, y, post, comb = inputs = _mhc_inputs(dev, dtype)
        outs = [*coefficients(X, fn, base, scale, 6, 1e-6, 1e-6), expand(y, X, post, comb)]
        torch.autograd.backward(outs, [torch.cos(torch.arange(o.numel(), device=dev).view(o.shape).to(o.dtype)) for o in outs])
        results.append(([o.detach().double() for o in outs], [t.grad.double() for t in inputs]))
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 1e-2}
    for got, want in zip(results[1][0] + results[1][1], results[0][0] + results[0][1]):
        torch.testing.assert_close(got, want, **tol)


def test_mhc_is_registered_with_its_reference(monkeypatch):
    from trex.kernels import mhc

    assert kernels.get("mhc_expand", "some_new_vendor") is mhc.fused_expand
    assert kernels.get("mhc_coefficients", "cpu") is mhc.fused_coefficients
    assert kernels.get("mhc_collapse", "cuda") is mhc.reference_collapse  # no fast path (trex.kernels.mhc)
    monkeypatch.setenv("TREX_KERNELS", "reference")
    assert kernels.get("mhc_coefficients", "cuda") is mhc.reference_coefficients
