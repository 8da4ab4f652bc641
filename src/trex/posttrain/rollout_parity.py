"""Trainer-vs-sampler parity of RL rollouts: does the training forward give the sampled tokens the
probabilities the sampler (the decode path) gave them?

Over the sampled tokens of a step, with l_t, l_s the trainer's and the sampler's log-probabilities
of each token and p_t = e^l_t, p_s = e^l_s:

    rollout/pearson        Pearson correlation of p_t and p_s over the step's tokens (1: in step)
    rollout/prob_gap_mean  mean |p_t - p_s|
    rollout/prob_gap_max   max  |p_t - p_s|
    rollout/prob_gap_std   standard deviation of |p_t - p_s|
    rollout/k3_kl          mean k3 estimate of KL(sampler || trainer) on the sampler's tokens,
                           e^d - d - 1 with d = l_t - l_s (unbiased, >= 0 per token)
    logprob_diff           mean |l_t - l_s|;  logprob_diff_max: max |l_t - l_s|

Micro-batches and ranks each add their :func:`parity_sums` (sums, so any split adds up, and one
max), which :func:`parity_metrics` turns into the metrics after the step's reduction. A mismatch
here is what flips MoE routing between sampler and trainer; `trex fidelity compare` judges it
against a reference run (the ``rollout_*`` measures).
"""

from __future__ import annotations

import math

import torch

N_SUMS = 10
"""tokens, sum p_t, sum p_s, sum p_t^2, sum p_s^2, sum p_t p_s, sum gap, sum gap^2, sum k3, sum |l_t - l_s|."""
N_MAXIMA = 2
"""max |p_t - p_s|, max |l_t - l_s|."""
PARITY_METRICS = ("rollout/pearson", "rollout/prob_gap_mean", "rollout/prob_gap_max", "rollout/prob_gap_std",
                  "rollout/k3_kl", "logprob_diff", "logprob_diff_max")
"""The metrics :func:`parity_metrics` gives, in its order."""


def parity_sums(trainer_logp: torch.Tensor, sampler_logp: torch.Tensor,
                mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Over the tokens given (any shape, any device; ``mask``, of the same shape, marks the sampled
    tokens, default all): ([N_SUMS] fp64 sums, [N_MAXIMA] fp64 maxima), on the device: masked
    sums, not indexing, so the shapes stay static and nothing is read on the host."""
    lt, ls = trainer_logp.detach().double(), sampler_logp.detach().double()
    if mask is not None:  # unsampled positions become equal zeros (no gap, no difference), then uncounted
        lt, ls = (torch.where(mask, x, torch.zeros_like(x)) for x in (lt, ls))
    m = torch.ones_like(lt) if mask is None else mask.to(lt.dtype)
    pt, ps = lt.exp(), ls.exp()
    gap = (pt - ps).abs()
    d = lt - ls
    diff = d.abs()
    sums = torch.stack([m.sum(), (pt * m).sum(), (ps * m).sum(), (pt * pt * m).sum(), (ps * ps * m).sum(),
                        (pt * ps * m).sum(), gap.sum(), (gap * gap).sum(), (torch.expm1(d) - d).sum(), diff.sum()])
    zero = lt.new_zeros(())
    maxima = torch.stack([gap.max() if gap.numel() else zero, diff.max() if diff.numel() else zero])
    return sums, maxima


def parity_metrics(sums: list[float], maxima: list[float]) -> dict[str, float]:
    """The metrics of a step from its reduced sums and maxima (host floats). The correlation is
    undefined when either side's probabilities do not vary: then 1.0 if they agree exactly, else nan."""
    n, s_t, s_s, s_tt, s_ss, s_ts, s_gap, s_gap2, s_k3, s_diff = sums
    n = max(n, 1.0)
    cov = s_ts / n - (s_t / n) * (s_s / n)
    var_t, var_s = max(s_tt / n - (s_t / n) ** 2, 0.0), max(s_ss / n - (s_s / n) ** 2, 0.0)
    pearson = cov / math.sqrt(var_t * var_s) if var_t > 0 and var_s > 0 else 1.0 if s_gap == 0 else math.nan
    gap_mean = s_gap / n
    return {"rollout/pearson": min(pearson, 1.0), "rollout/prob_gap_mean": gap_mean,
            "rollout/prob_gap_max": maxima[0], "rollout/prob_gap_std": math.sqrt(max(s_gap2 / n - gap_mean ** 2, 0.0)),
            "rollout/k3_kl": s_k3 / n, "logprob_diff": s_diff / n, "logprob_diff_max": maxima[1]}
