"""`trex train RECIPE --dry-run --world-size N`: the full model under the real parallel plan, on any CPU.

The model is built on the meta device (no memory), a fake process group stands in for N ranks, and
the recipe's parallel plan (expert parallel, FSDP2) is applied exactly as in training. What rank 0
would hold is then counted from the sharded parameters themselves.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from trex import device as device_layer
from trex.models import build_model, get_preset
from trex.models.registry import AnyConfig, config_from_file, with_overrides
from trex.parallel.mesh import init_parallel
from trex.parallel.plan import apply_parallelism
from trex.precision import PrecisionPolicy
from trex.train.config import TrainRecipe
from trex.train.moe_balance import ENGRAM_TABLE, freeze_for_post_training
from trex.train.optim import build_optimizer


def model_config(recipe: TrainRecipe) -> AnyConfig:
    """The checkpoint's config.json when the path exists here, else the recipe's preset; with the recipe's
    ``model.overrides`` on either, as `trex train` builds it."""
    if recipe.model.path and os.path.exists(recipe.model.path):
        return with_overrides(config_from_file(recipe.model.path), recipe.model.overrides)
    return with_overrides(get_preset(recipe.model.preset), recipe.model.overrides)


def dry_run(recipe: TrainRecipe, world_size: int) -> dict:
    """Per-rank bytes of parameters, gradients, master weights and optimizer state, and the mesh."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    cpu = device_layer.Device("cpu")
    layout = recipe.parallel
    dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())
    try:
        par = init_parallel(layout.dp_replicate, layout.dp_shard, layout.ep, layout.timeout_s, cpu, world_size,
                            cp=layout.cp, tp=layout.tp,
                            sequence_parallel=layout.sequence_parallel)
        # bf16 on this CPU is no warning: the dry run only counts bytes, nothing runs here
        policy = PrecisionPolicy.resolve(recipe.precision.dtype if recipe.precision.dtype != "auto" else "bf16",
                                         cpu, warn_slow=False)
        cfg = model_config(recipe)
        model = build_model(cfg, device="meta")
        freeze_for_post_training(model, recipe.train.freeze_indexer, recipe.train.engram, recipe.train.router_frozen(),
                                 only_indexer=recipe.train.indexer_warmup)
        apply_parallelism(model, par, policy, layout.activation_checkpointing)
        optimizer = build_optimizer(model, recipe.optim, cpu)
        algorithm = {id(p): g["algorithm"] for g in optimizer.param_groups for p in g["params"]}
        params = grads = optim_state = master = tables = 0
        trained = frozen = 0
        for name, p in model.named_parameters():
            local = p.to_local() if isinstance(p, DTensor) else p
            n = local.numel()
            params += n * 4  # sharded parameters are the fp32 master weights (FSDP casts for compute)
            tables += n * 4 if name.endswith(ENGRAM_TABLE) else 0
            if not p.requires_grad:
                frozen += n
                continue
            trained += n
            grads += n * 4  # fp32 gradient shards (reduce dtype)
            per_element = {"muon": 4, "adamw": 8, "rowwise_adagrad": 4 / local.shape[-1]}[algorithm[id(p)]]
            optim_state += int(n * per_element)
        compute = torch.tensor([], dtype=policy.compute_dtype).element_size()
        largest_block = max(  # a block's parameters gathered for its forward: its own experts, no Engram table
            sum(p.numel() // (par.ep if ".ffn.experts." in f".{name}" else 1) for name, p in block.named_parameters()
                if not f".{name}".endswith(ENGRAM_TABLE))
            for block in [*model.layers, *model.mtp])
        buffers = sum(b.numel() * b.element_size() for b in model.buffers())
        return {
            "world_size": world_size,
            "mesh": {"dp_replicate": par.dp_replicate, "dp_shard": par.dp_shard, "efsdp": par.efsdp,
                     "ep": par.ep, "cp": par.cp, "tp": par.tp},
            "precision": policy.to_dict(),
            "activation_checkpointing": layout.activation_checkpointing,
            "parameters_total": sum(p.numel() for p in model.parameters()),
            "per_rank": {
                "parameter_elements": trained + frozen,
                "params_fp32_bytes": params,
                "engram_table_bytes": tables,
                "grads_bytes": grads,
                "master_bytes": master,
                "optimizer_state_bytes": optim_state,
                "buffers_bytes": buffers,
                "largest_unsharded_block_bytes": largest_block * compute,
                "total_bytes": params + grads + master + optim_state + buffers + largest_block * compute,
            },
        }
    finally:
        dist.destroy_process_group()


def format_report(report: dict) -> str:
    gib = 2**30
    r = report["per_rank"]
    mesh = report["mesh"]
    ep_shard = mesh["dp_shard"] // mesh["efsdp"]  # the expert-parallel ranks inside dp_shard (ep / tp: spanning tp)
    experts = f"ep {mesh['ep']}" if ep_shard == mesh["ep"] else f"ep {mesh['ep']} / tp"
    lines = [
        f"world size {report['world_size']}: mesh dp_replicate={mesh['dp_replicate']} x dp_shard={mesh['dp_shard']} "
        f"(= efsdp {mesh['efsdp']} x {experts}) x cp={mesh['cp']} x tp={mesh['tp']}; "
        f"precision {report['precision']['name']}; "
        f"activation checkpointing {report['activation_checkpointing']}",
        f"model parameters: {report['parameters_total'] / 1e9:,.1f}B",
        "per rank (rank 0):",
        f"  parameters (fp32 master shards)  {r['params_fp32_bytes'] / gib:9.2f} GiB  ({r['parameter_elements'] / 1e9:.2f}B elements)",
        *([f"    of which Engram table rows     {r['engram_table_bytes'] / gib:9.2f} GiB  (rows split over every rank)"]
          if r["engram_table_bytes"] else []),
        f"  gradients (fp32 shards)          {r['grads_bytes'] / gib:9.2f} GiB",
        f"  extra master weights             {r['master_bytes'] / gib:9.2f} GiB  (the fp32 shards are the master)",
        f"  optimizer state                  {r['optimizer_state_bytes'] / gib:9.2f} GiB  (Muon 1 x fp32, AdamW 2 x fp32, tables 1 fp32 a row)",
        f"  buffers (router bias, hash)      {r['buffers_bytes'] / gib:9.2f} GiB",
        f"  largest gathered block (compute) {r['largest_unsharded_block_bytes'] / gib:9.2f} GiB",
        f"  total before activations         {r['total_bytes'] / gib:9.2f} GiB",
        "activations depend on micro-batch and sequence length: see `trex plan`.",
    ]
    return "\n".join(lines)
