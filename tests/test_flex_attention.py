"""The FlexAttention sparse attention (trex.kernels.flex_attention) against its reference.

CPU runs the forward only (FlexAttention's eager fallback); forward + backward run where an
accelerator is present (check_backward)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from trex.kernels import flex_attention as fx
from trex.kernels.sparse_attention import reference
from trex.models.deepseek_v4.context import SeqContext

B, S, H, C = 2, 96, 4, 32


def model_visibility(doc: torch.Tensor, m: int) -> torch.Tensor:
    """comp_mask [B, S, N] exactly as the model builds it: SeqContext's WindowLayout.visible."""
    t = torch.arange(doc.shape[1])
    new_doc = torch.ones_like(doc, dtype=torch.bool)
    new_doc[:, 1:] = doc[:, 1:] != doc[:, :-1]
    pos = t - torch.where(new_doc, t, torch.zeros_like(t)).cummax(dim=1).values
    ctx = SimpleNamespace(full_pos=pos, rope_at=lambda positions, kind: None)
    return SeqContext._build_layout(ctx, m, 1).visible(0, doc.shape[1])


def _case(kind: str, m: int = 4, dtype=torch.float32) -> dict:
    case = fx.make_case(kind, B=B, S=S, H=H, c=C, m=m, k=6, dtype=dtype)
    if kind == "hca":
        case["comp_mask"] = model_visibility(case["doc"], m)
    return case


def test_window_visibility_is_the_models_layout():
    doc = torch.zeros(2, 101, dtype=torch.long)
    doc[0, 30:], doc[0, 55:], doc[1, 7:] = 1, 2, 1
    for m in (4, 8, 128):
        assert torch.equal(fx.window_visibility(doc, m), model_visibility(doc, m))


def test_flex_lse_is_natural_log():
    """The sink is folded in as sigmoid(lse - sink): that needs lse = ln(sum exp(scaled scores))."""
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 2, 40, 16, generator=g), torch.randn(1, 1, 40, 16, generator=g)
    causal = torch.ones(40, 40, dtype=torch.bool).tril()
    bm = fx._fa.create_block_mask(lambda b, h, i, j: j <= i, 1, None, 40, 40, device="cpu")
    out, lse = fx._flex(q, k, bm, 0.3, use_compile=False)
    scores = (q @ k.transpose(-1, -2) * 0.3).masked_fill(~causal, float("-inf"))
    torch.testing.assert_close(lse, scores.logsumexp(-1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, scores.softmax(-1) @ k, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [16, 40])
@pytest.mark.parametrize("kind", ["sliding", "hca", "csa"])
def test_forward_matches_reference(kind, window):
    case = _case(kind)
    assert bool((case["doc"][0, 1:] != case["doc"][0, :-1]).any())  # packed documents in row 0
    if kind == "csa":
        assert bool((~case["comp_mask"]).any()) and bool(case["comp_mask"].any())  # some picks invalid
    if kind == "hca":
        assert bool(case["comp_mask"].any()) and not bool(case["comp_mask"].all())
    with torch.no_grad():
        got = fx.flex_sparse_attention(scale=C**-0.5, window=window, **case)
    expected = reference(scale=C**-0.5, window=window, **case)
    assert got.shape == expected.shape and got.dtype == expected.dtype and got.is_contiguous()
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_forward_bf16_matches_reference():
    case = _case("hca", m=8, dtype=torch.bfloat16)
    with torch.no_grad():
        got = fx.flex_sparse_attention(scale=C**-0.5, window=24, **case)
    expected = reference(scale=C**-0.5, window=24, **case)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=2e-2)


def test_rows_that_see_nothing_give_zero():
    """window 0 hides every raw key: queries before the first closed window see no key at all."""
    case = _case("hca")
    with torch.no_grad():
        got = fx.flex_sparse_attention(scale=C**-0.5, window=0, **case)
    expected = reference(scale=C**-0.5, window=0, **case)
    empty = ~case["comp_mask"].any(-1)  # [B, S]
    assert bool(empty.any())
    assert torch.isfinite(got).all()
    assert bool((got[empty] == 0).all())
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_picks_to_mask_keeps_a_valid_pick_over_an_invalid_duplicate():
    idx = torch.tensor([[[2, 2, 0], [1, 3, 1]]])
    valid = torch.tensor([[[False, True, False], [True, False, False]]])
    mask = fx.picks_to_mask(valid, idx, 4)
    assert mask.tolist() == [[[False, False, True, False], [False, True, False, False]]]


def test_cpu_backward_is_refused_clearly():
    case = _case("sliding")
    case["q"].requires_grad_(True)
    with pytest.raises(NotImplementedError, match="no backward on CPU"):
        fx.flex_sparse_attention(scale=C**-0.5, window=16, **case)
    with pytest.raises(NotImplementedError, match="no backward on CPU"):
        fx.check_backward("cpu", S=32, kinds=("sliding",), windows=(8,))


@pytest.mark.skipif(not torch.accelerator.is_available(),
                    reason="needs an accelerator: FlexAttention has no backward on CPU")
def test_backward_matches_reference_on_accelerator():
    dev = torch.accelerator.current_accelerator()
    for case, errs in fx.check_backward(dev, S=128, c=32, windows=(16, 40)).items():
        for name in ("out", "q", "kv", "sink", "compressed"):
            if name in errs:
                assert errs[f"{name}_rel"] < 1e-4, (case, name, errs)


def test_sink_factor_is_exact_in_closed_form():
    """O = O_flex * sigmoid(lse - sink) equals the softmax with the sink as an extra logit."""
    scores, sink = torch.randn(5, 7, dtype=torch.float64), torch.randn(5, 1, dtype=torch.float64)
    v = torch.randn(7, 3, dtype=torch.float64)
    with_sink = torch.cat([scores, sink], -1).softmax(-1)[:, :-1] @ v
    lse = scores.logsumexp(-1, keepdim=True)
    folded = (scores.softmax(-1) @ v) * torch.sigmoid(lse - sink)
    torch.testing.assert_close(folded, with_sink)
    assert math.isclose(float(torch.sigmoid(torch.tensor(-math.inf))), 0.0)
