"""token_nll and linear_fp32: same values and gradients as the plain PyTorch ops, less kept for backward."""

import pytest
import torch
import torch.nn.functional as F

from trex.models.common import cross_entropy
from trex.models.common.cross_entropy import IGNORE_INDEX, head_nll, token_nll
from trex.models.common.linear import linear_fp32


def _saved_storages(fn):
    """(result, {data_ptr: nbytes}) of the tensors autograd saves while running fn()."""
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, saved


def test_token_nll_matches_cross_entropy_values_and_gradients():
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 7, 50, generator=g, dtype=torch.float64) * 4).requires_grad_()
    targets = torch.randint(0, 50, (3, 7), generator=g)
    targets[0, :3] = IGNORE_INDEX
    targets[2, -1] = IGNORE_INDEX
    upstream = torch.randn(3, 7, generator=g, dtype=torch.float64)

    ours = token_nll(logits, targets)
    (ours * upstream).sum().backward()
    ours_grad, logits.grad = logits.grad, None
    ref = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX,
                          reduction="none").view(3, 7)
    (ref * upstream).sum().backward()

    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours.double(), ref, rtol=1e-6, atol=1e-6)
    assert (ours[targets == IGNORE_INDEX] == 0).all()
    torch.testing.assert_close(ours_grad, logits.grad, rtol=1e-5, atol=1e-6)
    assert (ours_grad[0, :3] == 0).all()  # ignored tokens get no gradient


def test_token_nll_keeps_no_vocabulary_sized_tensor_besides_the_logits():
    logits = torch.randn(64, 1000, requires_grad=True)
    targets = torch.randint(0, 1000, (64,))
    _, saved = _saved_storages(lambda: token_nll(logits, targets))
    big = {ptr for ptr, n in saved.items() if n >= logits.numel() * 4}
    assert big == {logits.untyped_storage().data_ptr()}  # the caller's own logits, no log-softmax copy
    _, ref_saved = _saved_storages(lambda: F.cross_entropy(logits, targets))
    assert any(n >= logits.numel() * 4 and p != logits.untyped_storage().data_ptr() for p, n in ref_saved.items())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_fp32_matches_autograd_and_keeps_no_fp32_weight_copy(dtype):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 5, 16, generator=g).to(dtype).requires_grad_()
    w = torch.randn(300, 16, generator=g).to(dtype).requires_grad_()
    upstream = torch.randn(2, 5, 300, generator=g)

    y, saved = _saved_storages(lambda: linear_fp32(x, w))
    (y * upstream).sum().backward()
    dx, dw = x.grad, w.grad
    x.grad = w.grad = None
    ref = F.linear(x.float(), w.float())
    (ref * upstream).sum().backward()

    assert y.dtype == torch.float32
    torch.testing.assert_close(y, ref)
    assert dx.dtype == dtype and dw.dtype == dtype
    torch.testing.assert_close(dx, x.grad)
    torch.testing.assert_close(dw, w.grad)
    assert set(saved) == {x.untyped_storage().data_ptr(), w.untyped_storage().data_ptr()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block,rows", [(4, 300), (5, 64), (18, 300)])
def test_head_nll_equals_the_head_then_the_loss_over_several_tiles(dtype, block, rows, monkeypatch):
    """Token blocks with a rest (4 and 5 of 18 tokens), vocabulary slices with a rest (64 of 300: targets
    in every slice), and one tile."""
    g = torch.Generator().manual_seed(2)
    V = 300
    monkeypatch.setattr(cross_entropy, "HEAD_BLOCK_TOKENS", block)
    monkeypatch.setattr(cross_entropy, "HEAD_TILE_BYTES", 4 * block * rows)
    assert cross_entropy.head_tiles(18, V) == (block, rows)
    h = (torch.randn(3, 6, 16, generator=g) * 2).to(dtype).requires_grad_()
    w = torch.randn(V, 16, generator=g).to(dtype).requires_grad_()
    targets = torch.randint(0, V, (3, 6), generator=g)
    targets[1, :4] = IGNORE_INDEX
    upstream = torch.randn(3, 6, generator=g)

    ours = head_nll(h, w, targets)
    (ours * upstream).sum().backward()
    dh, dw = h.grad, w.grad
    h.grad = w.grad = None
    ref = token_nll(linear_fp32(h, w), targets)
    (ref * upstream).sum().backward()

    assert ours.dtype == torch.float32 and dh.dtype == dtype and dw.dtype == dtype
    torch.testing.assert_close(ours, ref)
    assert (ours[targets == IGNORE_INDEX] == 0).all()
    tol = {} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(dh, h.grad, **tol)
    torch.testing.assert_close(dw, w.grad, **tol)
    assert (dh[1, :4] == 0).all()  # ignored tokens send nothing back


def test_head_tiles_hold_a_token_block_and_bound_the_logits():
    V = 129_280  # V4's vocabulary: 4,096-token blocks, 8,192-row slices (128 MiB of fp32 logits)
    assert cross_entropy.head_tiles(1 << 20, V) == (4096, 8192)
    assert cross_entropy.head_tiles(100, V) == (100, V)  # a short input: the whole vocabulary in a slice, if it fits
    assert cross_entropy.head_tiles(1 << 20, 1000) == (33_554, 1000)  # a small vocabulary: more tokens per block
    for n, v in [(1 << 20, V), (100, V), (1 << 20, 1000), (3, 7)]:
        block, rows = cross_entropy.head_tiles(n, v)
        assert 4 * block * rows <= cross_entropy.HEAD_TILE_BYTES and block <= n and rows <= v


def test_head_nll_keeps_no_vocabulary_sized_tensor():
    h = torch.randn(64, 16, requires_grad=True)
    w = torch.randn(1000, 16, requires_grad=True)
    targets = torch.randint(0, 1000, (64,))
    _, saved = _saved_storages(lambda: head_nll(h, w, targets))
    assert max(saved.values()) == w.numel() * 4  # the head's own weight; no [64, 1000] logits
    assert w.untyped_storage().data_ptr() in saved and h.untyped_storage().data_ptr() in saved
