"""DPO: direct preference optimisation on chosen/rejected pairs (``[train] mode = "dpo"``, ``[dpo]``).

For a pair with policy sequence log-probs (summed over the response tokens) pi_c, pi_r and the
reference's ref_c, ref_r::

    reward_c = beta * (pi_c - ref_c)          reward_r = beta * (pi_r - ref_r)
    margin   = reward_c - reward_r
    loss     = -(1 - eps) * log sigmoid(margin) - eps * log sigmoid(-margin)    (eps: label_smoothing)

The step's loss is the mean over all pairs of the step (every micro-batch of every rank), so any
split of the batch gives the same gradient; the sequence-wise MoE balance loss is added as in SFT.
The reference is the initial policy unless ``reference_path`` names another model; its log-probs
are computed once before the first step (``precompute``, kept per pair) or per batch by a frozen
copy (``online``). Both happen before a resumed run loads its checkpoint, so they see the same
reference as the original run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F

from trex.data.loader import Batch, count_loss_tokens
from trex.data.preference import PairBatch, PairLoader, PreferencePairs, collate, read_pairs, sweep
from trex.data.records import BadRecordPolicy
from trex.models import evaluating
from trex.models.common.cross_entropy import IGNORE_INDEX
from trex.models.common.heads import Model, ModelOutput
from trex.posttrain.objective import (Objective, StepResult, TrainContext, backward_micro_batches, load_frozen,
                                      next_token_nll, reshard)
from trex.recipe import check_choices


@dataclass
class DPOSection:
    """The ``[dpo]`` section: direct preference optimisation (``train.mode = "dpo"``, trex.posttrain.dpo)."""

    beta: float = 0.1
    """Strength of the implicit KL to the reference: rewards are beta * (log pi - log pi_ref)."""
    label_smoothing: float = 0.0
    """Conservative DPO: the assumed probability that a pair's preference label is flipped, in [0, 0.5)."""
    reference: Literal["precompute", "online"] = "precompute"
    """precompute: the reference's sequence log-probs of every pair once at start; online: a frozen
    reference model scores each batch (memory for a second model, no start-up pass)."""
    reference_path: str = ""
    """The reference model's checkpoint directory; empty: the initial policy."""
    rpo_alpha: float = 0.0
    """RPO: add rpo_alpha x the chosen response's mean per-token NLL to each pair's loss, so the
    chosen answer keeps its likelihood while the margin grows (0: plain DPO)."""

    def __post_init__(self) -> None:
        if self.rpo_alpha < 0:
            raise ValueError(f"dpo.rpo_alpha must be >= 0, got {self.rpo_alpha}")
        if self.beta <= 0:
            raise ValueError(f"dpo.beta must be > 0, got {self.beta}")
        if not 0 <= self.label_smoothing < 0.5:
            raise ValueError(f"dpo.label_smoothing must be in [0, 0.5), got {self.label_smoothing}")
        check_choices(self, "dpo")


@dataclass
class DPOTerms:
    """Per pair [B]: the loss and the implicit rewards of the chosen and the rejected response."""
    losses: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor


def dpo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor,
             ref_rejected: torch.Tensor, beta: float, label_smoothing: float = 0.0, rpo_alpha: float = 0.0,
             chosen_tokens: torch.Tensor | None = None) -> DPOTerms:
    """The DPO loss of B pairs from their sequence log-probs (each [B], nats). ``rpo_alpha`` > 0 adds
    the chosen response's mean per-token NLL (``-policy_chosen / chosen_tokens``) times rpo_alpha (RPO)."""
    chosen = beta * (policy_chosen - ref_chosen)
    rejected = beta * (policy_rejected - ref_rejected)
    margin = chosen - rejected
    losses = -(1 - label_smoothing) * F.logsigmoid(margin) - label_smoothing * F.logsigmoid(-margin)
    if rpo_alpha:
        losses = losses - rpo_alpha * policy_chosen / chosen_tokens
    return DPOTerms(losses, chosen, rejected)


def sequence_logprobs(model: Model, batch: PairBatch, all_heads: bool = False) -> tuple[torch.Tensor, ModelOutput]:
    """fp32 [2B]: each row's log-prob of its response tokens, summed; and the model's output. The LM
    head runs fused with the loss (no [2B, S, V] logits). ``all_heads``: the MTP heads score their own
    targets too, so that the training step anchors them (objective.mtp_anchor)."""
    heads = 1 + (len(model.mtp) if all_heads else 0)
    out = next_token_nll(model, batch.input_ids, batch.doc_ids, heads, token_mask=batch.doc_ids == 0)
    return (-out.token_nll[0] * batch.scored).sum(-1), out


class DPOObjective(Objective):
    def __init__(self, ctx: TrainContext):
        recipe, par = ctx.recipe, ctx.par
        self.ctx, self.cfg = ctx, recipe.dpo
        self.pairs = read_pairs(recipe.data, ctx.tokenizer, BadRecordPolicy(recipe.data.bad_record_policy))
        self.loader = PairLoader(self.pairs, recipe.data.micro_batch_size, par.data_rank, par.data_world,
                                 recipe.data.seed, ctx.tokenizer.pad_id, recipe.data.seq_len, recipe.data.shuffle)
        self.held_out: PreferencePairs | None = None
        if recipe.eval.paths:
            held_out_cfg = recipe.data.on_files(recipe.eval.paths)
            self.held_out = read_pairs(held_out_cfg, ctx.tokenizer, BadRecordPolicy(recipe.data.bad_record_policy))
        source = self.cfg.reference_path or ctx.model
        self.reference: Model | None = None
        self.precomputed: dict[str, torch.Tensor] = {}
        if self.cfg.reference == "online":
            self.reference = load_frozen(source, ctx)
        else:
            scorer = load_frozen(source, ctx) if self.cfg.reference_path else ctx.model
            self.precomputed["train"] = self._score_all(scorer, self.pairs)
            if self.held_out is not None:
                self.precomputed["eval"] = self._score_all(scorer, self.held_out)

    def _sweep(self, pairs: PreferencePairs):
        """(index, batch) over every pair once, this rank's share; an empty share (index []) still
        yields a batch (of pair 0) to run, so sharded ranks make the same forward calls."""
        ctx = self.ctx
        for index in sweep(len(pairs), ctx.recipe.data.micro_batch_size, ctx.par.data_rank, ctx.par.data_world):
            batch = collate(pairs, index if len(index) else np.zeros(1, dtype=np.int64), ctx.tokenizer.pad_id,
                            ctx.recipe.data.seq_len)
            yield index, batch.to(ctx.dev.torch_device)

    # -- reference log-probs --
    @torch.no_grad()
    def _score_all(self, model: Model, pairs: PreferencePairs) -> torch.Tensor:
        """fp32 [N, 2]: (chosen, rejected) sequence log-probs of every pair under ``model``."""
        par, dev = self.ctx.par, self.ctx.dev
        table = torch.zeros(len(pairs), 2, dtype=torch.float32, device=dev.torch_device)
        with evaluating(model):
            for index, b in self._sweep(pairs):
                logps, _ = sequence_logprobs(model, b)
                if len(index) and par.cp_rank == 0:  # a context-parallel group's ranks score the same pairs
                    table[torch.from_numpy(index).to(table.device)] = logps.view(2, -1).T
        reshard(model)
        return par.all_reduce_sum(table)

    @torch.no_grad()
    def _reference(self, batch: PairBatch, split: str) -> torch.Tensor:
        """fp32 [2B]: the reference's sequence log-probs of the batch's rows."""
        if self.reference is None:
            table = self.precomputed[split][batch.index.to(self.precomputed[split].device)]
            return table.T.reshape(-1)
        return sequence_logprobs(self.reference, batch)[0]

    # -- the objective --
    def _terms(self, policy: torch.Tensor, ref: torch.Tensor, batch: PairBatch) -> DPOTerms:
        """DPOTerms from the policy's and the reference's sequence log-probs of the batch's rows [2B]."""
        n = len(batch.index)
        return dpo_loss(policy[:n], policy[n:], ref[:n], ref[n:], self.cfg.beta, self.cfg.label_smoothing,
                        self.cfg.rpo_alpha, batch.scored[:n].sum(-1))

    def step(self, model: Model, step: int, scaler) -> StepResult:
        ctx = self.ctx
        micro = [next(self.loader).to(ctx.dev.torch_device) for _ in range(ctx.recipe.train.grad_accum)]
        pairs = sum(len(b.index) for b in micro) * ctx.par.summed_ranks
        sums = torch.zeros(5, dtype=torch.float64, device=ctx.dev.torch_device)

        def loss_of(b):
            policy, out = sequence_logprobs(model, b, all_heads=True)
            terms = self._terms(policy, self._reference(b, "train"), b)
            sums.add_(_sums(terms, b.n_tokens))
            return terms.losses.sum() / pairs, out

        aux = backward_micro_batches(model, micro, loss_of, scaler, ctx.recipe.train,
                                       ctx.par.summed_ranks)
        sums = ctx.par.all_reduce_sum(sums)
        mean = (sums[:4] / pairs).tolist()
        return StepResult(loss=(sums[0] / pairs).float(), tokens=int(sums[4]), moe_stats=aux.moe_stats, indexer_loss=aux.indexer_loss,
                          metrics={"reward_chosen": mean[1], "reward_rejected": mean[2],
                                   "reward_margin": mean[1] - mean[2], "accuracy": mean[3]})

    @torch.no_grad()
    def evaluate(self, model: Model) -> dict[str, float]:
        """Over every held-out pair: loss, reward accuracy (chosen reward > rejected reward), reward
        margin, and preference accuracy (log p(chosen) > log p(rejected)) of the policy and of the reference."""
        if self.held_out is None:
            return {}
        ctx = self.ctx
        sums = torch.zeros(7, dtype=torch.float64, device=ctx.dev.torch_device)
        with evaluating(model):
            for index, b in self._sweep(self.held_out):
                policy, _ = sequence_logprobs(model, b)
                ref = self._reference(b, "eval")
                n = len(b.index)
                terms = self._terms(policy, ref, b)
                prefers = torch.stack([(policy[:n] > policy[n:]).sum(), (ref[:n] > ref[n:]).sum()]).double()
                if len(index) and ctx.par.cp_rank == 0:  # once per context-parallel group: divided by pairs
                    sums += torch.cat([_sums(terms, b.n_tokens), prefers])
        loss, chosen, rejected, accuracy, _, prefers, ref_prefers = (
            ctx.par.all_reduce_sum(sums) / len(self.held_out)).tolist()
        return {"eval_loss": loss, "eval_accuracy": accuracy, "eval_reward_margin": chosen - rejected,
                "eval_preference_accuracy": prefers, "eval_reference_preference_accuracy": ref_prefers}

    def state_dict(self) -> dict:
        return {"loader": self.loader.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.loader.load_state_dict(state["loader"])

    def preflight(self) -> dict:
        return {"pairs": len(self.pairs), "data": self.loader.fingerprint,
                "eval_pairs": len(self.held_out) if self.held_out is not None else 0}

    def summary(self) -> dict:
        out = {**self.pairs.summary(), "reference": self.cfg.reference}
        if self.held_out is not None:
            out["eval_pairs"] = len(self.held_out)
        return out

    def probe_batch(self, rows: int) -> Batch:
        """The chosen conversations of the first ``rows`` pairs (file order), labels on their responses."""
        seq_len, pad = self.ctx.recipe.data.seq_len, self.ctx.tokenizer.pad_id
        n = min(rows, len(self.pairs))
        input_ids = torch.full((n, seq_len), pad, dtype=torch.long)
        labels = torch.full((n, seq_len), IGNORE_INDEX, dtype=torch.long)
        doc_ids = torch.ones((n, seq_len), dtype=torch.long)
        for row in range(n):
            ids = torch.from_numpy(self.pairs.tokens[2 * row].astype(np.int64))
            mask = torch.from_numpy(self.pairs.response[2 * row])
            input_ids[row, :len(ids)] = ids
            labels[row, :len(ids)] = torch.where(mask, ids, IGNORE_INDEX)
            doc_ids[row, :len(ids)] = 0
        return Batch(input_ids, labels, doc_ids, count_loss_tokens(labels.numpy(), doc_ids.numpy()),
                     int((doc_ids == 0).sum()), doc_ids == 0)


def _sums(terms: DPOTerms, n_tokens: int) -> torch.Tensor:
    """float64 [5]: summed loss, chosen reward, rejected reward, correct pairs, and the tokens."""
    parts = [terms.losses.sum(), terms.chosen_rewards.sum(), terms.rejected_rewards.sum(),
             (terms.chosen_rewards > terms.rejected_rewards).sum(), torch.tensor(n_tokens)]
    return torch.stack([p.detach().double().to(terms.losses.device) for p in parts])


def build(ctx: TrainContext) -> DPOObjective:
    return DPOObjective(ctx)
