"""The drafter kind ``mtp``: the multi-token prediction modules of DeepSeek-V4 and the V3 family, which vLLM and
SGLang serve as a drafter of one token per module. The modules are the model's own: in SFT / CPT they train
with the main loss (``train.mtp_weight``); in DPO, GRPO and distillation the objective gives them no gradient,
so with ``[drafter]`` they are frozen in the main steps (``hold_mtp``) and only the re-fit moves them. The
interface the re-fit calls: ``trex.train.drafters``.
"""

from __future__ import annotations

import os
import shutil

import torch
from torch import nn

from trex import atomic
from trex.models import evaluating
from trex.models.registry import drafter_kind
from trex.rollout.speculation import Acceptance, Continuation, measure_mtp_acceptance, mtp_width
from trex.parallel.parameter_view import whole

EXPORT_DIR = "mtp"  # under the re-fit's checkpoint directory


class MTPDrafter(nn.Module):
    """The multi-token prediction modules of a DeepSeek-V4 or V3-family ``model`` as the re-fit's drafter: the
    model's own ``mtp`` (shared, not copied: its state_dict is the model's ``mtp.*``). ``trainable``: the
    parameters the re-fit trains, those the recipe's post-training freezes (``freeze``, called on this module:
    the indexer, a frozen router) leave."""

    def __init__(self, model, freeze=None):
        super().__init__()
        self.cfg = model.cfg
        self.mtp = model.mtp
        held = {p: p.requires_grad for p in self.parameters()}
        self.requires_grad_(True)
        if freeze is not None:
            freeze(self)
        self.trainable = [p for p in self.parameters() if p.requires_grad]
        for p, was in held.items():
            p.requires_grad_(was)

    @property
    def block_size(self) -> int:
        return len(self.mtp)

    def draft_logits(self, model, c: Continuation, anchors: int) -> torch.Tensor:
        """Module j's logits at anchors P - 1 .. P - 2 + ``anchors`` of continuation ``c`` (each drafts the
        token j + 2 ahead) -> [B, anchors, T, V] fp32, from one forward of ``model`` over the continuation
        (evaluation mode: no balance loss, no indexer alignment; only the trainable modules record a graph)."""
        P = c.width
        with evaluating(model):
            out = model(c.ids, doc_ids=(c.positions >= 0).long())
        return torch.stack([logits[:, P - 1:P - 1 + anchors] for logits in out.mtp_logits], 2)


def hold_mtp(model, recipe) -> list[str]:
    """``[drafter]`` on a model whose MTP modules are its drafter, in DPO / GRPO / distillation (where the
    objective gives them no gradient): freeze them for the main steps, so that only the re-fit moves them
    (no weight decay drifts them, and the main optimizer holds no state for them). Returns the names of those
    it froze (the recipe's freezes may have frozen some already)."""
    if not recipe.drafter.enabled or recipe.train.mode not in ("dpo", "grpo", "distill") \
            or drafter_kind(model.cfg) != "mtp":
        return []
    held = [(n, p) for n, p in model.mtp.named_parameters() if p.requires_grad]
    for _, p in held:
        p.requires_grad_(False)
    return [f"mtp.{n}" for n, _ in held]


def check(section, cfg) -> None:
    """ValueError (one line, naming the key) when ``[drafter]`` cannot apply to the model's modules."""
    if section.block_size:
        raise ValueError(f"drafter.block_size = {section.block_size}: the model's {cfg.num_nextn_predict_layers} "
                         "multi-token prediction module(s) draft one token each; set drafter.block_size = 0")
    if cfg.num_nextn_predict_layers >= section.new_tokens:
        raise ValueError(f"drafter.new_tokens = {section.new_tokens}; expected more than the model's "
                         f"{cfg.num_nextn_predict_layers} multi-token prediction module(s)")


def build(model, recipe, par, dev, policy) -> MTPDrafter:
    """The model's own modules (loaded, sharded and resumed with it), less what the recipe's freezes hold."""
    from trex.train.moe_balance import freeze_for_post_training

    t = recipe.train
    return MTPDrafter(model, lambda m: freeze_for_post_training(m, t.freeze_indexer, "frozen", t.router_frozen()))


def trainable_parameters(drafter: MTPDrafter) -> list[torch.Tensor]:
    return drafter.trainable


def block_size(drafter: MTPDrafter, section) -> int:
    """One token per module."""
    return drafter.block_size


def width(drafter: MTPDrafter, width: int, section, par) -> int:
    """The teacher-forced forward splits the rows over a context-parallel group: a width it accepts."""
    return mtp_width(drafter.cfg, width, section.new_tokens, par.cp)


def target_layers(drafter: MTPDrafter) -> None:
    """None: the modules read the model's own forward, not kept hidden states."""
    return None


def draft(drafter: MTPDrafter, model, c: Continuation, anchors: int, block: int) -> tuple[torch.Tensor, None]:
    """(the modules' logits through one forward of the model, no confidence head)."""
    return drafter.draft_logits(model, c, anchors), None


def measure(drafter: MTPDrafter, model, prompts: list[list[int]], section, pad_id: int, stop_ids: tuple[int, ...],
            par) -> Acceptance:
    return measure_mtp_acceptance(model, prompts, section.measure_tokens, pad_id, stop_ids,
                                  batch_size=max(1, len(prompts)), shards=par.cp)


def export(drafter: MTPDrafter, source: str | None, path: str, target_step: int, main: bool) -> str | None:
    """Write the re-fit MTP modules (trex names ``mtp.*``, as trained) to ``path``/model.safetensors with
    ``target.json`` (the main step whose target they were fitted to): `trex ckpt export` of that step's
    checkpoint writes them in place of the checkpoint's (which the main steps left). Every rank calls it (the
    modules' shards are gathered); rank 0 writes, the directory replaced whole. ``source`` is not read."""
    import json

    from safetensors.torch import save_file

    state = {k: whole(v).contiguous().cpu() for k, v in drafter.state_dict().items()}
    if not main:
        return None
    tmp = path + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    save_file(state, os.path.join(tmp, "model.safetensors"))
    atomic.write_text(os.path.join(tmp, "target.json"), json.dumps({"target_step": target_step}, indent=1) + "\n")
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)
    return path
