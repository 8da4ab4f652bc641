"""`trex profile RECIPE`: where a training step's time goes, and what it would take on an accelerator.

The parser; the work is trex.profile.run (imported when the command runs: it imports torch).
"""

from __future__ import annotations

import argparse
import sys

from trex import logs


def register(sub) -> None:
    p = sub.add_parser(
        "profile", help="time a recipe's step by class (GEMMs, attention, MoE, mHC, optimizer, ...) under "
                        "torch.profiler, and estimate it on accelerators",
        description="Run a few steps of a recipe where the recipe says (its device, precision, layout, compile), "
                    "profile the last ones and print the step by class: time, share, kernels, FLOPs, bytes, "
                    "achieved rates; MFU, tokens/s, the optimizer's share, peak memory; and the same ops priced "
                    "on each hardware profile (trex plan --hardware list), eager and compiled. Writes "
                    "profile.json and trace.json (Chrome trace) in --out (docs/profiling.md).")
    p.add_argument("recipe", help="recipe TOML file")
    p.add_argument("--steps", type=int, default=2, help="profiled steps (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=1,
                   help="steps run first and not profiled: compilation, allocator warm-up (default: %(default)s)")
    p.add_argument("--out", default="runs/profile",
                   help="run directory of the profile run, replaced on each profile (default: %(default)s)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a recipe value; repeatable (the same --set as trex train's)")
    p.add_argument("--hardware", default="all",
                   help="hardware profiles to estimate the step on, comma-separated, or all (default: %(default)s)")
    p.add_argument("--as-dtype", choices=("bf16", "fp16"),
                   help="estimate the model's fp32 work as if run in this precision (a CPU fp32 trace for a "
                        "bf16 device run); default: as recorded")
    p.add_argument("--meta", action="store_true",
                   help="run no step: record the recipe's step (its model, seq_len, micro-batch, grad_accum, "
                        "precision, optimizer) on the meta device, at any size in seconds and no memory, and "
                        "estimate it on the hardware profiles; no times are measured (default: off, the steps run)")
    p.add_argument("--format", choices=("table", "json"), default="table",
                   help="table: for people; json: the report (default: %(default)s)")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from trex.recipe import RecipeError, load
    from trex.train.config import TrainRecipe

    try:
        recipe = load(TrainRecipe, args.recipe, args.overrides)
        if args.device:
            recipe.train.device = args.device
        hardware = _hardware(args.hardware)
        from trex.profile.run import estimate_on_meta, profile_with_estimates

        report = (estimate_on_meta(recipe, args.out, hardware, args.as_dtype) if args.meta else
                  profile_with_estimates(recipe, args.out, args.steps, args.warmup, hardware, args.as_dtype))
    except (RecipeError, ValueError) as e:
        print(f"trex profile: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"trex profile: {logs.os_error_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("trex profile: interrupted; no profile written", file=sys.stderr)
        return 130
    if args.format == "json":
        from trex import atomic

        print(atomic.strict_json(report))
    else:
        from trex.profile.report import format_report

        print(format_report(report))
    return 0


def _hardware(spec: str) -> list:
    from trex.hardware import load_profiles

    profiles = load_profiles()
    names = sorted(n for n, p in profiles.items() if p.memory_gbps > 0) if spec == "all" else [
        n.strip() for n in spec.split(",") if n.strip()]
    unknown = [n for n in names if n not in profiles]
    if unknown:
        raise ValueError(f"--hardware {spec}: no hardware profile {', '.join(unknown)}; known: "
                         f"{', '.join(sorted(profiles))}")
    return [profiles[n] for n in names]
