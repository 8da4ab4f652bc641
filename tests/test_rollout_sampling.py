"""trex.rollout.sample: greedy/top-p/temperature behaviour, the draw's distribution and its robustness to
near-ties, determinism, stop tokens, log-probs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from trex.models import build_model
from trex.models.deepseek_v4.config import tiny
from trex.rollout import SamplingParams, sample
from trex.rollout.sampling import choose_tokens

PROMPTS = [[5, 6, 7], list(range(9, 20)), [3]]


@pytest.fixture(scope="module")
def model():
    return build_model(tiny(index_n_heads=16), seed=0).eval()


def test_choose_tokens_follows_temperature_and_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).expand(4000, 4)
    gen = torch.Generator().manual_seed(0)
    tokens, logp = choose_tokens(logits, SamplingParams(top_p=0.7), gen)
    freq = torch.bincount(tokens, minlength=4).float() / len(tokens)
    # top-p 0.7 keeps {0, 1} (0.5 < 0.7 <= 0.8), renormalised to 5/8, 3/8
    torch.testing.assert_close(freq, torch.tensor([5 / 8, 3 / 8, 0, 0]), atol=0.03, rtol=0)
    torch.testing.assert_close(logp, logits.log_softmax(-1).gather(1, tokens[:, None])[:, 0])
    hot, _ = choose_tokens(logits, SamplingParams(temperature=100.0), gen)  # nearly uniform
    assert (torch.bincount(hot, minlength=4).float() / len(hot)).min() > 0.2
    greedy, _ = choose_tokens(logits, SamplingParams(temperature=0.0), None)
    assert bool((greedy == 0).all())


def _sorted_inversion(logits: torch.Tensor, top_p: float, u: torch.Tensor) -> torch.Tensor:
    """The former draw, for contrast: the CDF inverted over the tokens sorted by probability."""
    probs, order = logits.float().softmax(dim=-1).sort(dim=-1, descending=True, stable=True)
    keep = (probs.cumsum(dim=-1) - probs) < top_p
    cdf = (probs * keep).cumsum(dim=-1)
    pick = torch.searchsorted(cdf, u[:, None] * cdf[:, -1:], right=True).clamp(max=keep.sum(-1, keepdim=True) - 1)
    return order.gather(1, pick).squeeze(1)


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_a_near_tie_swapped_by_rounding_noise_does_not_change_the_token(top_p):
    """Tokens 3 and 6 have nearly equal logits (gap 1e-5) and are the most likely; a perturbation of 2e-5
    on token 3 (what another layout's fp32 reduction order does to the logits) swaps their order in a
    sort. Inverted over the sorted tokens, the same uniform then picks the other token of the pair, and
    every later token's interval moves; inverted in vocabulary order (choose_tokens) it picks the same
    token for every uniform, on the pair and elsewhere."""
    base = torch.tensor([0.1, -1.0, 0.4, 2.0, -0.5, 0.0, 2.0 + 1e-5, 0.8])
    a = base[None].expand(64, -1).clone()
    b = a.clone()
    b[:, 3] += 2e-5  # token 3 now above token 6 by 1e-5
    assert bool((a.argmax(-1) == 6).all()) and bool((b.argmax(-1) == 3).all())
    u = (torch.arange(64) + 0.5) / 64  # a grid of uniforms, none within 1e-5 of an interval's edge
    params = SamplingParams(top_p=top_p)
    new_a, _ = choose_tokens(a, params, None, u)
    new_b, _ = choose_tokens(b, params, None, u)
    assert torch.equal(new_a, new_b)
    assert {3, 6} <= set(new_a.tolist())  # the grid lands on both tokens of the pair
    old_a, old_b = _sorted_inversion(a, top_p, u), _sorted_inversion(b, top_p, u)
    on_pair = u < 0.2  # the first sorted interval: the top token, 6 before the swap and 3 after it
    assert bool((old_a[on_pair] == 6).all()) and bool((old_b[on_pair] == 3).all())
    # a row's token depends on its logits and its uniform only, not on the batch around it
    alone = torch.cat([choose_tokens(a[i:i + 1], params, None, u[i:i + 1])[0] for i in range(0, 64, 7)])
    assert torch.equal(alone, new_a[::7])


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 1.0), (1.0, 0.8), (1.3, 0.6)])
def test_the_draw_samples_the_tempered_top_p_distribution(temperature, top_p):
    """The token frequencies over many uniforms are the softmax of logits / temperature restricted to
    top-p's kept set (the smallest set of most likely tokens whose probability reaches top_p) and
    renormalised: with an even grid of uniforms each token's frequency is its interval's width, so they
    match to 1/n; with the generator's uniforms to within 5 standard errors."""
    logits = torch.randn(2, 24, generator=torch.Generator().manual_seed(7)) * 2
    probs = (logits.double() / temperature).softmax(-1)
    ranked, order = probs.sort(-1, descending=True)
    kept = torch.zeros_like(probs, dtype=torch.bool).scatter(1, order, (ranked.cumsum(-1) - ranked) < top_p)
    expected = probs * kept / (probs * kept).sum(-1, keepdim=True)
    if top_p < 1:
        assert bool((kept.sum(-1) < 24).all()) and bool((kept.sum(-1) > 1).all())  # top-p cuts something
    n = 200_000
    params = SamplingParams(temperature=temperature, top_p=top_p)
    grid = (torch.arange(n, dtype=torch.float64) + 0.5) / n
    gen = torch.Generator().manual_seed(0)
    for row in range(2):
        rows = logits[row][None].expand(n, -1)
        tokens, _ = choose_tokens(rows, params, None, grid.float())
        freq = torch.bincount(tokens, minlength=24).double() / n
        torch.testing.assert_close(freq, expected[row], atol=2e-5, rtol=0)
        assert bool((freq[~kept[row]] == 0).all())
        tokens, _ = choose_tokens(rows, params, gen)
        freq = torch.bincount(tokens, minlength=24).double() / n
        se = (expected[row] * (1 - expected[row]) / n).sqrt()
        assert bool(((freq - expected[row]).abs() <= 5 * se + 1e-12).all()), (freq, expected[row])


@pytest.mark.slow
def test_tiny_top_p_is_greedy_and_same_seed_gives_same_samples(model):
    params = SamplingParams(temperature=1.0, max_new_tokens=6)
    greedy = sample(model, PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=6), pad_id=0)
    narrow = sample(model, PROMPTS, SamplingParams(top_p=1e-6, max_new_tokens=6), pad_id=0,
                    generator=torch.Generator().manual_seed(3))
    assert narrow.completion_ids == greedy.completion_ids
    a = sample(model, PROMPTS, params, pad_id=0, generator=torch.Generator().manual_seed(1))
    b = sample(model, PROMPTS, params, pad_id=0, generator=torch.Generator().manual_seed(1))
    c = sample(model, PROMPTS, params, pad_id=0, generator=torch.Generator().manual_seed(2))
    assert a == b
    assert a.completion_ids != c.completion_ids
    assert a.prompt_ids == PROMPTS and a.finished == [False] * 3


@pytest.mark.slow
def test_stop_tokens_end_rows_and_max_new_tokens_is_respected(model):
    free = sample(model, PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=5), pad_id=0)
    assert [len(c) for c in free.completion_ids] == [5, 5, 5]
    stop = free.completion_ids[1][2]  # row 1 stops at its third token (others may stop too)
    out = sample(model, PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=5, stop_ids=(stop,)),
                 pad_id=0, batch_size=2)
    for full, got, fin in zip(free.completion_ids, out.completion_ids, out.finished):
        n = full.index(stop) + 1 if stop in full else len(full)
        assert got == full[:n] and fin == (stop in full)
    assert out.finished[1] and out.completion_ids[1][-1] == stop


def test_logprobs_equal_log_softmax_of_a_full_forward(model):
    out = sample(model, PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=5), pad_id=0,
                 generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for prompt, completion, lps in zip(PROMPTS, out.completion_ids, out.logprobs):
            ids = torch.tensor([prompt + completion])
            logp = F.log_softmax(model(ids).logits[0].float(), dim=-1)
            expected = logp[len(prompt) - 1:-1].gather(1, torch.tensor(completion)[:, None])[:, 0]
            torch.testing.assert_close(torch.tensor(lps), expected, atol=1e-5, rtol=0)


def test_bad_input_is_rejected(model):
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        sample(model, [[1], []], SamplingParams(), pad_id=0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1.0)
