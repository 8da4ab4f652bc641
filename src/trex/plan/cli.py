"""``trex plan``: will a post-training run fit, how fast will it go, on how many devices."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

from trex.hardware import HardwareProfile, load_profiles
from trex.models.config import PRESETS, ConfigError, ModelConfig, get_preset
from trex.plan.layout import Layout, PlanError, parse_layout
from trex.plan.planner import make_plan, search
from trex.plan.report import plan_dict, plan_table, search_table
from trex.plan.timing import TimeAssumptions


def register(sub) -> None:
    p = sub.add_parser("plan", help="memory, fit, step time and MFU of a training layout; --search for layouts",
                       description="Plan a full-parameter post-training run: parameters, memory per device, "
                                   "whether it fits, step time, tokens/s and MFU (docs/planning.md).")
    p.add_argument("recipe", nargs="?", help="recipe TOML: model, seq_len, micro-batch, grad_accum, [parallel]")
    p.add_argument("--model", help=f"preset ({', '.join(sorted(PRESETS))}) or a config.json path")
    p.add_argument("--hardware", help="hardware profile name (trex plan --hardware list)")
    p.add_argument("--devices", type=int, help="devices (ranks: one card, or one die on Ascend 910C)")
    p.add_argument("--seq", type=int, help="tokens per sequence")
    p.add_argument("--global-batch-tokens", type=int, help="tokens per optimizer step (sets grad_accum)")
    p.add_argument("--layout", default="", help="Layout fields, e.g. dp_shard=64,ep=32,pp=1,micro_batch=1")
    p.add_argument("--recompute", choices=("none", "selective", "full"))
    p.add_argument("--optimizer", choices=("adamw", "muon"))
    p.add_argument("--offload", action="store_true", help="optimizer moments in host memory")
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), help="compute dtype (default: recipe or bf16)")
    p.add_argument("--efficiency", type=float, default=TimeAssumptions.compute_efficiency,
                   help="achieved share of peak FLOP/s while computing")
    p.add_argument("--fsdp-overlap", type=float, default=TimeAssumptions.fsdp_overlap)
    p.add_argument("--ep-overlap", type=float, default=TimeAssumptions.ep_overlap)
    p.add_argument("--search", action="store_true", help="rank every fitting layout by step time")
    p.add_argument("--top", type=int, default=15, help="rows of the --search table")
    p.add_argument("--format", choices=("table", "json"), default="table")
    p.set_defaults(func=_run)


def resolve_model(spec: str) -> ModelConfig:
    """A preset name, a config.json, or a checkpoint directory holding one."""
    if spec in PRESETS:
        return get_preset(spec)
    if os.path.exists(spec):
        return ModelConfig.from_file(spec)
    guess = os.path.basename(os.path.normpath(spec)).lower()
    if guess in PRESETS:  # a recipe's checkpoint path on another machine, named after the model
        print(f"note: {spec} is not here; planning with the {guess} preset", file=sys.stderr)
        return get_preset(guess)
    raise PlanError(f"model {spec!r}: not a preset ({', '.join(sorted(PRESETS))}) and no such config file")


def resolve_hardware(name: str | None) -> HardwareProfile:
    profiles = load_profiles()
    if name is None or name not in profiles:
        what = "--hardware is required" if name is None else f"unknown hardware {name!r}"
        raise PlanError(f"{what}; profiles: {', '.join(sorted(profiles))} (add one: docs/mfu.md)")
    return profiles[name]


def _inputs(args: argparse.Namespace) -> tuple[ModelConfig, Layout, int, str]:
    base, model_spec, seq, dtype = Layout(dp_shard=1), args.model, args.seq, args.dtype
    if args.recipe:
        from trex import recipe as recipe_io
        from trex.train.config import TrainRecipe

        r = recipe_io.load(TrainRecipe, args.recipe)
        par = r.parallel
        if par.dp_shard == -1 and not args.devices:
            raise PlanError(f"{args.recipe}: [parallel] dp_shard = -1 takes every rank; say how many with --devices")
        shard = par.dp_shard if par.dp_shard != -1 else args.devices // par.dp_replicate
        base = Layout(dp_shard=shard, dp_replicate=par.dp_replicate, ep=par.ep,
                      micro_batch=r.data.micro_batch_size, grad_accum=r.train.grad_accum,
                      recompute=par.activation_checkpointing, optimizer=r.optim.name,
                      reduce_every_micro_batch=par.reduce_every_micro_batch)
        has_checkpoint = bool(r.model.path) and os.path.exists(r.model.path)
        model_spec = model_spec or (r.model.path if has_checkpoint or not r.model.preset else r.model.preset)
        seq = seq or r.data.seq_len
        dtype = dtype or (r.precision.dtype if r.precision.dtype != "auto" else None)
    if model_spec is None:
        raise PlanError("give a recipe or --model")
    if seq is None:
        raise PlanError("give a recipe or --seq")
    if not args.recipe and args.devices:
        base = dataclasses.replace(base, dp_shard=args.devices)
    changes = {k: v for k, v in (("recompute", args.recompute), ("optimizer", args.optimizer)) if v}
    if args.offload:
        changes["offload_optimizer"] = True
    layout = parse_layout(args.layout, dataclasses.replace(base, **changes))
    if args.global_batch_tokens:
        rows_per_step = layout.micro_batch * seq * layout.data_parallel
        if args.global_batch_tokens % rows_per_step:
            raise PlanError(f"--global-batch-tokens {args.global_batch_tokens} is not a multiple of micro_batch x "
                            f"seq x data-parallel ranks = {rows_per_step}")
        layout = dataclasses.replace(layout, grad_accum=args.global_batch_tokens // rows_per_step)
    if args.devices and not args.search and layout.devices != args.devices:
        raise PlanError(f"the layout {layout.describe()} uses {layout.devices} devices, not --devices {args.devices}")
    return resolve_model(model_spec), layout, seq, dtype or "bf16"


def _run(args: argparse.Namespace) -> int:
    try:
        if args.hardware == "list":
            for p in load_profiles().values():
                print(f"{p.name:18s} {p.unit:4s} {p.peak_tflops.get('bf16', 0):7.1f} TFLOP/s bf16 "
                      f"{p.memory_gib:5g} GiB  {p.source}")
            return 0
        cfg, layout, seq, dtype = _inputs(args)
        hw = resolve_hardware(args.hardware)
        assume = TimeAssumptions(compute_efficiency=args.efficiency, fsdp_overlap=args.fsdp_overlap,
                                 ep_overlap=args.ep_overlap, dtype=dtype)
        if args.search:
            devices = args.devices or layout.devices
            plans = search(cfg, devices, seq, args.global_batch_tokens or layout.global_batch_tokens(seq), hw,
                           assume, optimizer=layout.optimizer)
            if args.format == "json":
                print(json.dumps([plan_dict(p) for p in plans[: args.top]], indent=2))
            else:
                print(search_table(plans, args.top))
            return 0 if plans else 1
        plan = make_plan(cfg, layout, seq, hw, assume)
        print(json.dumps(plan_dict(plan), indent=2) if args.format == "json" else plan_table(plan))
        return 0 if plan.fits else 1
    except (PlanError, ConfigError, ValueError) as e:
        print(f"trex plan: {e}", file=sys.stderr)
        return 2
