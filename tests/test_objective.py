"""The objective interface's shared helpers: per-token log-probs, frozen models, mode selection."""

from __future__ import annotations

import pytest
import torch

from trex import device
from trex.checkpoint import save_pretrained
from trex.models import build_model
from trex.models.deepseek_v4.config import tiny
from trex.parallel.mesh import Parallel
from trex.posttrain import TrainContext, build_objective, load_frozen, token_logprobs
from trex.precision import PrecisionPolicy
from trex.train.config import TrainRecipe, TrainSection


def _ctx(model) -> TrainContext:
    dev = device.detect("cpu")
    return TrainContext(TrainRecipe(), Parallel(), dev, PrecisionPolicy.resolve("fp32", dev), None, model)


def test_token_logprobs_match_a_position_by_position_log_softmax():
    model = build_model(tiny(), seed=0).eval()
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    docs = torch.zeros_like(ids)
    docs[1, 7:] = 1  # row 1 holds two documents: no prediction across the boundary
    got = token_logprobs(model, ids, docs)
    logits = model(ids, doc_ids=docs).logits
    want = torch.zeros(2, 12)
    for b in range(2):
        for t in range(11):
            if docs[b, t] == docs[b, t + 1]:
                want[b, t] = torch.log_softmax(logits[b, t].double(), dim=-1)[ids[b, t + 1]].float()
    assert got.dtype == torch.float32 and got.shape == (2, 12)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert got[1, 6] == 0 and got[:, -1].eq(0).all() and (got[0, :-1] < 0).all()


def test_frozen_copy_of_a_live_model_and_of_a_checkpoint(tmp_path):
    source = build_model(tiny(), seed=0)
    ids = torch.randint(0, 256, (1, 10), generator=torch.Generator().manual_seed(1))
    want = source.eval()(ids).logits
    copy = load_frozen(source, _ctx(source))
    assert not copy.training and not any(p.requires_grad for p in copy.parameters())
    assert torch.equal(copy(ids).logits, want)
    with torch.no_grad():  # a copy, not a view: training the source leaves it alone
        source.embed.weight.add_(1.0)
    assert torch.equal(copy(ids).logits, want)

    save_pretrained(copy, str(tmp_path / "ref"), dtype="fp32")
    loaded = load_frozen(str(tmp_path / "ref"), _ctx(source))
    assert not loaded.training and not any(p.requires_grad for p in loaded.parameters())
    assert torch.equal(loaded(ids).logits, want)
    with pytest.raises(ValueError, match="vocab_size"):
        load_frozen(str(tmp_path / "ref"), _ctx(build_model(tiny(vocab_size=128), seed=0)))


def test_unknown_mode_is_a_clear_error():
    with pytest.raises(ValueError, match=r"train.mode = 'ppo'; expected one of sft, dpo, grpo, distill"):
        TrainSection(mode="ppo")
    with pytest.raises(ValueError, match="train.mode = 'ppo'"):
        build_objective("ppo", _ctx(None))
