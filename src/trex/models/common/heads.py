"""What every model's forward returns (``ModelOutput``), the type generic code names a model of any family by
(``Model``), and how a model's parameters start (``init_parameters``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from trex.models.common.context import SequenceContext, shift_labels
from trex.models.common.cross_entropy import IGNORE_INDEX, VocabSlice, head_nll, token_nll
from trex.models.common.linear import linear_fp32
from trex.models.common.moe import Gate, MoEStats

Model = nn.Module
"""A model of any family (the registry's ``model_class``; trex.models.build.build_model), as generic code
(objectives, the loop, parallelism, checkpoints) annotates it. What it relies on: ``cfg`` (the config),
``init_weights(seed)``, ``set_quant(QuantSim)``, ``layers`` (the blocks), ``sequence_shard`` and the forward
``model(input_ids, labels=None, doc_ids=None, cache=None, *, targets=None, return_logits=True,
token_mask=None, ...) -> ModelOutput``."""


@dataclass
class ModelOutput:
    """logits [B, S, V] fp32 (None when the forward was asked for none); loss: mean next-token CE over
    labelled tokens; mtp_logits[j] predicts token t + 2 + j and mtp_loss averages their CE; token_nll:
    per head (main, then MTP), fp32 [B, S] NLL of the ``targets`` the forward was given; moe_stats per
    MoE layer (main, then MTP)."""

    logits: torch.Tensor | None
    loss: torch.Tensor | None = None
    mtp_logits: list[torch.Tensor] = field(default_factory=list)
    mtp_loss: torch.Tensor | None = None
    indexer_loss: torch.Tensor | None = None  # mean over CSA layers of the indexer alignment (align_indexer)
    indexer_recall: torch.Tensor | None = None  # mean over CSA layers of the picks' attention mass (measure_recall)
    token_nll: list[torch.Tensor] = field(default_factory=list)
    moe_stats: list[MoEStats] = field(default_factory=list)
    hidden: torch.Tensor | None = None  # V4.1 with tap_layers: [B, S, k d] the DSpark drafter's input


@torch.no_grad()
def init_parameters(model: nn.Module, std: float, seed: int | None, ones: tuple[str, ...] = ()) -> torch.Generator | None:
    """Normal(0, std) for every matrix of ``model``; ones for norms, mHC scales and the ``ones`` leaf
    names; zeros for mHC bases, sinks, ``ape``, the norms' bias and the routers' bias. Seeded: draws from a CPU
    generator made from ``seed`` (returned, for further draws) and copies them to the parameters' device, so the
    same seed gives the same weights on every device (a device's own generator draws another stream: CUDA's
    Philox is not the CPU's Mersenne Twister, and an H200 run once started from other weights than its CPU
    reference, issue 53)."""
    gen = None
    device = next(model.parameters()).device
    if seed is not None and device.type != "meta":
        gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in ("base", "attn_sink", "ape") or (leaf == "bias" and p.dim() == 1):
            p.zero_()
        elif leaf == "scale" or leaf in ones or (leaf == "weight" and p.dim() == 1):
            p.fill_(1.0)
        elif gen is None:
            p.normal_(0.0, std)
        else:
            p.copy_(torch.empty(p.shape, dtype=p.dtype).normal_(0.0, std, generator=gen))
    for module in model.modules():
        if isinstance(module, Gate) and not module.hashed:
            module.bias.zero_()
    return gen


class HeadSlice(VocabSlice, Protocol):
    """A head split by vocabulary rows over a group of ranks (trex.parallel.tensor_parallel sets one as the
    model's ``head_slice``): this rank's rows of a weight, and the whole vocabulary's logits from each rank's."""

    def local(self, weight: torch.Tensor) -> torch.Tensor: ...

    def enter(self, h: torch.Tensor) -> torch.Tensor:
        """h, whose gradient (each rank's rows' part) is summed over the group in backward."""

    def rows(self, h: torch.Tensor) -> torch.Tensor:
        """h [B, s, d], this rank's rows of the sequence under sequence parallelism -> the whole rows (the
        identity without it); backward keeps this rank's rows of the (summed) gradient."""

    def gather(self, logits: torch.Tensor) -> torch.Tensor:
        """Each rank's rows' logits [..., V / tp] -> the whole vocabulary's [..., V]; backward: this rank's part."""


class UntiedHead:
    """The LM head of a model whose ``head`` is its own [V, d] linear (not tied to the embedding). With
    ``head_slice`` set (tensor parallelism) each rank holds its rows of the vocabulary, and reads the whole rows of
    the sequence (gathered under sequence parallelism)."""

    head: nn.Linear
    head_slice: HeadSlice | None = None

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """LM head in fp32: [B, S, d] -> [B, S, V] (split by vocabulary: each rank's rows, gathered)."""
        if self.head_slice is None:
            return linear_fp32(h, self.head.weight)
        h = self.head_slice.enter(self.head_slice.rows(h))
        return self.head_slice.gather(linear_fp32(h, self.head_slice.local(self.head.weight)))

    def head_nll(self, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The LM head fused with the loss: h [B, S, d], targets [B, S] -> fp32 per-token NLL [B, S]
        (0 where IGNORE_INDEX), with no [B, S, V] logits (``trex.models.common.cross_entropy.head_nll``; split
        by vocabulary, no rank holds more than its rows' logits of a tile)."""
        if self.head_slice is None:
            return head_nll(h, self.head.weight, targets)
        return head_nll(self.head_slice.rows(h), self.head_slice.local(self.head.weight), targets, self.head_slice)


def fill_heads(model: nn.Module, out: ModelOutput, ctx: SequenceContext, h: torch.Tensor,
               mtp_step: Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor] | None, input_ids: torch.Tensor,
               labels: torch.Tensor | None, doc_ids: torch.Tensor | None, targets: list[torch.Tensor] | None,
               return_logits: bool) -> None:
    """Run the main head and then each MTP head of ``model`` (an ``UntiedHead`` with ``embed`` and ``mtp``) into
    ``out``. h [B, s, d]: the main head's normed input, this rank's rows ``ctx.t0:ctx.t1``; head j > 0 reads
    ``mtp_step(j, h, emb)``, MTP module j - 1 given the previous head's input and ``emb`` [B, s, d], the
    embedding of the token j ahead (None for a model without MTP heads). Fills, for the whole rows (gathered over the sequence shard): ``logits``
    and ``mtp_logits`` when ``return_logits`` (otherwise each head is fused with its loss and no [B, S, V]
    logits exist); ``token_nll[j]`` fp32 [B, S] for each of ``targets`` (shifted, one per head); from HF-style
    ``labels`` [B, S], ``loss`` (the main head's mean NLL over labelled tokens) and ``mtp_loss`` (the MTP
    heads' losses averaged)."""
    if targets is not None and len(targets) > 1 + len(model.mtp):
        raise ValueError(f"targets: at most one [B, S] tensor per head (1 + {len(model.mtp)} MTP), "
                         f"got {len(targets)}")

    def nll(h: torch.Tensor, logits: torch.Tensor | None, tgt: torch.Tensor) -> torch.Tensor:
        """One head's per-token NLL of the whole rows' targets [B, S] (this rank's rows computed from its
        logits, or fused with the head when there are none; then gathered)."""
        tgt = tgt[:, ctx.t0:ctx.t1]
        return ctx.gather(token_nll(logits, tgt) if logits is not None else model.head_nll(h, tgt))

    mtp_losses = []
    for j in range(1 + len(model.mtp)):  # head 0 is the main one; head j > 0 is MTP module j - 1
        if j > 0:
            ahead = F.pad(input_ids[:, j:], (0, j), value=0)[:, ctx.t0:ctx.t1]
            h = mtp_step(j, h, model.embed(ahead))
        logits = model.logits(h) if return_logits else None
        if logits is not None and j == 0:
            out.logits = ctx.gather(logits)
        elif logits is not None:
            out.mtp_logits.append(ctx.gather(logits))
        if targets is not None and j < len(targets):
            out.token_nll.append(nll(h, logits, targets[j]))
        if labels is not None:
            shifted = shift_labels(labels, j + 1, doc_ids)
            loss = nll(h, logits, shifted).sum() / (shifted != IGNORE_INDEX).sum().clamp(min=1)
            if j == 0:
                out.loss = loss
            else:
                mtp_losses.append(loss)
    if mtp_losses:
        out.mtp_loss = torch.stack(mtp_losses).mean()
