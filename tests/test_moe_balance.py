"""Aux-loss-free router bias update and indexer freezing."""

import pytest
import torch
from torch import nn

from trex.models import build_model
from trex.models.common.moe import Gate, MoEStats
from trex.models.deepseek_v4.config import tiny
from trex.train.moe_balance import freeze_indexer, update_router_bias


def stats(layer, counts):
    return MoEStats(layer, torch.tensor(counts), None)


def test_bias_moves_toward_balance_summed_over_micro_batches():
    model = build_model(tiny())  # layer 0 is hash-routed (no bias), layers 1-3 and mtp.0 score-routed
    gamma = 0.01
    # Micro-batch 2 alone would say expert 0 is underloaded; the step's sum says it is overloaded.
    step_stats = [stats("layers.1", [9, 1, 2, 4, 0, 0, 0, 0]), stats("layers.1", [0, 3, 2, 0, 0, 0, 8, 2]),
                  stats("layers.0", [5, 0, 0, 0, 0, 0, 0, 0])]
    counts = update_router_bias(model, step_stats, gamma)
    assert counts["layers.1"].tolist() == [9, 4, 4, 4, 0, 0, 8, 2]  # mean 3.875
    expected = gamma * torch.tensor([-1.0, -1, -1, -1, 1, 1, -1, 1])
    torch.testing.assert_close(model.layers[1].ffn.gate.bias, expected)
    assert not hasattr(model.layers[0].ffn.gate, "bias")  # hash layer: skipped without error
    assert torch.equal(model.layers[2].ffn.gate.bias, torch.zeros(8))  # no stats, no change
    update_router_bias(model, [stats("layers.1", [2, 2, 2, 2, 2, 2, 2, 2])], gamma)
    torch.testing.assert_close(model.layers[1].ffn.gate.bias, expected)  # balanced: sign 0


def test_reduce_hook_sees_all_layers_once_and_its_sum_is_used():
    model = build_model(tiny())
    calls = []

    def other_rank_adds(t):  # a second rank routed everything to expert 7
        calls.append(t.shape)
        return t + torch.tensor([0, 0, 0, 0, 0, 0, 0, 100.0])

    update_router_bias(model, [stats("layers.2", [1] * 8), stats("layers.3", [1] * 8)], 0.5, reduce=other_rank_adds)
    assert calls == [torch.Size([2, 8])]
    for layer in (2, 3):
        assert model.layers[layer].ffn.gate.bias.tolist() == [0.5] * 7 + [-0.5]


def test_repeated_updates_balance_a_skewed_router():
    torch.manual_seed(0)
    cfg = tiny()
    holder = nn.Module()
    holder.layer = nn.Module()
    holder.layer.ffn = nn.Module()
    holder.layer.ffn.gate = gate = Gate(cfg, hashed=False)
    with torch.no_grad():
        gate.weight.normal_(0, 0.05)
        gate.weight[0] += 0.1  # with inputs of mean 0.5, expert 0 attracts almost every token
    x = torch.randn(512, cfg.hidden_size) + 0.5

    def imbalance():
        counts = torch.bincount(gate(x, None)[1].flatten(), minlength=cfg.n_routed_experts).float()
        return counts, (counts.max() / counts.mean()).item()

    counts, start = imbalance()
    for _ in range(60):
        update_router_bias(holder, [MoEStats("layer", counts, None)], gamma=0.05)
        counts, now = imbalance()
    assert start > 3.0 and now < 1.5, (start, now)


def test_unknown_layer_is_a_clear_error():
    with pytest.raises(ValueError, match="layers.9.ffn.gate"):
        update_router_bias(build_model(tiny()), [stats("layers.9", [1] * 8)], 0.001)


def test_freeze_indexer_and_lm_loss_gives_it_no_gradient():
    torch.manual_seed(0)
    model = build_model(tiny(), seed=0)
    ids = torch.randint(0, 256, (1, 32))
    model(ids, labels=ids).loss.backward()
    indexer = {n for n, p in model.named_parameters() if ".attn.indexer." in n}
    assert indexer and all(p.grad is None for n, p in model.named_parameters() if n in indexer)
    frozen = freeze_indexer(model)
    assert set(frozen) == indexer
    assert all(not p.requires_grad for n, p in model.named_parameters() if n in indexer)
    assert all(p.requires_grad for n, p in model.named_parameters() if n not in indexer)
