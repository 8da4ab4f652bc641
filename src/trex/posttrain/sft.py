"""Continued pretraining and SFT: next-token cross-entropy over packed rows, plus MTP and balance losses.

One step takes ``grad_accum`` micro-batches; the LM and MTP cross-entropies are summed over tokens
and divided by the number of targets in the whole step (all micro-batches of all ranks), so any
split of the batch gives the same gradient. The data section's own ``mode`` (cpt | sft) decides
how records are encoded (trex.data).
"""

from __future__ import annotations


import torch

from trex.data import build_loader
from trex.models import evaluating
from trex.models.common.context import shift_labels
from trex.models.common.cross_entropy import IGNORE_INDEX
from trex.models.common.heads import Model
from trex.parallel.mesh import Parallel
from trex.posttrain.objective import Objective, StepResult, TrainContext, backward_micro_batches
from trex.precision import DynamicLossScaler


def targets_for(labels: torch.Tensor, doc_ids: torch.Tensor, shift: int) -> torch.Tensor:
    """Targets ``shift`` tokens ahead, IGNORE_INDEX across documents and past the end."""
    return shift_labels(labels, shift, doc_ids)


def _count(targets: torch.Tensor) -> torch.Tensor:
    """Labelled targets, a 0-d long tensor on the targets' device (no host read)."""
    return (targets != IGNORE_INDEX).sum()


@torch.no_grad()
def evaluate_loss(model: Model, loader, batches: int, device: torch.device, par: Parallel | None = None) -> float:
    """Token-weighted next-token loss over ``batches`` held-out micro-batches (of every rank)."""
    total, count = 0.0, 0
    with evaluating(model):
        for _ in range(batches):
            b = next(loader).to(device)
            targets = targets_for(b.labels, b.doc_ids, 1)
            out = model(b.input_ids, doc_ids=b.doc_ids, targets=[targets], return_logits=False)
            total = total + out.token_nll[0].sum().double()
            count = count + _count(targets)
    sums = torch.stack([torch.as_tensor(total, dtype=torch.float64, device=device),
                        torch.as_tensor(count, dtype=torch.float64, device=device)])
    if par is not None and par.distributed:
        sums = par.all_reduce_sum(sums)
    total, count = sums.tolist()  # one read for the whole evaluation
    return total / max(count, 1)


def accumulate_gradients(model: Model, micro: list, cfg_train, scaler: DynamicLossScaler,
                         par: Parallel | None = None):
    """Forward and backward over the micro-batches of one step; gradients accumulate in .grad.

    The LM and MTP cross-entropies are summed over tokens and divided by the number of targets in
    the whole step (all micro-batches of all ranks; ranks sum their gradients), so any split of a
    batch gives the same gradient. The balance loss is averaged over micro-batches and ranks.
    Returns this rank's share of the (lm loss, mtp loss) and its ``Auxiliary`` (MoE stats, indexer
    alignment loss). No host read: the
    target counts stay on the device (all-reduced there).
    """
    world = par.summed_ranks if par is not None else 1
    shifts = [1] + [j + 2 for j in range(len(model.mtp))]  # the MTP heads (V4.1's mtp.* are no heads)
    targets = [[targets_for(b.labels, b.doc_ids, s) for s in shifts] for b in micro]
    counts = torch.stack([sum(_count(t[i]) for t in targets) for i in range(len(shifts))])
    if par is not None:
        counts = par.all_reduce_sum(counts)
    counts = counts.clamp(min=1).unbind(0)
    device = micro[0].input_ids.device
    lm_total = torch.zeros((), device=device)
    mtp_total = torch.zeros((), device=device)

    def loss_of(part):
        b, tgt = part
        out = model(b.input_ids, doc_ids=b.doc_ids, targets=tgt, return_logits=False,  # no [B, S, V] logits
                    token_mask=b.token_mask)
        lm = out.token_nll[0].sum() / counts[0]
        mtp = sum((nll.sum() / c for nll, c in zip(out.token_nll[1:], counts[1:])),
                  torch.zeros((), device=device)) / max(1, len(tgt) - 1)
        lm_total.add_(lm.detach())
        mtp_total.add_(mtp.detach())
        return lm + cfg_train.mtp_weight * mtp, out

    aux = backward_micro_batches(model, list(zip(micro, targets)), loss_of, scaler, cfg_train, world)
    return lm_total, mtp_total, aux


class SFTObjective(Objective):
    """Next-token loss on the packed rows of [data]; held-out loss on [eval]."""

    def __init__(self, ctx: TrainContext):
        recipe, par = ctx.recipe, ctx.par
        self.ctx = ctx
        self.loader = build_loader(recipe.data, rank=par.data_rank, world_size=par.data_world, tokenizer=ctx.tokenizer)
        self.eval_loader = None
        if recipe.eval.paths:
            held_out = recipe.data.on_files(recipe.eval.paths, shuffle=False)
            self.eval_loader = build_loader(held_out, rank=par.data_rank, world_size=par.data_world,
                                            tokenizer=ctx.tokenizer, paths_key="eval.paths")

    def step(self, model: Model, step: int, scaler) -> StepResult:
        ctx = self.ctx
        micro = [next(self.loader).to(ctx.dev.torch_device) for _ in range(ctx.recipe.train.grad_accum)]
        lm, mtp, aux = accumulate_gradients(model, micro, ctx.recipe.train, scaler, ctx.par)
        tokens = sum(b.n_tokens for b in micro)
        totals = ctx.par.all_reduce_sum(torch.stack([lm, mtp, lm.new_tensor(tokens)]))
        return StepResult(loss=totals[0], tokens=totals[2], metrics={"mtp_loss": totals[1]}, moe_stats=aux.moe_stats,
                          indexer_loss=aux.indexer_loss)

    def evaluate(self, model: Model) -> dict[str, float]:
        if self.eval_loader is None:
            return {}
        ctx = self.ctx
        return {"eval_loss": evaluate_loss(model, self.eval_loader, ctx.recipe.eval.batches, ctx.dev.torch_device,
                                           ctx.par)}

    def state_dict(self) -> dict:
        return {"loader": self.loader.state_dict(),
                "eval_loader": self.eval_loader.state_dict() if self.eval_loader is not None else None}

    def load_state_dict(self, state: dict) -> None:
        if "fingerprint" in state:  # a checkpoint from before objectives: the loader's own state
            state = {"loader": state}
        self.loader.load_state_dict(state["loader"])
        if self.eval_loader is not None and state.get("eval_loader"):
            self.eval_loader.load_state_dict(state["eval_loader"])

    def preflight(self) -> dict:
        return {"micro_batches_per_epoch": self.loader.micro_batches_per_epoch, "data": self.loader.fingerprint,
                "eval_micro_batches": self.eval_loader.micro_batches_per_epoch if self.eval_loader else 0}

    def summary(self) -> dict:
        return self.loader.summary()


def build(ctx: TrainContext) -> SFTObjective:
    return SFTObjective(ctx)
