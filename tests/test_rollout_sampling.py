"""trex.rollout.sample: greedy/top-p/temperature behaviour, determinism, stop tokens, log-probs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from trex.models import build_model
from trex.models.config import tiny
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
