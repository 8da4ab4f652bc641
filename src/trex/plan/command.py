"""What ``trex plan`` does with its parsed arguments (the parser: trex.plan.cli)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

from trex import atomic, logs
from trex.hardware import HardwareProfile, load_profiles
from trex.models.common.config import ConfigError
from trex.models.registry import PRESETS, AnyConfig, config_from_file, get_preset, with_overrides
from trex.plan import annotate
from trex.plan.layout import Layout, PlanError, parse_layout
from trex.plan.planner import (fewest_devices, layout_changes, make_plan, nearest_fitting, no_fit_hint, search,
                               with_drafter)
from trex.plan.report import plan_dict, plan_table, search_table
from trex.plan.timing import TimeAssumptions

DEFAULT_SEQ = 4096


def resolve_model(spec: str) -> AnyConfig:
    """A preset name (any architecture of trex.models.registry: each family plans through its plan terms), a
    config.json, or a checkpoint directory holding one."""
    if spec in PRESETS:
        return get_preset(spec)
    if os.path.exists(spec):
        return config_from_file(spec)
    guess = os.path.basename(os.path.normpath(spec)).lower()
    if guess in PRESETS:  # a recipe's checkpoint path on another machine, named after the model
        print(f"note: {spec} is not here; planning with the {guess} preset", file=sys.stderr)
        return get_preset(guess)
    raise PlanError(f"model {spec!r}: not a preset ({', '.join(sorted(PRESETS))}) and no such config file")


def parse_overrides(text: str) -> dict:
    """``"num_nextn_predict_layers=0,index_topk=1024"`` -> config field overrides (integers, floats, true/false,
    else strings), as a recipe's ``[model] overrides``."""
    out = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise PlanError(f"--override: cannot read {item!r}; expected FIELD=VALUE")
        value = value.strip()
        for kind in (int, float):
            try:
                out[key.strip()] = kind(value)
                break
            except ValueError:
                continue
        else:
            out[key.strip()] = {"true": True, "false": False}.get(value.lower(), value)
    return out


def resolve_hardware(name: str | None) -> HardwareProfile:
    profiles = load_profiles()
    if name is None or name not in profiles:
        what = "--hardware is required" if name is None else f"unknown hardware {name!r}"
        raise PlanError(f"{what}; profiles: {', '.join(sorted(profiles))} (add one: docs/mfu.md)")
    return profiles[name]


def recipe_inputs(path: str, devices: int | None) -> tuple[str | None, Layout, int, str | None]:
    """The model spec, layout, sequence length and compute dtype a training recipe asks for; a
    ``dp_shard = -1`` recipe takes its shard size from ``devices``."""
    from trex import recipe as recipe_io
    from trex.train.config import TrainRecipe

    r = recipe_io.load(TrainRecipe, path)
    par = r.parallel
    if par.dp_shard == -1 and not devices:
        raise PlanError(f"{path}: [parallel] dp_shard = -1 takes every rank; say how many with --devices")
    tp = par.tp
    shard = par.dp_shard if par.dp_shard != -1 else devices // (par.dp_replicate * par.cp * tp)
    layout = Layout(dp_shard=shard, dp_replicate=par.dp_replicate, ep=par.ep, cp=par.cp, tp=tp,
                    sequence_parallel=par.sequence_parallel, micro_batch=r.data.micro_batch_size,
                    grad_accum=r.train.grad_accum,
                    recompute=par.activation_checkpointing, optimizer=r.optim.name,
                    reduce_every_micro_batch=par.reduce_every_micro_batch, train_engram=r.train.engram == "train",
                    train_indexer=r.train.indexer_loss > 0)
    has_checkpoint = bool(r.model.path) and os.path.exists(r.model.path)
    model_spec = r.model.path if has_checkpoint or not r.model.preset else r.model.preset
    return model_spec, layout, r.data.seq_len, (r.precision.dtype if r.precision.dtype != "auto" else None)


def recipe_model(path: str, spec: str):
    """The model config ``spec`` names (``resolve_model``), with the recipe at ``path``'s ``model.overrides``
    applied when ``spec`` is its preset or its checkpoint (as `trex train` builds it)."""
    from trex import recipe as recipe_io
    from trex.train.config import TrainRecipe

    cfg = resolve_model(spec)
    r = recipe_io.load(TrainRecipe, path)
    if spec in (r.model.preset, r.model.path):
        try:
            cfg = with_overrides(cfg, r.model.overrides)
        except ValueError as e:
            raise PlanError(f"{path}: {e}") from None
    return cfg


def plan_recipe(path: str, devices: int, hardware: str, assume: TimeAssumptions = TimeAssumptions()):
    """The plan of a recipe's own layout on ``devices`` x ``hardware``."""
    spec, layout, seq, dtype = recipe_inputs(path, devices)
    if layout.devices != devices:
        raise PlanError(f"{path}: its layout {layout.describe()} uses {layout.devices} devices, not {devices}")
    assume = dataclasses.replace(assume, dtype=dtype or assume.dtype)
    cfg = recipe_model(path, spec)
    return _with_recipe_drafter(make_plan(cfg, layout, seq, resolve_hardware(hardware), assume), cfg, path)


def _with_recipe_drafter(plan, cfg, path: str | None):
    """``plan`` with the recipe's ``[drafter]`` re-fit counted, when the recipe at ``path`` enables one."""
    if not path:
        return plan
    from trex import recipe as recipe_io
    from trex.train.config import TrainRecipe

    r = recipe_io.load(TrainRecipe, path)
    return with_drafter(plan, cfg, r.drafter, r.train.steps) if r.drafter.enabled else plan


def _annotate(path: str) -> int:
    text = open(path, encoding="utf-8").read()
    found = annotate.targets(text)
    if not found:
        raise PlanError(f"{path}: no planned lines to annotate (a comment line '#   512 x h200-sxm:' names "
                        "a cluster the recipe is meant for)")
    plans = {t.line: plan_recipe(path, t.devices, t.hardware) for t in found}
    new = annotate.rewrite(text, {i: annotate.verdict(p) for i, p in plans.items()})
    if new != text:
        atomic.write_text(path, new)
    for t in found:
        print(f"{path}:{t.line + 1}: {t.devices} x {t.hardware}: {annotate.verdict(plans[t.line])}")
    return 0 if all(p.fits for p in plans.values()) else 1


def efficiency_from(path: str, hw: HardwareProfile) -> float:
    """The compute efficiency a `trex profile` report gives for ``hw``: measured on that device, the
    forward + backward's MFU (the step's MFU over its share outside the optimizer); else the roofline
    estimate's compiled forward + backward MFU on ``hw`` (trex.profile.estimate)."""
    try:
        with open(path) as f:
            report = json.load(f)
    except (OSError, ValueError) as e:
        raise PlanError(f"--efficiency-from {path}: not a trex profile report ({e})") from None
    if not isinstance(report, dict) or "classes" not in report:
        raise PlanError(f"--efficiency-from {path}: not a trex profile report (no classes)")
    measured = report.get("mfu")
    if measured and report.get("device") != "meta" and hw.device_type == str(report["device"]).split(":")[0]:
        return measured / max(1e-9, 1 - report.get("optimizer_share", 0.0))
    for est in report.get("estimates", []):
        if est.get("hardware") == hw.name and est.get("mfu_compiled_forward_backward"):
            return float(est["mfu_compiled_forward_backward"])
    raise PlanError(f"--efficiency-from {path}: no measurement on a {hw.name} and no estimate for it "
                    f"(profile with --hardware {hw.name})")


def _check_ranges(args: argparse.Namespace) -> None:
    """Numbers the planner divides by or scales with, against their ranges (one line, exit 2)."""
    for flag, value, ok, expected in (
            ("--seq", args.seq, lambda v: v >= 1, "a positive number of tokens"),
            ("--devices", args.devices, lambda v: v >= 1, "at least 1"),
            ("--global-batch-tokens", args.global_batch_tokens, lambda v: v >= 1, "a positive number of tokens"),
            ("--efficiency", args.efficiency, lambda v: 0 < v <= 1, "a share of peak in (0, 1]"),
            ("--fsdp-overlap", args.fsdp_overlap, lambda v: 0 <= v <= 1, "a share in [0, 1]"),
            ("--ep-overlap", args.ep_overlap, lambda v: 0 <= v <= 1, "a share in [0, 1]"),
            ("--top", args.top, lambda v: v >= 1, "at least 1")):
        if value is not None and not ok(value):
            raise PlanError(f"{flag} {value:g}: expected {expected}")


def _inputs(args: argparse.Namespace) -> tuple[str, AnyConfig, Layout, int, str]:
    """(model spec, model, layout, sequence length, dtype) from the recipe and the flags."""
    base, model_spec, seq, dtype = Layout(dp_shard=1), args.model, args.seq, args.dtype
    if args.recipe:
        spec, base, recipe_seq, recipe_dtype = recipe_inputs(args.recipe, args.devices)
        model_spec, seq, dtype = model_spec or spec, seq or recipe_seq, dtype or recipe_dtype
    if model_spec is None:
        raise PlanError("give a recipe or --model")
    cfg = recipe_model(args.recipe, model_spec) if args.recipe else resolve_model(model_spec)
    cfg = with_overrides(cfg, parse_overrides(args.override), "--override")
    if seq is None:
        seq = DEFAULT_SEQ
        print(f"note: no recipe or --seq: planning {seq}-token sequences", file=sys.stderr)
    if not args.recipe and args.devices:
        base = dataclasses.replace(base, dp_shard=args.devices)
    changes = {k: v for k, v in (("recompute", args.recompute), ("optimizer", args.optimizer)) if v}
    if args.offload:
        changes["offload_optimizer"] = True
    layout = parse_layout(args.layout, dataclasses.replace(base, **changes))
    if args.global_batch_tokens and not args.search:  # a search finds grad_accum for every layout
        rows_per_step = layout.micro_batch * seq * layout.data_parallel
        if args.global_batch_tokens % rows_per_step:
            raise PlanError(f"--global-batch-tokens {args.global_batch_tokens} is not a multiple of micro_batch x "
                            f"seq x data-parallel ranks = {rows_per_step}")
        layout = dataclasses.replace(layout, grad_accum=args.global_batch_tokens // rows_per_step)
    if args.devices and not args.search and layout.devices != args.devices:
        raise PlanError(f"the layout {layout.describe()} uses {layout.devices} devices, not --devices {args.devices}")
    return model_spec, cfg, layout, seq, dtype or "bf16"


def _emit(args: argparse.Namespace, data, text: str) -> None:
    print(json.dumps(data, indent=2) if args.format == "json" else text)


def _hardware_list(args: argparse.Namespace) -> int:
    profiles = list(load_profiles().values())
    _emit(args, [dataclasses.asdict(p) for p in profiles],
          "\n".join(f"{p.name:18s} {p.unit:4s} {p.peak_tflops.get('bf16', 0):7.1f} TFLOP/s bf16 {p.memory_gib:5g} GiB  "
                    f"{p.source}" for p in profiles))
    return 0


def _recipe_clusters(args: argparse.Namespace) -> int:
    """``trex plan RECIPE``: the recipe's own layout on each cluster its header names."""
    text = open(args.recipe, encoding="utf-8").read()
    found = annotate.targets(text)
    if not found:
        raise PlanError(f"{args.recipe}: give --devices and --hardware, or name the clusters the recipe is for in "
                        "its header, one line each ('#   512 x h200-sxm:'; --annotate fills in the verdicts)")
    spec = recipe_inputs(args.recipe, found[0].devices)[0]
    plans = [(t, plan_recipe(args.recipe, t.devices, t.hardware)) for t in found]
    _emit(args, [plan_dict(p, spec) for _, p in plans],
          "\n\n".join(f"== {args.recipe}:{t.line + 1}: {t.devices} x {t.hardware}\n{plan_table(p, spec)}"
                       for t, p in plans))
    return 0 if all(p.fits for _, p in plans) else 1


def _fewest(args: argparse.Namespace, spec: str, cfg: AnyConfig, layout: Layout, seq: int, hw: HardwareProfile,
            assume: TimeAssumptions) -> int:
    """No device count: the fewest devices that fit, and the fastest layout there."""
    found = fewest_devices(cfg, seq, hw, assume, optimizer=layout.optimizer,
                           global_batch_tokens=args.global_batch_tokens, trained=layout.trained())
    if found is None:
        reason = f"{spec} at {seq:,}-token sequences does not fit on any number of {hw.name} devices the planner tries"
        _emit(args, {"fits": False, "model": spec, "seq_len": seq, "hardware": hw.name, "reasons": [reason]},
              f"no device count fits: {reason}")
        return 1
    best = found.plans[0]
    batch = (f"{found.global_batch_tokens:,} tokens per step" if found.global_batch_tokens else
             "one sequence per device per step; --global-batch-tokens fixes the batch")
    fewer = f"{found.fewer} do not fit" if found.fewer else "one device fits"
    said = (f"fewest devices that fit: {found.devices} x {hw.name}; {fewer} ({batch}).\n"
            f"The fastest of the {len(found.plans)} layouts that fit there:")
    _emit(args, {**plan_dict(best, spec), "fewest_devices": {
        "devices": found.devices, "fewer_do_not_fit": found.fewer, "layouts_that_fit": len(found.plans),
        "global_batch_tokens": found.global_batch_tokens}}, f"{said}\n{plan_table(best, spec)}")
    return 0


def _plan(args: argparse.Namespace) -> int:
    if args.hardware == "list":
        return _hardware_list(args)
    _check_ranges(args)
    if args.annotate:
        if not args.recipe:
            raise PlanError("--annotate rewrites a recipe's planned lines: give the recipe")
        return _annotate(args.recipe)
    if args.recipe and not args.devices and not args.hardware:
        return _recipe_clusters(args)
    spec, cfg, layout, seq, dtype = _inputs(args)
    hw = resolve_hardware(args.hardware)
    if args.efficiency_from:
        if args.efficiency is not None:
            raise PlanError("--efficiency and --efficiency-from: give one")
        args.efficiency = efficiency_from(args.efficiency_from, hw)
    given = {"compute_efficiency": args.efficiency, "fsdp_overlap": args.fsdp_overlap, "ep_overlap": args.ep_overlap}
    assume = TimeAssumptions(**{k: v for k, v in given.items() if v is not None}, dtype=dtype)
    if not (args.recipe or args.devices or args.layout):
        return _fewest(args, spec, cfg, layout, seq, hw, assume)
    chosen = None
    if args.search or not (args.recipe or args.layout):
        # --search, or a model and a device count only: the fastest layout that fits rather than ep=1; --recompute
        # and --offload, when given, narrow the search
        devices = args.devices or layout.devices
        batch = args.global_batch_tokens or layout.global_batch_tokens(seq)
        narrow = {"recompute": (args.recompute,)} if args.recompute else {}
        narrow |= {"offload": (True,)} if args.offload else {}
        plans = search(cfg, devices, seq, batch, hw, assume, optimizer=layout.optimizer,
                       trained=layout.trained(), **narrow)
        if not plans:
            hint = no_fit_hint(cfg, devices, seq, batch, hw, assume, layout.optimizer, layout.trained())
            _emit(args, {"fits": False, "model": spec, "devices": devices, "seq_len": seq, "global_batch_tokens": batch,
                         "hardware": hw.name, "reasons": [hint]}, f"no layout fits: {hint}")
            return 1
        if args.search:
            _emit(args, [plan_dict(p, spec) for p in plans[: args.top]], search_table(plans, args.top))
            return 0
        chosen = (f"no recipe or --layout: the planner chose the fastest of {len(plans)} layouts that fit "
                  "(--search ranks them, --layout picks one)")
        print(f"note: {chosen}", file=sys.stderr)
        layout = plans[0].layout
    plan = _with_recipe_drafter(make_plan(cfg, layout, seq, hw, assume), cfg, args.recipe)
    data, text = plan_dict(plan, spec), plan_table(plan, spec)
    if chosen:
        data["chosen"], text = chosen, f"{text}\nchosen      {chosen}"
    elif not plan.fits:
        data["nearest_fitting"], line = _nearest(cfg, plan, hw, assume)
        text = f"{text}\n{line}"
    _emit(args, data, text)
    return 0 if plan.fits else 1


def _nearest(cfg: AnyConfig, plan, hw: HardwareProfile, assume: TimeAssumptions) -> tuple[dict | None, str]:
    """The layout that fits on the same devices and batch and changes the fewest of ``plan``'s choices (JSON,
    and one line saying it with its changes and throughput)."""
    layout = plan.layout
    plans = search(cfg, layout.devices, plan.seq_len, plan.global_batch_tokens, hw, assume,
                   optimizer=layout.optimizer, trained=layout.trained())
    near = nearest_fitting(layout, plans)
    if near is None:
        hint = no_fit_hint(cfg, layout.devices, plan.seq_len, plan.global_batch_tokens, hw, assume,
                           layout.optimizer, layout.trained())
        return None, f"nearest     none fits on {layout.devices} devices at this batch: {hint}"
    changes = layout_changes(layout, near.layout)
    return ({"layout": near.layout.describe(), "changes": changes, "memory_bytes": near.memory.total,
             "tokens_per_s_per_device": near.tokens_per_s_per_device},
            f"nearest     the layout that fits with the fewest changes: {near.layout.describe()} ({'; '.join(changes)}): "
            f"{near.memory.total / 2**30:.1f} GiB, {near.tokens_per_s_per_device:,.0f} tokens/s per device")


def run(args: argparse.Namespace) -> int:
    try:
        return _plan(args)
    except (PlanError, ConfigError, ValueError) as e:
        message = str(e)
    except OSError as e:  # a recipe that is missing, or read-only under --annotate
        message = logs.os_error_line(e)
    if args.format == "json":
        print(json.dumps({"error": message}))
    print(f"trex plan: {message}", file=sys.stderr)
    return 2
