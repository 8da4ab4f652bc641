"""Every registered fast path against its pure-PyTorch reference."""

from __future__ import annotations

import pytest
import torch

from trex import kernels
from trex.kernels import fused, reference


def test_registry_falls_back_to_reference_and_honours_override(monkeypatch):
    assert kernels.get("rms_norm", "cpu") is reference.rms_norm
    assert kernels.get("grouped_mm", "cuda") is fused.grouped_mm
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
    x = torch.randn(sum(counts), 32, device=dev)
    w = torch.randn(4, 16, 32, device=dev)
    expected = reference.grouped_mm(x, w, counts)
    try:
        got = fused.grouped_mm(x, w, counts)
    except RuntimeError as e:  # torch._grouped_mm is not implemented for this device/dtype
        pytest.skip(f"torch._grouped_mm unavailable on {dev}: {e}")
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    manual = torch.cat([x[:5] @ w[0].T, x[5:16] @ w[2].T, x[16:] @ w[3].T])
    torch.testing.assert_close(expected, manual)
