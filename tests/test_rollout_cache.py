"""The incremental decode caches reproduce full recomputation: logits at every step and greedy tokens.

Tiny models cover sliding, CSA (indexer top-k smaller and larger than the number of compressed
entries) and HCA layers, hash and score MoE, hc_mult 2 and 4, a batch of prompts of different
lengths, and enough new tokens that several CSA (m=4) and HCA (m'=8 or 4) windows close while
decoding. The indexer gets 16 heads: with 4, two entries often both score exactly 0 (every head's
ReLU is 0) and top-k breaks such ties arbitrarily, in training as well.
"""

from __future__ import annotations

import pytest
import torch

from trex.models import build_model
from trex.models.common.config import HASH_MOE, MOE
from trex.models.deepseek_v4.config import CSA, HCA, SLIDING, tiny
from trex.models.deepseek_v4.decode import DecodeCache
from trex.rollout import SamplingParams, sample
from trex.rollout.sampling import left_pad

PROMPTS = [[5, 6, 7], list(range(9, 30)), [3], list(range(40, 53))]
CONFIGS = {
    "hc4 topk<entries hca8": dict(index_n_heads=16),
    "hc2 topk>entries hca4": dict(index_n_heads=16, hc_mult=2, index_topk=64, compress_rates={CSA: 4, HCA: 4},
                                  layer_types=[HCA, CSA, SLIDING, HCA], mlp_layer_types=[HASH_MOE, HASH_MOE, MOE, MOE]),
}


def _model(overrides):
    return build_model(tiny(**overrides), seed=0).eval()


def _decode_against_recompute(model, cache, label: str, snapshot, prompts=PROMPTS) -> dict:
    """Prefill ``prompts`` (left-padded) into ``cache``, then ``cache.max_new_tokens`` greedy tokens: at every step
    the cached logits equal a forward over the whole rows within 1e-5. Returns ``snapshot(cache)`` taken
    right after the prefill."""
    ids, docs = left_pad(prompts, pad_id=0, device=torch.device("cpu"))
    with torch.no_grad():
        cached = model(ids, doc_ids=docs, cache=cache).logits
        assert cached.shape == (len(prompts), 1, model.cfg.vocab_size)
        at_prefill = snapshot(cache)
        for step in range(cache.max_new_tokens):
            full = model(ids, doc_ids=docs).logits[:, -1]
            torch.testing.assert_close(cached[:, 0], full, rtol=0, atol=1e-5, msg=f"{label}: step {step}")
            tok = full.argmax(dim=-1, keepdim=True)
            ids, docs = torch.cat([ids, tok], dim=1), torch.cat([docs, torch.ones_like(tok)], dim=1)
            cached = model(tok, cache=cache).logits
    return at_prefill


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CONFIGS))
def test_cached_logits_match_full_recompute_at_every_step(name):
    cache = DecodeCache(16)
    at_prefill = _decode_against_recompute(_model(CONFIGS[name]), cache, name, lambda c: {
        attn: st.compressor.count.clone() for attn, st in c.layers.items() if st.compressor})
    # every row closed at least two windows of every compressed layer while decoding
    assert at_prefill
    for attn, before in at_prefill.items():
        assert bool((cache.layers[attn].compressor.count - before >= 2).all())


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CONFIGS))
def test_cached_greedy_equals_recompute_token_for_token(name):
    model = _model(CONFIGS[name])
    params = SamplingParams(temperature=0.0, max_new_tokens=16)
    cached = sample(model, PROMPTS, params, pad_id=0)
    full = sample(model, PROMPTS, params, pad_id=0, use_cache=False)
    assert cached.completion_ids == full.completion_ids
    assert all(len(c) == 16 for c in cached.completion_ids)
    for a, b in zip(cached.logprobs, full.logprobs):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=1e-5)


def _v3_model_and_cache():
    from trex.models.deepseek_v3.decode import V3DecodeCache
    from trex.models.registry import get_preset

    return build_model(get_preset("tiny-moonlight"), seed=0).eval(), V3DecodeCache


@pytest.mark.parametrize("family", ["v4", "v3"])
def test_cache_refuses_more_steps_than_it_was_sized_for_and_labels(family):
    model, Cache = (_model(CONFIGS["hc4 topk<entries hca8"]), DecodeCache) if family == "v4" else _v3_model_and_cache()
    ids = torch.tensor([[5, 6, 7]])
    cache = Cache(1)
    with torch.no_grad():
        with pytest.raises(ValueError, match="no labels"):
            model(ids, labels=ids, cache=cache)
        model(ids, cache=cache)
        model(ids[:, :1], cache=cache)
        with pytest.raises(ValueError, match="sized for 1 decode steps"):
            model(ids[:, :1], cache=cache)
    with pytest.raises(ValueError, match=r"shape \[B, 1\]"), torch.no_grad():
        cache = Cache(4)
        model(ids, cache=cache)
        model(ids, cache=cache)


@pytest.mark.parametrize("quant", [False, True], ids=["fp32", "served-rounding"])
def test_v41_cached_logits_match_full_recompute_at_every_step(quant):
    """DeepSeek-V4.1's cache (trex.models.deepseek_v4.decode_v41) on tiny-v4.1: window-only layers with Engram, ratio-2
    and ratio-1 KV sources whose entries later layers read, index sources reusing picks, the candidate
    pool (3 blocks of 4 among up to 14), prompts of 1 to 21 tokens left-padded in one batch; 12 new
    tokens close several groups of every source. At every step the cached logits equal the whole row's
    within 1e-5, with the served rounding points simulated too (FP8 window KV, FP4 entries, FP8/FP4
    weights and activations), except the indexer's: its bf16 scores (as served) tie often enough that a
    one-row and a whole-row score pick different entries (measured over 20 steps: 16 apart with this config's
    8 index heads, 2 with 32, none at fp32), as any two batchings of the served indexer would."""
    from trex.models.common.linear import QuantSim
    from trex.models.deepseek_v4.config_v41 import tiny_v41
    from trex.models.deepseek_v4.decode_v41 import V41DecodeCache

    model = build_model(tiny_v41(hc_sinkhorn_iters=3), seed=0).eval()  # 3 Sinkhorn rounds: the same ops, faster
    if quant:
        model.set_quant(QuantSim(experts=True, linears=True, activations=True, kv=True))
    cache = V41DecodeCache(12)
    at_prefill = _decode_against_recompute(model, cache, "v4.1", lambda c: {
        attn: st.source.hi.clone() for attn, st in c.layers.items() if st.source is not None})
    sources = {attn: st.source for attn, st in cache.layers.items() if st.source is not None}
    assert len(sources) == 3  # the tiny config's KV sources: two of ratio 2, one of ratio 1
    for attn, before in at_prefill.items():
        assert bool((sources[attn].hi - before >= 6).all())  # each closed at least 6 groups while decoding


# ---- DeepSeek-V3's MLA cache (trex.models.deepseek_v3.decode) ----------------------------------------------
V3_PROMPTS = [[5, 6, 7], list(range(9, 69)), [3], list(range(40, 53))]  # the 60-token row decodes past 64


@pytest.mark.parametrize("preset", ["tiny-v3", "tiny-moonlight", "tiny-v3.2"])
def test_v3_cached_logits_match_full_recompute_at_every_step(preset):
    """The absorbed decode over the cached latents and k_pe, prompts of 1 to 60 tokens left-padded in one
    batch, 8 new tokens: at every step the cached logits equal the whole rows' forward within 1e-5
    (measured 4e-7 relative). tiny-v3 (query latent, YaRN over 64 positions: the long row decodes past
    them, MTP unused), tiny-moonlight (one query projection, no YaRN) and tiny-v3.2 (the indexer's keys
    cached too, each step attending to its top 8 of up to 68 slots)."""
    from trex.models.deepseek_v3.decode import V3DecodeCache
    from trex.models.registry import get_preset

    model = build_model(get_preset(preset), seed=0).eval()
    if model.cfg.rope_scaling is not None:
        assert len(V3_PROMPTS[1]) + 8 > model.cfg.rope_scaling.original_max_position_embeddings
    start = _decode_against_recompute(model, V3DecodeCache(8), preset, lambda c: c.start.clone(), V3_PROMPTS)
    width = max(map(len, V3_PROMPTS))
    assert start.tolist() == [width - len(p) for p in V3_PROMPTS]  # each row sees its prompt only


def test_v3_sampler_decodes_through_the_cache(monkeypatch):
    """The sampler on tiny-v3 prefills once and then feeds one token per row per forward (a fallback to
    re-running the prefix would feed the whole rows); its greedy tokens, log-probs and recorded experts
    (routing replay) are the re-running sampler's."""
    from trex.models.deepseek_v3.model import DeepseekV3
    from trex.models.registry import get_preset

    model = build_model(get_preset("tiny-v3"), seed=0).eval()
    widths = []
    forward = DeepseekV3.forward

    def counting(self, input_ids, *args, **kwargs):
        widths.append((input_ids.shape[1], kwargs.get("cache") is not None))
        return forward(self, input_ids, *args, **kwargs)

    monkeypatch.setattr(DeepseekV3, "forward", counting)
    params = SamplingParams(temperature=0.0, max_new_tokens=6)
    cached = sample(model, V3_PROMPTS, params, pad_id=0, record_routes=True)
    assert widths == [(60, True)] + [(1, True)] * 5
    widths.clear()
    full = sample(model, V3_PROMPTS, params, pad_id=0, use_cache=False, record_routes=True)
    assert widths == [(60 + i, False) for i in range(6)]
    assert cached.completion_ids == full.completion_ids
    for a, b in zip(cached.logprobs, full.logprobs):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=1e-5)
    assert set(cached.routes[0]) == {"layers.1", "layers.2"}  # the dense first layer routes nothing
    for a, b in zip(cached.routes, full.routes):
        assert all(torch.equal(a[name], b[name]) for name in a)
