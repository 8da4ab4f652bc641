import torch

from trex.models import build_model
from trex.models.deepseek_v4.config import tiny
from trex.rollout.generate import greedy_generate


def _greedy_one(model, prompt, n):
    ids = torch.tensor([prompt])
    out = []
    for _ in range(n):
        nxt = int(model(ids).logits[0, -1].argmax())
        out.append(nxt)
        ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    return out


def test_batched_left_padded_generation_equals_one_prompt_at_a_time():
    model = build_model(tiny(), seed=0).eval()
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19], [3]]
    with torch.no_grad():
        expected = [_greedy_one(model, p, 6) for p in prompts]
    got = greedy_generate(model, prompts, max_new_tokens=6, stop_id=-1, pad_id=0)
    assert got == expected


def test_generation_stops_at_the_stop_token():
    model = build_model(tiny(), seed=0).eval()
    with torch.no_grad():
        first = _greedy_one(model, [5, 6, 7], 1)[0]
    assert greedy_generate(model, [[5, 6, 7]], max_new_tokens=5, stop_id=first, pad_id=0) == [[]]
