"""GRPO math: group-normalised advantages, the clipped policy-ratio loss, the k3 KL estimator and
the per-token statistics an RL step logs. Pure tensor functions; the objective that samples,
scores and calls them is trex.posttrain.grpo.

Shapes: N prompts, G samples per prompt (B = N * G completions), T completion tokens (padded);
``mask`` [B, T] is 1 on real completion tokens. Log-probabilities are natural-log, fp32.

The loss of one step, per token t of completion b (DAPO's asymmetric clip, DeepSeekMath's k3 KL):

    ratio = exp(logp - old_logp)
    pg    = -min(ratio * A_b, clip(ratio, 1 - eps_low, 1 + eps_high) * A_b)
    kl    = exp(ref_logp - logp) - (ref_logp - logp) - 1          (k3, >= 0, unbiased for KL(pi||ref))
    loss  = sum_{b,t} weight_{b,t} * (pg + beta * kl)

with ``weight`` from :func:`token_weights` (token-, sequence- or constant-length aggregation), whose
denominators are global counts, so any split of the batch into micro-batches and ranks gives the
same gradient.

Off-policy correction (:func:`rollout_correction`): the completions come from the rollout engine's
policy pi_rollout, which is not the trainer's pi_old once the engine is another process, precision or
kernel set (verl's rollout-correction docs call assuming pi_old = pi_rollout the common mistake behind
RL collapse). With rho = pi_old / pi_rollout on each sampled token:

* ``decoupled``: old_logp is the trainer's recompute; each token's term is multiplied by the truncated
  importance weight min(rho, C) (``level`` "token"), or every token of a completion by min(prod rho, C)
  ("sequence"; truncated IS, TIS);
* ``bypass``: the engine's log-probs are old_logp, so the clipped ratio pi_theta / pi_rollout both
  corrects and bounds the update;

and in both, masked IS (IcePop): a token whose rho (at "sequence": a completion whose geometric mean
of rho) lies outside [mask_low, mask_high] carries no loss.
"""

from __future__ import annotations

import math
import typing
from dataclasses import dataclass
from typing import Literal

import torch

Aggregation = Literal["token", "sequence", "constant"]
AGGREGATIONS = typing.get_args(Aggregation)


def group_advantages(rewards: torch.Tensor, group_size: int, scale_by_std: bool = True,
                     eps: float = 1e-6) -> torch.Tensor:
    """Advantages [B] of rewards [B] laid out prompt-major (the G samples of a prompt adjacent).

    A = r - mean(group), divided by (std(group) + eps) when ``scale_by_std`` (std: unbiased, as in
    DeepSeekMath/TRL; Dr. GRPO drops the division). A group whose rewards are all equal gets A = 0.
    """
    if group_size < 2:
        raise ValueError(f"grpo: group_size must be >= 2 to normalise within a group, got {group_size}")
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"grpo: rewards of shape {tuple(rewards.shape)} do not split into groups of {group_size}")
    groups = rewards.float().view(-1, group_size)
    centred = groups - groups.mean(dim=1, keepdim=True)
    std = groups.std(dim=1, keepdim=True)
    if scale_by_std:
        centred = centred / (std + eps)
    return torch.where(std > 0, centred, torch.zeros_like(centred)).flatten()


def token_weights(mask: torch.Tensor, aggregation: str, n_sequences: int, n_tokens: int,
                  max_len: int) -> torch.Tensor:
    """Weights [B, T] that turn per-token terms into the step loss ``sum(weight * term)``.

    ``n_sequences`` and ``n_tokens`` count the whole step (all micro-batches, all ranks):

    * "token":    1 / n_tokens (every token counts the same; DAPO);
    * "sequence": 1 / (len_b * n_sequences) (mean over each completion, then over completions; GRPO);
    * "constant": 1 / (max_len * n_sequences) (no length bias; Dr. GRPO).
    """
    mask = mask.float()
    if aggregation == "token":
        return mask / max(n_tokens, 1)
    if aggregation == "sequence":
        return mask / (mask.sum(dim=1, keepdim=True).clamp(min=1) * max(n_sequences, 1))
    if aggregation == "constant":
        return mask / (max_len * max(n_sequences, 1))
    raise ValueError(f"grpo: aggregation {aggregation!r}; expected one of {', '.join(AGGREGATIONS)}")


Correction = Literal["none", "decoupled", "bypass"]
CORRECTIONS = typing.get_args(Correction)
ISLevel = Literal["token", "sequence"]


def rollout_correction(old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor, level: str,
                       cap: float, mask_low: float, mask_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The decoupled mode's importance weights and the masked-IS keep mask, both [B, T] and detached.

    old_logp, rollout_logp [B, T] fp32 (the trainer's and the engine's log-probs of the sampled tokens),
    mask [B, T] the completion tokens. weights: min(rho, cap) per token ("token") or min(prod_t rho, cap)
    on every token of a completion ("sequence"); keep: mask without the tokens (completions) whose rho
    (geometric mean of rho) is outside [mask_low, mask_high]."""
    mask = mask.bool()
    log_rho = torch.where(mask, old_logp.float() - rollout_logp.float(), torch.zeros((), device=old_logp.device))
    if level == "token":
        weights = torch.exp(log_rho.clamp(max=math.log(cap)))
        keep = mask & (log_rho >= _log(mask_low)) & (log_rho <= _log(mask_high))
    elif level == "sequence":
        total = log_rho.sum(dim=1, keepdim=True)
        weights = torch.exp(total.clamp(max=math.log(cap))).expand_as(log_rho)
        geo = total / mask.sum(dim=1, keepdim=True).clamp(min=1)
        keep = mask & (geo >= _log(mask_low)) & (geo <= _log(mask_high))
    else:
        raise ValueError(f"grpo: correction level {level!r}; expected token or sequence")
    return torch.where(mask, weights, torch.zeros_like(weights)).detach(), keep


def _log(x: float) -> float:
    return -math.inf if x <= 0 else math.inf if math.isinf(x) else math.log(x)


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi || ref) on tokens sampled from pi: e^d - d - 1, d = ref - logp."""
    d = ref_logp.float() - logp.float()
    return torch.expm1(d) - d


@dataclass
class PolicyLoss:
    """One micro-batch's share of the step loss and its token statistics (sums, not means, so
    micro-batches and ranks add up; divide by the token count to report)."""
    loss: torch.Tensor        # scalar, differentiable
    pg_loss: torch.Tensor     # scalar, detached: the policy-gradient part of ``loss``
    kl_sum: torch.Tensor      # scalar, detached: sum over tokens of k3 (0 without a reference)
    clipped: torch.Tensor     # scalar, detached: tokens whose clipped term was the active one
    ratio_sum: torch.Tensor   # scalar, detached: sum over tokens of the ratio


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, weights: torch.Tensor,
                mask: torch.Tensor, eps_low: float = 0.2, eps_high: float = 0.2,
                ref_logp: torch.Tensor | None = None, kl_coef: float = 0.0,
                is_weights: torch.Tensor | None = None) -> PolicyLoss:
    """The clipped surrogate (times ``is_weights``, the decoupled correction's, when given; plus ``kl_coef``
    * k3 KL to the reference) weighted by ``weights``.

    logp [B, T] (differentiable), old_logp [B, T], ref_logp [B, T] or None, advantages [B],
    weights and mask [B, T] (see :func:`token_weights`), is_weights [B, T] or None.
    """
    mask = mask.bool()
    logp = logp.float()
    adv = advantages.float()[:, None]
    ratio = torch.exp(logp - old_logp.float())
    clipped_ratio = ratio.clamp(1 - eps_low, 1 + eps_high)
    pg = -torch.minimum(ratio * adv, clipped_ratio * adv)
    if is_weights is not None:
        pg = pg * is_weights
    per_token = pg
    kl = torch.zeros_like(logp)
    if ref_logp is not None:
        kl = k3_kl(logp, ref_logp)
        per_token = per_token + kl_coef * kl
    zero = torch.zeros((), device=logp.device)
    per_token = torch.where(mask, per_token, zero)  # padding may hold inf/nan log-probs
    active = ((ratio < 1 - eps_low) & (adv < 0)) | ((ratio > 1 + eps_high) & (adv > 0))
    return PolicyLoss(
        loss=(per_token * weights).sum(),
        pg_loss=(torch.where(mask, pg, zero) * weights).sum().detach(),
        kl_sum=torch.where(mask, kl, zero).sum().detach(),
        clipped=(active & mask).sum().float(),
        ratio_sum=torch.where(mask, ratio, zero).sum().detach(),
    )


def token_entropy(logits: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """Entropy (nats) of softmax(logits) per position, fp32, ``chunk`` positions at a time, no grad.

    logits [..., V] -> [...].
    """
    flat = logits.detach().flatten(0, -2)
    out = torch.empty(flat.shape[0], dtype=torch.float32, device=flat.device)
    with torch.no_grad():
        for i in range(0, flat.shape[0], chunk):
            logp = torch.log_softmax(flat[i:i + chunk].float(), dim=-1)
            out[i:i + chunk] = -(logp.exp() * logp).sum(dim=-1)
    return out.view(logits.shape[:-1])
