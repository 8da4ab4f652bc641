"""Parity with the reference no one here wrote: transformers 5.23 DeepseekV4ForCausalLM.

Random-weight tiny models in several configurations are saved with ``save_pretrained`` and
loaded with ``trex.checkpoint.load_pretrained``; logits, loss and every parameter's gradient must
match (MTP, which transformers does not implement, is excluded).
"""

from __future__ import annotations

import pytest
import torch

from hf_oracle import hf_config, random_hf_model
from trex.checkpoint import load_pretrained
from trex.checkpoint.naming import to_trex

S, C, H = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"

CONFIGS = {
    # every layer type, hash + score MoE, hc_mult 4, top-k smaller than the compressed entries
    "all-types-hc4-topk-small": dict(overrides={}, batch=2, seq=37),
    # hc_mult 2, top-k larger than the number of compressed entries, two hash layers, MTP in config
    "hc2-topk-large": dict(overrides=dict(hc_mult=2, index_topk=64, num_hidden_layers=3, layer_types=[C, H, S],
                                          mlp_layer_types=["hash_moe", "hash_moe", "moe"],
                                          num_nextn_predict_layers=1), batch=3, seq=29),
    # longer than several windows, lengths not divisible by the rates, HCA first
    "long-hca-first": dict(overrides=dict(num_hidden_layers=3, layer_types=[H, C, S], index_topk=5,
                                          mlp_layer_types=["hash_moe", "moe", "moe"]), batch=2, seq=83),
}


def _pair(tmp_path, overrides, seed=0):
    ref = random_hf_model(hf_config(**overrides), seed=seed)
    ref.save_pretrained(tmp_path)
    ours = load_pretrained(str(tmp_path), dtype=torch.float32, device="cpu")
    return ref, ours


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_loss_and_gradients_match_transformers(tmp_path, name):
    spec = CONFIGS[name]
    ref, ours = _pair(tmp_path, spec["overrides"])
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, ref.config.vocab_size, (spec["batch"], spec["seq"]), generator=gen)
    labels = ids.clone()
    labels[0, :5] = -100  # unlabelled prompt tokens

    r = ref(ids, labels=labels)
    o = ours(ids, labels=labels)
    assert (r.logits - o.logits).abs().max().item() <= 1e-4
    assert abs(r.loss.item() - o.loss.item()) <= 1e-5 * abs(r.loss.item())

    r.loss.backward()
    o.loss.backward()
    ours_params = dict(ours.named_parameters())
    compared = expected = 0
    for hf_name, p in ref.named_parameters():
        for key, _expert, ref_grad in to_trex(hf_name, p.grad if p.grad is not None else torch.zeros_like(p)):
            grad = ours_params[key].grad
            if p.grad is None:  # the indexer gets no gradient through top-k, in either model
                assert grad is None or grad.abs().max() == 0, key
                continue
            expected += 1
            err = (grad - ref_grad).norm() / ref_grad.norm().clamp(min=1e-12)
            assert err.item() <= 1e-3, f"{key}: relative gradient error {err.item():.2e}"
            compared += 1
    assert compared == expected > 50  # every trained parameter of the main model was compared
    trained = [k for k, p in ours_params.items() if p.grad is not None and not k.startswith("mtp.")]
    assert len(trained) == compared  # and trex trains no parameter the reference does not


def test_short_sequences_without_compressed_entries(tmp_path):
    """Fewer tokens than one compression window: only the sliding window exists."""
    ref, ours = _pair(tmp_path, {})
    ids = torch.randint(0, ref.config.vocab_size, (2, 3))
    assert torch.allclose(ref(ids).logits, ours(ids).logits, atol=1e-4, rtol=0)


def test_transformers_drops_mtp_and_trex_keeps_it(tmp_path):
    ref, ours = _pair(tmp_path, dict(num_nextn_predict_layers=1))
    ids = torch.randint(0, ref.config.vocab_size, (1, 24))
    out = ours(ids, labels=ids)
    assert len(out.mtp_logits) == 1 and out.mtp_logits[0].shape == out.logits.shape
    assert torch.isfinite(out.mtp_loss)
