"""Signals a run records for convergence fidelity, besides metrics.jsonl.

Every ``[fidelity] every`` optimizer steps the recorder writes, into the run directory:

``grad_norms.jsonl``  ``{"step": s, "norms": {group: L2 norm}}``: the gradient norm of each block
                      (`layer_group`), measured after unscaling and before clipping, so it is the
                      same gradient the global ``grad_norm`` in metrics.jsonl describes.
``probe.jsonl``       ``{"step": s, "loss": nats/token, "tokens": n, "positions": [[row, pos]],
                      "ids": [[k ids]], "logprobs": [[k log-probs]]}``: the loss of a fixed probe batch
                      after the step's update, and the top-k next-token log-probabilities at a few
                      fixed positions (the logits fingerprint).

The probe batch is the first ``probe_rows`` rows of ``probe_paths`` (default: the [eval] files, else
the [data] files) in file order, packed next-fit, so every run of a recipe, at any layout or
precision, sees the same tokens. It is read from the prepared data those files already have (the
training set is never tokenized again for it), and only when a step of the run will record it.
Positions are evenly spaced over each row's loss targets.

Under torch.distributed every rank computes (the norms and the probe forward involve collectives
when parameters are sharded) and only rank 0 writes.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch

from trex.models import evaluating
from trex.models.common.context import shift_labels
from trex.models.common.cross_entropy import IGNORE_INDEX, token_nll
from trex.recipe import require_positive

if TYPE_CHECKING:
    from trex.data import Batch

GRAD_NORMS_FILE = "grad_norms.jsonl"
PROBE_FILE = "probe.jsonl"
SIGNAL_FILES = (GRAD_NORMS_FILE, PROBE_FILE)  # one JSON line per recorded step


@dataclass
class FidelitySection:
    """The ``[fidelity]`` section of a recipe."""

    every: int = 10
    """Optimizer steps between per-layer gradient norms and probe evaluations (0 disables both)."""
    probe_rows: int = 4
    """Rows (of [data] seq_len tokens) in the fixed probe batch; independent of the micro-batch size,
    so runs at any layout probe the same tokens."""
    probe_positions: int = 4
    """Positions per probe row whose top-k log-probabilities are stored."""
    topk: int = 8
    """Log-probabilities stored per probe position."""
    probe_paths: list[str] = field(default_factory=list)
    """Probe data files (encoded like [data]); empty: the [eval] files, else the [data] files."""

    def __post_init__(self) -> None:
        if self.every < 0:
            raise ValueError(f"fidelity.every must be >= 0 (0 disables), got {self.every}")
        require_positive(self, "fidelity", ("probe_rows", "probe_positions", "topk"))


def layer_group(name: str) -> str:
    """The block a parameter belongs to, for per-layer gradient norms.

    ``layers.N.attn`` / ``layers.N.ffn`` (router, routed and shared experts) / ``layers.N.hc``
    (mHC mixers) / ``layers.N.norm`` (RMSNorm gains), the same for ``mtp.N`` (plus ``mtp.N.proj``
    for its embedding/hidden projections), and the top-level ``embed``, ``hc_head``, ``norm``, ``head``.
    """
    parts = name.split(".")
    if parts[0] in ("layers", "mtp") and len(parts) > 2:
        sub = parts[2]
        if sub.startswith("hc_"):
            kind = "hc"
        elif sub.endswith("norm"):
            kind = "norm"
        elif sub in ("attn", "ffn"):
            kind = sub
        else:
            kind = "proj"
        return f"{parts[0]}.{parts[1]}.{kind}"
    return parts[0]


def _is_writer() -> bool:
    return not (torch.distributed.is_available() and torch.distributed.is_initialized()
                and torch.distributed.get_rank() != 0)


def _append_json(path: str, record: dict) -> None:
    """One line, flushed: the file is complete up to the last recorded step."""
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


@torch.no_grad()
def grad_norms_by_group(model: torch.nn.Module) -> dict[str, float]:
    """L2 norm of the gradients of each `layer_group` (parameters without a gradient are left out).

    A DTensor gradient (FSDP2) is normed as a DTensor: the local shards' squared sums are all-reduced
    (``full_tensor()`` of the 0-d norm), which is the norm of the full gradient without gathering it.
    Every rank must call this.
    """
    squares: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        norm = torch.linalg.vector_norm(p.grad, 2, dtype=torch.float32)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        group = layer_group(name)
        squares[group] = squares.get(group, 0.0) + norm.square()
    return {group: float(total.sqrt()) for group, total in squares.items()}


def probe_positions(targets: torch.Tensor, per_row: int) -> list[tuple[int, int]]:
    """``(row, position)`` pairs: ``per_row`` positions evenly spaced over each row's loss targets."""
    chosen = []
    for row in range(targets.shape[0]):
        valid = (targets[row] != IGNORE_INDEX).nonzero().flatten().tolist()
        if not valid:
            continue
        picks = sorted({valid[round(i * (len(valid) - 1) / max(1, per_row - 1))] for i in range(per_row)})
        chosen.extend((row, pos) for pos in picks)
    return chosen


class FidelityRecorder:
    """Writes grad_norms.jsonl and probe.jsonl into a run directory every ``section.every`` steps of
    ``(first, last]``; ``probe`` makes the probe batch, called once, only if a step there is due."""

    def __init__(self, section: FidelitySection, run_path: str, probe: Callable[[], Batch], device: torch.device,
                 first: int = 0, last: int | None = None):
        self.section = section
        every = section.every
        self.enabled = every > 0 and (last is None or last // every > first // every)
        self.write = _is_writer()
        self.probe = probe().to(device) if self.enabled else None
        self.grad_path = os.path.join(run_path, GRAD_NORMS_FILE)
        self.probe_path = os.path.join(run_path, PROBE_FILE)

    @classmethod
    def for_recipe(cls, recipe, run_path: str, tokenizer, device: torch.device, first: int = 0,
                   last: int | None = None) -> FidelityRecorder:
        """The probe from the recipe's data: the [data] set's own prepared directory (``data.prepared``
        or its cache entry), or that of the [eval] files or ``probe_paths`` (prepared like SFT's
        held-out set, so an evaluation and the probe share it)."""
        from trex.data import file_order_batch

        section = recipe.fidelity
        if section.probe_paths or recipe.eval.paths:
            cfg = recipe.data.on_files(section.probe_paths or recipe.eval.paths, shuffle=False)
            key = "fidelity.probe_paths" if section.probe_paths else "eval.paths"
        else:
            cfg, key = recipe.data, "data.paths"
        return cls(section, run_path, lambda: file_order_batch(cfg, tokenizer, section.probe_rows, paths_key=key),
                   device, first, last)

    def due(self, step: int) -> bool:
        return self.enabled and step % self.section.every == 0

    def record_grad_norms(self, step: int, model: torch.nn.Module) -> None:
        """Call after unscaling and before clipping, with ``step`` the 1-based step being taken."""
        if not self.due(step):
            return
        norms = grad_norms_by_group(model)
        if self.write:
            _append_json(self.grad_path, {"step": step, "norms": norms})

    @torch.no_grad()
    def record_probe(self, step: int, model: torch.nn.Module) -> None:
        """Call at the end of step ``step`` (after the optimizer update)."""
        if not self.due(step):
            return
        batch = self.probe
        with evaluating(model):
            logits = model(batch.input_ids, doc_ids=batch.doc_ids).logits.float()
        targets = shift_labels(batch.labels, 1, batch.doc_ids)
        loss = token_nll(logits, targets).sum().item()
        count = int((targets != IGNORE_INDEX).sum())
        positions, ids, logprobs = [], [], []
        for row, pos in probe_positions(targets, self.section.probe_positions):
            top = torch.log_softmax(logits[row, pos], dim=-1).topk(self.section.topk)
            positions.append([row, pos])
            ids.append(top.indices.tolist())
            logprobs.append(top.values.tolist())
        if self.write:
            _append_json(self.probe_path, {"step": step, "loss": loss / max(count, 1), "tokens": count,
                                           "positions": positions, "ids": ids, "logprobs": logprobs})
