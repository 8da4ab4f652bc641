"""Trainer-vs-sampler parity statistics against their definitions computed directly (numpy)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from trex.posttrain.rollout_parity import parity_metrics, parity_sums


def test_parity_metrics_are_the_definitions_and_add_up_over_micro_batches():
    g = torch.Generator().manual_seed(0)
    sampler = -torch.rand(200, generator=g, dtype=torch.float64) * 4
    trainer = sampler + 0.05 * torch.randn(200, generator=g, dtype=torch.float64)
    parts = [parity_sums(trainer[i:i + 50], sampler[i:i + 50]) for i in range(0, 200, 50)]
    sums = torch.stack([p[0] for p in parts]).sum(0).tolist()
    maxima = torch.stack([p[1] for p in parts]).max(0).values.tolist()
    m = parity_metrics(sums, maxima)
    pt, ps = np.exp(trainer.numpy()), np.exp(sampler.numpy())
    gap = np.abs(pt - ps)
    d = trainer.numpy() - sampler.numpy()
    assert m["rollout/pearson"] == pytest.approx(np.corrcoef(pt, ps)[0, 1], rel=1e-9)
    assert m["rollout/prob_gap_mean"] == pytest.approx(gap.mean(), rel=1e-12)
    assert m["rollout/prob_gap_max"] == pytest.approx(gap.max(), rel=1e-12)
    assert m["rollout/prob_gap_std"] == pytest.approx(gap.std(), rel=1e-6)
    assert m["rollout/k3_kl"] == pytest.approx(np.mean(np.expm1(d) - d), rel=1e-9)
    assert m["logprob_diff"] == pytest.approx(np.abs(d).mean(), rel=1e-12)
    assert m["logprob_diff_max"] == pytest.approx(np.abs(d).max(), rel=1e-12)


def test_a_mask_counts_only_the_sampled_tokens():
    g = torch.Generator().manual_seed(1)
    trainer, sampler = -torch.rand(2, 8, generator=g) * 3, -torch.rand(2, 8, generator=g) * 3
    mask = torch.rand(2, 8, generator=g) > 0.4
    trainer[~mask] = -float("inf")  # what an unsampled position may hold
    masked = parity_metrics(*(t.tolist() for t in parity_sums(trainer, sampler, mask)))
    picked = parity_metrics(*(t.tolist() for t in parity_sums(trainer[mask], sampler[mask])))
    assert masked == pytest.approx(picked, rel=1e-12)


def test_identical_log_probs_are_in_perfect_parity_and_constant_ones_are_undefined():
    logp = torch.log(torch.tensor([0.1, 0.5, 0.9]))
    m = parity_metrics(*(t.tolist() for t in parity_sums(logp, logp)))
    assert m["rollout/pearson"] == pytest.approx(1.0) and m["rollout/k3_kl"] == 0 and m["rollout/prob_gap_max"] == 0
    flat = torch.full((3,), -1.0)
    assert math.isnan(parity_metrics(*(t.tolist() for t in parity_sums(flat, flat - 0.1)))["rollout/pearson"])
