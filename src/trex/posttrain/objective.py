"""What differs between training modes: the Objective the loop runs, and the helpers they share.

The training loop (trex.train.loop) is the same for every mode: precision policy, step guard,
clipping, optimizer, router-bias update, checkpoints, fidelity signals, metrics. Each optimizer
step it asks the mode's :class:`Objective` for the gradients::

    result = objective.step(model, step, scaler)   # forward + backward; grads in .grad (scaled)
    ... unscale, clip, guard.finite(result.loss, grad_norm), optimizer.step(apply=...), router bias ...
    objective.evaluate(model)                       # held-out metrics, now and then
    objective.state_dict() / load_state_dict(d)     # data position, RNG: what resume needs

Shared helpers: :func:`token_logprobs` (per-token log-probabilities of the next tokens, fp32
log-softmax over the full vocabulary) and :func:`load_frozen` (a frozen reference/teacher model,
sharded like the student).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch.distributed.fsdp import FSDPModule

from trex import device as device_layer
from trex.checkpoint import load_pretrained
from trex.data.loader import Batch
from trex.data.tokenizer import Tokenizer
from trex.models import build_model
from trex.models.common.context import shift_labels
from trex.models.common.cross_entropy import token_nll
from trex.models.common.heads import Model
from trex.parallel.load import load_sharded
from trex.parallel.mesh import Parallel
from trex.parallel.plan import apply_parallelism, sync_gradients
from trex.precision import PrecisionPolicy


@dataclass
class StepResult:
    """One optimizer step's forward/backward, as the loop needs it."""

    loss: torch.Tensor
    """Scalar objective loss of the step over all ranks (detached): the guard's loss and the "loss" metric."""
    tokens: int | torch.Tensor
    """Tokens processed this step, summed over all ranks (throughput and MFU; the ranks of a
    context-parallel group each count their shared rows, and the loop divides by cp); a 0-d tensor
    stays on the device until the loop's one read of the step's scalars."""
    metrics: dict[str, float | torch.Tensor] = field(default_factory=dict)
    """Extra metrics (mtp_loss, reward_margin, kl, ...) for metrics.jsonl and TensorBoard; 0-d tensors
    are read with the loss, once per step."""
    moe_stats: list = field(default_factory=list)
    """MoEStats of the trained model's forwards, for the router-bias update."""
    indexer_loss: torch.Tensor | None = None
    """This rank's indexer alignment loss averaged over the step's forwards (train.indexer_loss > 0),
    for the ``indexer_loss`` metric (the loop averages it over ranks)."""


@dataclass
class TrainContext:
    """What an objective is built from: the recipe, where it runs, and the (prepared) student."""

    recipe: Any  # trex.train.config.TrainRecipe
    par: Parallel
    dev: device_layer.Device
    policy: PrecisionPolicy
    tokenizer: Tokenizer
    model: Model
    """The student, already cast and sharded; at construction it holds the initial weights."""


class Objective:
    """Base of every mode's objective. ``step`` is required; the rest have neutral defaults."""

    def step(self, model: Model, step: int, scaler) -> StepResult:
        """Forward and backward of optimizer step ``step`` (0-based); gradients accumulate in .grad,
        scaled by ``scaler``. Every rank calls it; the returned loss and tokens cover all ranks."""
        raise NotImplementedError

    def evaluate(self, model: Model) -> dict[str, float]:
        """Held-out metrics (the same on every rank); {} when there is no held-out data."""
        return {}

    def state_dict(self) -> dict:
        """JSON-serialisable position (data order, RNG) that resume restores."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        if state:
            raise ValueError(f"{type(self).__name__} keeps no resume state, but the checkpoint has {sorted(state)}")

    def preflight(self) -> dict:
        """Facts every rank must agree on before the first step (checked by trex.parallel.preflight)."""
        return {}

    def summary(self) -> dict:
        """Data facts for summary.json (records, skips by reason, ...)."""
        return {}

    def warnings(self) -> list[str]:
        """What a run that completed should still be warned about, from what the steps already read on
        the host (no sync of its own): the loop logs each as a warning and lists them in summary.json."""
        return []

    def close(self) -> None:
        """Release what the objective started (a rollout engine's process); the loop calls it once, last."""

    def probe_batch(self, rows: int) -> Batch:
        """The fidelity probe: ``rows`` fixed rows with next-token labels, the same in every run."""
        raise ValueError(f"{type(self).__name__} has no fidelity probe of its own: set fidelity.probe_paths to "
                         "SFT-format records, or fidelity.every = 0")


# ---- the micro-batch loop ---------------------------------------------------------------------------
Part = TypeVar("Part")


def balance_term(moe_stats: list, alpha: float, micro_batches: int, world: int) -> torch.Tensor | None:
    """``alpha`` x the sequence-wise balance losses of one forward, averaged over the step's
    micro-batches and ranks; None when the forward produced none."""
    balance = [s.balance_loss for s in moe_stats if s.balance_loss is not None]
    if not balance:
        return None
    return alpha * torch.stack(balance).sum() / (micro_batches * world)


@dataclass
class Auxiliary:
    """What a step's forwards report besides the objective's loss."""

    moe_stats: list
    """MoEStats of every forward, for the router-bias update."""
    indexer_loss: torch.Tensor | None
    """The indexer alignment loss averaged over the forwards (detached), None when off."""


def backward_micro_batches(model: Model, parts: Sequence[Part],
                           loss_of: Callable[[Part], tuple[torch.Tensor, Any]], scaler, train,
                           world_size: int) -> Auxiliary:
    """The micro-batch loop of every objective's step. For each of ``parts`` in order: gradient
    synchronisation on the last one only (trex.parallel.plan.sync_gradients); the objective's
    ``loss_of(part) -> (loss, out)``, a 0-d loss already normalised over the whole step and the
    forward's ModelOutput; plus ``train.balance_alpha`` x its sequence-wise balance losses and
    ``train.indexer_loss`` x its indexer alignment loss (each averaged over micro-batches and ranks);
    backward of the sum scaled by ``scaler``. Gradients accumulate in ``.grad``.

    Every forward's MTP heads are anchored (`mtp_anchor`), whether or not the objective's loss uses
    them: an MTP block that ran gets gradient through its MoE balance loss even when its output is
    ignored (GRPO, distillation, DPO), and under FSDP2 that gradient reaches its sharded parameters
    without the unit's pre-backward all-gather, which fires only on its outputs."""
    stats, indexer = [], []
    for i, part in enumerate(parts):
        sync_gradients(model, i, len(parts))
        loss, out = loss_of(part)
        loss = loss + mtp_anchor(out)
        balance = balance_term(out.moe_stats, train.balance_alpha, len(parts), world_size)
        if balance is not None:
            loss = loss + balance
        if out.indexer_loss is not None:
            loss = loss + train.indexer_loss * out.indexer_loss / (len(parts) * world_size)
            indexer.append(out.indexer_loss.detach())
        scaler.scale(loss).backward()
        stats.extend(out.moe_stats)
    return Auxiliary(stats, torch.stack(indexer).mean() if indexer else None)


# ---- log-probabilities ------------------------------------------------------------------------------
def next_token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor,
                        doc_ids: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 [B, S]: entry t is log p(input_ids[t+1] | input_ids[..t]) under log_softmax(logits[t]).

    logits: [B, S, V] from the model on ``input_ids`` [B, S]. The last position, and a position
    whose next token belongs to another document (``doc_ids``), hold 0 (there is no next token).
    """
    targets = shift_labels(input_ids, 1, doc_ids)
    return -token_nll(logits, targets)


def next_token_nll(model: Model, input_ids: torch.Tensor, doc_ids: torch.Tensor | None = None,
                   heads: int = 1, token_mask: torch.Tensor | None = None):
    """Run ``model`` on ``input_ids`` [B, S] with the LM head fused with the loss (no logits). In the
    returned ModelOutput, ``token_nll[j]`` (fp32 [B, S]) is head j's NLL of token t + 1 + j, 0 where
    there is none (past the end, across documents); ``heads``: the main head and heads - 1 MTP heads;
    ``token_mask``: the real tokens, for the MoE statistics (the model's forward)."""
    targets = [shift_labels(input_ids, j + 1, doc_ids) for j in range(heads)]
    return model(input_ids, doc_ids=doc_ids, targets=targets, return_logits=False, token_mask=token_mask)


def token_logprobs(model: Model, input_ids: torch.Tensor, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Run ``model`` on ``input_ids`` and return :func:`next_token_logprobs` (fp32 [B, S])."""
    return -next_token_nll(model, input_ids, doc_ids).token_nll[0]


def reshard(model: torch.nn.Module) -> None:
    """Free the gathered parameters an FSDP2 model keeps after a no-grad forward (its root unit does not
    reshard after forward, expecting a backward); a later training step otherwise loses part of the
    root's gradients. A no-op on an unsharded model."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def mtp_anchor(out) -> torch.Tensor | float:
    """0 x the MTP heads' outputs of a ModelOutput (their logits, or their token NLL when the forward
    ran without logits). `backward_micro_batches` adds it to every forward's loss so every parameter
    is in the backward graph: FSDP2 fails on a sharded unit whose outputs get no gradient, and one
    process then updates the same parameters (zero gradients, not none) as a sharded run."""
    return sum((x.sum() * 0.0 for x in out.mtp_logits or out.token_nll[1:]), 0.0)


# ---- frozen reference / teacher models ---------------------------------------------------------------
def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def load_frozen(source: str | Model, ctx: TrainContext) -> Model:
    """A frozen model (requires_grad False, eval mode, no optimizer) sharded like the student.

    ``source`` is a checkpoint directory (official or HF layout; under torch.distributed each rank
    reads only its shards) or a live model, whose current weights are copied (the student at start:
    the initial policy). The copy is built on the meta device, given the student's parallel plan and
    filled shard by shard, so a sharded student is never gathered.
    """
    par, policy = ctx.par, ctx.policy

    def prepare(m: Model) -> None:
        m.to(dtype=torch.float32 if par.distributed else policy.param_dtype)
        m.requires_grad_(False)
        m.set_quant(ctx.model.quant)  # the student's simulation: the reference starts equal to it
        apply_parallelism(m, par, policy)

    if isinstance(source, str):
        if par.distributed:
            model = load_sharded(source, prepare, ctx.dev.torch_device)
        else:
            model = load_pretrained(source, dtype=policy.param_dtype, device=ctx.dev.name)
            prepare(model)
        if model.cfg.vocab_size != ctx.model.cfg.vocab_size:
            raise ValueError(f"{source}: vocab_size {model.cfg.vocab_size}; the trained model's is "
                             f"{ctx.model.cfg.vocab_size} (a frozen model must share the tokenizer)")
    else:
        model = build_model(source.cfg, device="meta")
        if getattr(source, "engram_hasher", None) is not None:  # V4.1: hash through the student's token map
            model.engram_hasher = source.engram_hasher
        prepare(model)
        model.to_empty(device=ctx.dev.torch_device)
        mine = {**dict(model.named_parameters()), **dict(model.named_buffers())}
        theirs = {**dict(source.named_parameters()), **dict(source.named_buffers())}
        with torch.no_grad():
            for name, t in mine.items():
                _local(t).copy_(_local(theirs[name]))
    model.requires_grad_(False)
    return model.eval()
