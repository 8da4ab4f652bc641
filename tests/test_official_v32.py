"""DeepSeek-V3.2 (DeepSeek Sparse Attention) against DeepSeek's official V3.2-Exp inference code.

tests/fixtures/v32/official.safetensors holds what the official ``inference/model.py`` (github
deepseek-ai/DeepSeek-V3.2-Exp at 3b99a53, with DeepSeek's later fix of the indexer's RoPE to half-split
pairs applied by the harness) computed in fp32 on a tiny config: a query latent, a dense layer then two
MoE layers, 4 expert groups with 2 kept, YaRN (factor 4, mscale 0.8) past the original length, and the
lightning indexer keeping 8 of up to 24 keys per query: the logits of every position and every
parameter's gradient of the mean next-token cross-entropy, and the logits of its incremental decode
(tests/official_v32_harness.py regenerates it and says what it changes in the official run). trex, given
the same weights under the official names and the official ``ModelArgs``, must reproduce them, the decode
through its own cache (trex.models.deepseek_v3.decode).
"""

from __future__ import annotations

import os

import pytest
import torch
from safetensors import safe_open

from test_official_v3 import _rel, gradients_against_the_official, official_model  # V3.2's args name the indexer
from trex.kernels import sparse_mla
from trex.models.common.rope import apply_rope
from trex.models.deepseek_v3 import dsa
from trex.models.deepseek_v3.decode import V3DecodeCache

# the fixture's rows (8 picks of up to 24 keys) are short enough for sparse_mla's mask form; "gathered" runs its
# chunked gathers instead
PATHS = pytest.mark.parametrize("fraction", [sparse_mla.DENSE_TOPK_FRACTION, 2.0], ids=["default", "gathered"])

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "v32", "official.safetensors")


@pytest.fixture(scope="module")
def official():
    with safe_open(FIXTURE, "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


def test_the_fixture_is_sparse_and_far_from_ties(official):
    """Every query past the 8th sees more keys than it keeps; the 8th and 9th index scores and the routers'
    choices are apart by more than fp32 roundings (measured by the harness)."""
    tensors, meta = official
    model = official_model(tensors, meta)
    assert model.cfg.sparse and model.cfg.index_topk < tensors["input_ids"].shape[1]
    assert model.cfg.rope_scaling is not None and model.cfg.n_group > model.cfg.topk_group > 1
    assert float(meta["index_pick_margin"]) > 1e-5 and float(meta["routing_margin"]) > 1e-5
    assert "8631a81" in meta["rope_fix"]


def _interleaved_first(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The unfixed official indexer RoPE: interleaved pairs on the first rope dims."""
    rd = 2 * cos.shape[-1]
    return torch.cat((apply_rope(x[..., :rd], cos, sin), x[..., rd:]), dim=-1)


@PATHS
def test_fp32_logits_match_the_official_forward(official, monkeypatch, fraction):
    """Every position within 1e-4 relative (measured 4.0e-7, gathered 3.9e-7: docs/model.md).
    Both the picks and the RoPE fix matter: attending to every key, or rotating the indexer's dims as
    interleaved pairs (the unfixed official code), misses by far more."""
    monkeypatch.setattr(sparse_mla, "DENSE_TOPK_FRACTION", fraction)
    tensors, meta = official
    model = official_model(tensors, meta)
    ref = tensors["logits.fp32"]
    with torch.no_grad():
        assert _rel(model(tensors["input_ids"]).logits, ref) < 1e-4
        for block in model.layers:
            block.attn.indexer.topk = 64
        assert _rel(model(tensors["input_ids"]).logits, ref) > 1e-2
        for block in model.layers:
            block.attn.indexer.topk = model.cfg.index_topk
        monkeypatch.setattr(dsa, "apply_rope_half", _interleaved_first)
        assert _rel(model(tensors["input_ids"]).logits, ref) > 1e-2


def test_incremental_decode_matches_the_official_decode(official):
    """trex's prefill of the first ``decode_prefill`` ids into a V3DecodeCache (the MLA latents and the
    indexer's keys), then one id per call, against the official ``Transformer.forward(tokens, start_pos)``
    loop, whose indexer keeps each step's top 8 of the cached keys: the logits of the prefill's last
    position and of every step within 1e-4 relative (measured 3.9e-7: docs/model.md)."""
    tensors, meta = official
    model = official_model(tensors, meta)
    ids, P = tensors["input_ids"], int(meta["decode_prefill"])
    assert model.cfg.index_topk < P < ids.shape[1] and float(meta["decode_index_pick_margin"]) > 1e-5
    cache = V3DecodeCache(ids.shape[1] - P)
    with torch.no_grad():
        steps = [model(ids[:, :P], cache=cache).logits[:, -1]]
        steps += [model(ids[:, t:t + 1], cache=cache).logits[:, -1] for t in range(P, ids.shape[1])]
    assert _rel(torch.stack(steps, dim=1), tensors["logits.decode_fp32"]) < 1e-4


@PATHS
def test_gradients_match_autograd_through_the_official_forward(official, monkeypatch, fraction):
    """Every parameter's gradient of the mean next-token cross-entropy within 1e-4 relative of autograd
    through the official modules (measured 1.6e-6 at most, layers.1.ffn.experts.w3; gathered 1.3e-6,
    layers.2.attn.wq_b); the indexer's parameters have none in either (its top-k takes none)."""
    monkeypatch.setattr(sparse_mla, "DENSE_TOPK_FRACTION", fraction)
    params, got, expected = gradients_against_the_official(*official)
    assert not any(".indexer." in n for n in got) and any(".indexer." in n for n in params)
