"""The MFU numerator: FLOPs per token against the model's own parameter shapes."""

from __future__ import annotations

import pytest

from trex.models import build_model, get_preset
from trex.models.deepseek_v4.config import tiny
from trex.models.common.flops import mean_closed_windows, mean_topk, mean_window_keys
from trex.models.flops import flops_per_token


@pytest.mark.parametrize("preset", ["tiny", "deepseek-v4-flash"])
def test_matmul_flops_equal_six_times_active_matmul_parameters(preset):
    cfg = get_preset(preset)
    model = build_model(cfg, device="meta")
    dense = routed = indexer = 0
    for name, p in model.named_parameters():
        if name.startswith("mtp.") or name in ("embed.weight", "head.weight") or p.dim() < 2 or ".ape" in name:
            continue
        if ".indexer." in name:
            indexer += p.numel()
        elif ".ffn.experts." in name:
            routed += p.numel() * cfg.num_experts_per_tok // cfg.n_routed_experts
        else:
            dense += p.numel()
    f = flops_per_token(cfg, seq_len=4096)
    assert f.dense_matmuls == 6 * dense
    assert f.routed_experts == 6 * routed
    assert f.head == 6 * cfg.vocab_size * cfg.hidden_size * (1 + cfg.num_nextn_predict_layers)
    assert f.indexer > 2 * indexer  # projections plus the scores, forward only
    assert flops_per_token(cfg, 4096, training=False).dense_matmuls * 3 == f.dense_matmuls


def test_attention_key_counts_by_brute_force():
    for S, W in [(5, 8), (8, 8), (100, 8), (4096, 128)]:
        assert mean_window_keys(S, W) == pytest.approx(sum(min(t + 1, W) for t in range(S)) / S)
    assert mean_closed_windows(10, 4) == pytest.approx((0 + 0 + 0 + 1 + 1 + 1 + 1 + 2 + 2 + 2) / 10)
    assert mean_topk(12, 4, 2) == pytest.approx((3 * 0 + 4 * 1 + 5 * 2) / 12)


def test_attention_grows_with_length_only_through_compressed_entries():
    cfg = tiny()
    short, long = flops_per_token(cfg, 1024), flops_per_token(cfg, 8192)
    assert long.dense_matmuls == short.dense_matmuls and long.routed_experts == short.routed_experts
    assert long.attention_core > short.attention_core  # HCA sees more entries as S grows
