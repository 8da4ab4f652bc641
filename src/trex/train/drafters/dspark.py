"""The drafter kind ``dspark``: DeepSeek-V4.1's DSpark stages (``trex.models.deepseek_v4.dspark.DSparkDrafter``),
a module of their own beside the model: loaded from the checkpoint's ``mtp.*`` (a preset: freshly
initialised), sharded like the model (EP, then FSDP2), drafting a block of ``block_size`` tokens per anchor
from the target layers' hidden states, exported in the released ``mtp.*`` layout. The interface the re-fit
calls: ``trex.train.drafters``.
"""

from __future__ import annotations

import json
import logging
import os

import torch

from trex.rollout.speculation import Acceptance, Continuation, measure_acceptance
from trex.parallel.parameter_view import whole

log = logging.getLogger(__name__)

EXPORT_DIR = "released"  # under the re-fit's checkpoint directory


def check(section, cfg) -> None:
    """ValueError (one line, naming the key) when ``[drafter]`` cannot apply to the config's stages."""
    if section.block_size and section.block_size >= section.new_tokens:
        raise ValueError(f"drafter.block_size = {section.block_size}; expected fewer than drafter.new_tokens = "
                         f"{section.new_tokens} (each anchor needs a block of continuation after it)")
    if not section.block_size and cfg.dspark_block_size >= section.new_tokens:
        raise ValueError(f"drafter.new_tokens = {section.new_tokens}; expected more than the config's "
                         f"dspark_block_size = {cfg.dspark_block_size}")


def build(model, recipe, par, dev, policy):
    """The checkpoint's drafter (``model.path``) or, for a preset, a fresh one; trainable, under the job's layout."""
    drafter = load(model.cfg, recipe.model.path, par, dev, policy, recipe.model.init_seed).requires_grad_(True)
    shard_drafter(drafter, par, policy)
    return drafter


def load(cfg, source: str | None, par, dev, policy, seed: int):
    """The DSpark drafter of the checkpoint at ``source`` (a load problem: ValueError in one line naming it), or
    of a preset's config freshly initialised with ``seed`` (the same in a resumed run)."""
    from trex.checkpoint.load import load_drafter
    from trex.models.common.heads import init_parameters
    from trex.models.registry import architecture

    dtype = torch.float32 if par.distributed else policy.param_dtype
    if source:
        try:
            return load_drafter(source, dtype=dtype, device=dev.name)
        except Exception as e:  # noqa: BLE001 -- any load problem is the same user fault here
            raise ValueError(f"drafter.enabled: model.path {source}: {' '.join(str(e).split())}") from None
    log.warning("drafter: the model is a preset: its drafter starts from a fresh initialisation")
    with torch.device(dev.torch_device):
        drafter = architecture(cfg).load("drafter")(cfg).to(dtype)
    init_parameters(drafter, cfg.initializer_range, seed)  # the same in a resumed run (its RNG is restored)
    return drafter


def shard_drafter(drafter, par, policy) -> None:
    """The drafter under the main job's layout: routed experts by EP over ``ep``, then FSDP2 (the experts on
    the expert data-parallel mesh, the drafter as one unit: its forward gathers the stages); gradients
    summed, as the main model's."""
    if not par.distributed:
        return
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import Shard

    from trex.parallel.expert_parallel import shard_experts

    mp = MixedPrecisionPolicy(param_dtype=policy.compute_dtype, reduce_dtype=policy.reduce_dtype)
    if par.ep > 1 and shard_experts(drafter, par.ep_mesh, par.tp_mesh if par.ep_spans_tp else None):
        local = drafter.cfg.dspark_n_routed_experts // par.ep
        placement = Shard(0) if local % par.expert_dp_mesh.size(1) == 0 else Shard(1)
        for stage in drafter.mtp:
            fully_shard(stage.ffn.experts, mesh=par.expert_dp_mesh, mp_policy=mp, shard_placement_fn=lambda p: placement)
    fully_shard(drafter, mesh=par.dp_mesh, mp_policy=mp)
    for module in drafter.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    # drafting (``prefill``, ``draft``) calls the experts' units before any forward of the root: initialise the
    # root now, or the experts' unit would take itself for one
    drafter._get_fsdp_state()._lazy_init()


class gathered:
    """The drafter's stages whole while drafting (``prefill`` and ``draft`` reach into them outside its
    forward); a no-op unsharded."""

    def __init__(self, module):
        self.module = module

    def __enter__(self):
        if hasattr(self.module, "unshard"):
            self.module.unshard()
        return self.module

    def __exit__(self, *_):
        if hasattr(self.module, "reshard"):
            self.module.reshard()


def trainable_parameters(drafter) -> list[torch.Tensor]:
    """All of the drafter's."""
    return list(drafter.parameters())


def block_size(drafter, section) -> int:
    """``drafter.block_size`` of the recipe, else the config's ``dspark_block_size``."""
    return section.block_size or drafter.cfg.dspark_block_size


def width(drafter, width: int, section, par) -> int:
    return width


def target_layers(drafter) -> list[int]:
    return drafter.target_layers


def draft(drafter, model, c: Continuation, anchors: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``DSparkDrafter.forward`` over the tap layers' hidden states (blocks of ``block``), with the target's
    embedding and head."""
    embed, head = whole(model.embed.weight), whole(model.head.weight)
    return drafter(c.hidden, c.ids, c.positions, c.width - 1, anchors, embed, head, block)


def measure(drafter, model, prompts: list[list[int]], section, pad_id: int, stop_ids: tuple[int, ...],
            par) -> Acceptance:
    with gathered(drafter):
        return measure_acceptance(model, drafter, prompts, section.measure_tokens, pad_id, stop_ids,
                                  batch_size=max(1, len(prompts)))


def export(drafter, source: str | None, path: str, target_step: int, main: bool) -> str | None:
    """Write the drafter's stages in the released ``mtp.*`` layout (official names; FP8 32x32 linears and FP4
    experts when the source checkpoint stored its stages so, else bf16) with the run's config.json, where
    ``load_drafter`` reads them and ``trex ckpt export`` carries them (``target.json``: the main step whose
    target they were fitted to). Every rank calls it (a sharded drafter is gathered); rank 0 writes."""
    from trex.checkpoint.layouts import TrexTensor, plan_outputs
    from trex.checkpoint.reader import CheckpointReader
    from trex.checkpoint.save import checkpoint_config
    from trex.checkpoint.writer import write_checkpoint

    state = {k: whole(v) for k, v in drafter.state_dict().items()}
    if not main:
        return None
    quantize, hint = None, None
    if source:
        reader = CheckpointReader(source)
        codecs = {s.codec for sources in reader.drafter_sources.values() for s in sources} - {"plain"}
        if codecs:
            quantize = "fp8+fp4experts" if "fp4" in codecs else "fp8"
            hint = reader.stored if reader.layout == "official" else None  # unchanged blocks keep their scales
    tensors = [TrexTensor(k, tuple(v.shape), v.dtype, lambda e, v=v: v if e is None else v[e]) for k, v in state.items()]
    cfg = drafter.cfg
    groups = plan_outputs(tensors, "official", torch.bfloat16, quantize, cfg.architecture, hint, cfg.num_hidden_layers)
    write_checkpoint(path, groups, checkpoint_config(cfg, "official", "bf16", quantize, source), overwrite=True,
                     copies={"target.json": _target_file(path, target_step)})
    return path


def _target_file(path: str, step: int) -> str:
    import tempfile

    fd, name = tempfile.mkstemp(suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump({"target_step": step}, f)
    return name
