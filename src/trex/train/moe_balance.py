"""MoE load balancing without an auxiliary loss, and what post-training keeps fixed (the indexer, V4.1's
Engram tables).

After each optimizer step, every score-routed MoE layer's ``ffn.gate.bias`` (fp32 [E], a buffer,
used only to pick the top-k experts) moves toward balance (DeepSeek-V3/V4)::

    load_i = tokens routed to expert i in this step (summed over micro-batches and ranks)
    b_i += gamma * sign(mean(load) - load_i)          # gamma = 0.001 in V4 pretraining

Hash-routed layers (``ffn.gate.tid2eid``, no bias) keep their fixed table and are only reported.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import nn

from trex.models.common.moe import MoEStats

INDEXER_MARK = ".attn.indexer."
ENGRAM_TABLE = ".engram.embed.weight"


def sum_expert_counts(stats: Sequence[MoEStats]) -> dict[str, torch.Tensor]:
    """Per-layer token counts [E] summed over micro-batches (``stats`` from every micro-batch)."""
    totals: dict[str, torch.Tensor] = {}
    for s in stats:
        counts = s.counts.detach().to(torch.float32)
        if s.layer in totals:
            if totals[s.layer].shape != counts.shape:
                raise ValueError(f"MoE stats for layer {s.layer}: expert counts of shape {tuple(counts.shape)} "
                                 f"after {tuple(totals[s.layer].shape)} in an earlier micro-batch")
            totals[s.layer] = totals[s.layer] + counts
        else:
            totals[s.layer] = counts
    return totals


@torch.no_grad()
def update_router_bias(model: nn.Module, stats: Sequence[MoEStats], gamma: float,
                       reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
                       apply: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Apply b_i += gamma * sign(mean_load - load_i) to each score-routed layer's gate bias.

    ``stats``: the ``out.moe_stats`` of every micro-batch of the step, concatenated. ``reduce``
    (optional) receives all layers' counts stacked as one [L, E] fp32 tensor and returns the sum
    over ranks (e.g. an all-reduce), so the update is identical on every rank. ``apply`` (0-d bool on
    the device, optional): where False the biases stay as they are (a skipped step), with no host
    read. Returns the step's counts per layer (after ``reduce``), hash layers included, for load
    metrics.
    """
    totals = sum_expert_counts(stats)
    if not totals:
        return {}
    names = list(totals)
    stacked = torch.stack([totals[n] for n in names])
    if reduce is not None:
        stacked = reduce(stacked)
    counts = dict(zip(names, stacked.unbind(0)))
    for layer, load in counts.items():
        try:
            gate = model.get_submodule(f"{layer}.ffn.gate")
        except AttributeError:
            raise ValueError(f"MoE stats name layer {layer!r}, but the model has no module {layer}.ffn.gate") from None
        bias = getattr(gate, "bias", None)
        if bias is None:  # hash-routed layer
            continue
        if bias.shape != load.shape:
            raise ValueError(f"{layer}.ffn.gate.bias has shape {tuple(bias.shape)} but the layer's expert counts "
                             f"have shape {tuple(load.shape)}")
        step = torch.sign(load.mean() - load).to(device=bias.device, dtype=bias.dtype)
        bias.add_(step if apply is None else torch.where(apply, step, 0), alpha=gamma)
    return counts


def freeze_for_post_training(model: nn.Module, indexer: bool, engram: str, router: bool = False,
                             only_indexer: bool = False) -> list[str]:
    """What ``[train] freeze_indexer``, ``[train] engram``, ``[train] router`` and ``[train] indexer_warmup``
    (``only_indexer``: everything but the indexer) keep fixed; returns the frozen names. A model without
    Engram tables refuses ``engram = "train"``."""
    if only_indexer:
        return freeze_all_but_indexer(model)
    frozen = freeze_indexer(model) if indexer else []
    if router:
        frozen += freeze_router(model)
    if engram == "frozen":
        frozen += freeze_engram_tables(model)
    elif not getattr(model.cfg, "engram_layer_ids", None):
        raise ValueError(f'train.engram = "train": this model ({model.cfg.architecture}) has no Engram tables')
    return frozen


def freeze_router(model: nn.Module) -> list[str]:
    """Set requires_grad=False on every MoE gate's weight (``*.ffn.gate.weight``); the bias is a buffer that
    only ``update_router_bias`` moves, which a run with frozen routers does not call. Returns the names."""
    frozen = []
    for name, p in model.named_parameters():
        if name.endswith(".ffn.gate.weight"):
            p.requires_grad_(False)
            frozen.append(name)
    return frozen


def freeze_engram_tables(model: nn.Module) -> list[str]:
    """Set requires_grad=False on V4.1's Engram tables (``*.engram.embed.weight``), the ``[train] engram =
    "frozen"`` default; the gate and projection around them keep training. Returns the frozen names."""
    frozen = []
    for name, p in model.named_parameters():
        if name.endswith(ENGRAM_TABLE):
            p.requires_grad_(False)
            frozen.append(name)
    return frozen


def freeze_indexer(model: nn.Module) -> list[str]:
    """Set requires_grad=False on every lightning-indexer parameter (``*.attn.indexer.*``).

    Post-training default: the indexer's top-k is not differentiable, so the LM loss gives it no
    gradient anyway; freezing also keeps it out of the optimizer (no weight decay drift).
    Call before `build_optimizer`. Returns the frozen names.
    """
    frozen = []
    for name, p in model.named_parameters():
        if INDEXER_MARK in f".{name}":
            p.requires_grad_(False)
            frozen.append(name)
    return frozen


def freeze_all_but_indexer(model: nn.Module) -> list[str]:
    """Set requires_grad=False on every parameter but the lightning indexers' (DeepSeek-V3.2's dense
    warm-up, ``[train] indexer_warmup``). Returns the frozen names; a model without an indexer is refused."""
    frozen = []
    for name, p in model.named_parameters():
        if INDEXER_MARK not in f".{name}":
            p.requires_grad_(False)
            frozen.append(name)
    if len(frozen) == len(list(model.parameters())):
        raise ValueError(f"train.indexer_warmup: this model ({model.cfg.architecture}) has no lightning indexer")
    return frozen
