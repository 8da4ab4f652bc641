"""`trex train`: run a recipe, or the built-in default job when no recipe is given."""

from __future__ import annotations

import argparse
import os
import sys

from trex import logs


def register(sub) -> None:
    p = sub.add_parser("train", help="train from a TOML recipe (no recipe: the built-in default job)",
                       description="Train from a TOML recipe. Without one, run the built-in default job: a tiny "
                                   "DeepSeek-V4 learns arithmetic (continued pretraining, then SFT).")
    p.add_argument("recipe", nargs="?", help="recipe TOML file")
    p.add_argument("--out", help="run directory (train.out)")
    p.add_argument("--steps", type=int, help="optimizer steps (train.steps; default job: both stages)")
    p.add_argument("--seed", type=int, help="seed (train.seed)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a recipe value; repeatable")
    p.add_argument("--save-every", type=int, help="checkpoint every N steps and at the end (checkpoint.save_every)")
    p.add_argument("--resume", metavar="auto|PATH",
                   help="resume from the newest checkpoint that verifies, or from PATH (checkpoint.resume)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an earlier run in the run directory instead of refusing (train.overwrite)")
    p.add_argument("--dry-run", action="store_true",
                   help="build the full model on the meta device under a fake process group and print per-rank memory")
    p.add_argument("--world-size", type=int, help="ranks that --dry-run simulates (required with --dry-run)")
    p.set_defaults(func=_run)

    data = sub.add_parser("data", help="prepare a recipe's data once, for every rank to memory-map").add_subparsers(
        dest="data_command", required=True, metavar="WHAT")
    d = data.add_parser("prepare", help="read, validate, tokenize and pack a recipe's [data] into a prepared "
                                        "directory (default: the cache entry trex train looks up)")
    d.add_argument("recipe", help="recipe TOML file")
    d.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a recipe value; repeatable (the same --set as trex train's)")
    d.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                   help="tokenizing processes (default: %(default)s, every core); the result is the same for any "
                        "number")
    d.add_argument("--out", help="write this directory (then train with data.prepared = it) instead of the cache")
    d.add_argument("--refresh", action="store_true",
                   help="prepare again even if the cache entry (or --out) exists; the old copy is replaced only "
                        "once the new one is complete (default: off, an existing entry is reused)")
    d.add_argument("--format", choices=("text", "json"), default="text",
                   help="text: one summary line; json: the manifest (default: %(default)s)")
    d.set_defaults(func=_data_prepare)

    bench = sub.add_parser("bench", help="benchmarks of a recipe's parts").add_subparsers(
        dest="bench_command", required=True, metavar="WHAT")
    b = bench.add_parser("data", help="data pipeline tokens/s vs the tokens/s the training step consumes")
    b.add_argument("recipe", help="recipe TOML file")
    b.add_argument("--batches", type=int, default=200, help="micro-batches to time (default: %(default)s)")
    b.add_argument("--steps", type=int, default=3, help="training steps to time, 0: data only (default: %(default)s)")
    b.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a recipe value; repeatable")
    b.add_argument("--format", choices=("text", "json"), default="text",
                   help="text: tokens/s of build, iteration and training; json: the report (default: %(default)s)")
    b.set_defaults(func=_bench_data)


def _run(args: argparse.Namespace) -> int:
    from trex.parallel.mesh import shutdown_distributed

    code = _run_job(args)
    if code == 0:  # the job's model and optimizer are out of scope here: the process group can go
        shutdown_distributed()
    return code


def prepare_command(args: argparse.Namespace, out: str) -> str:
    """The `trex data prepare` command that rewrites ``out`` for the recipe and --set options of this train."""
    import shlex

    sets = "".join(f" --set {shlex.quote(o)}" for o in args.overrides)
    return f"trex data prepare {shlex.quote(args.recipe)}{sets} --out {shlex.quote(out)} --refresh"


def resume_command(args: argparse.Namespace) -> str:
    """The `trex train` command that continues this one from its newest checkpoint: the same recipe, --set
    options and flags, with ``--resume auto`` (in place of any --resume, and without --overwrite)."""
    import shlex

    words = ["trex", *(["--device", args.device] if args.device else []), "train"]
    words += [args.recipe] if args.recipe else []
    for o in args.overrides:
        words += ["--set", o]
    for flag, value in (("--out", args.out), ("--steps", args.steps), ("--seed", args.seed),
                        ("--save-every", args.save_every)):
        if value is not None:
            words += [flag, str(value)]
    return shlex.join([*words, "--resume", "auto"])


def _run_job(args: argparse.Namespace) -> int:
    from trex.data.prepared import PreparedDataError
    from trex.recipe import RecipeError, load
    from trex.precision import NonFiniteError
    from trex.rollout.engine import EngineDied
    from trex.train.loop import Terminated

    try:
        if args.recipe is None:
            from trex.train.default_job import DefaultJob, run_default_job

            job = load(DefaultJob, overrides=args.overrides)
            if args.out:
                job.out = args.out
            if args.seed is not None:
                job.seed = args.seed
            if args.steps:
                job.scale_steps(args.steps)
            if args.device:
                job.device = args.device
            run_default_job(job)
            return 0
        from trex.data.records import describe_skips
        from trex.train.config import TrainRecipe
        from trex.train.loop import train

        overrides = list(args.overrides)
        for flag, key in ((args.out, "train.out"), (args.steps, "train.steps"), (args.seed, "train.seed"),
                          (args.device, "train.device"), (args.save_every, "checkpoint.save_every"),
                          (args.resume, "checkpoint.resume"), (args.overwrite or None, "train.overwrite")):
            if flag is not None:
                value = repr(flag) if isinstance(flag, str) else str(flag).lower() if isinstance(flag, bool) else flag
                overrides.append(f"{key}={value}")
        recipe = load(TrainRecipe, args.recipe, overrides)
        if args.dry_run:
            from trex.train.dry_run import dry_run, format_report

            if args.world_size is None or args.world_size < 1:
                raise ValueError("--dry-run needs --world-size N")
            print(format_report(dry_run(recipe, args.world_size)))
            return 0
        result = train(recipe)
        if int(os.environ.get("RANK", "0")) == 0:  # rank 0 speaks for the job
            left_out = describe_skips(result.summary.get("data", {}))
            if left_out:
                print(f"trex train: data: {left_out} (summary.json: data)", file=sys.stderr)
            health = result.summary["health"]
            skips = ("no skipped step, no non-finite loss or gradient" if health["clean"] else
                     f"{logs.plural(health['skipped_steps'], 'skipped step')} ("
                     f"{logs.plural(health['nonfinite_loss_steps'], 'non-finite loss', 'non-finite losses')}, "
                     f"{logs.plural(health['nonfinite_gradient_steps'], 'non-finite gradient')})")
            print(f"{result.summary['status']}: {logs.plural(result.summary['steps_completed'], 'step')}, "
                  f"final loss {result.summary['final'].get('loss', float('nan')):.4f}, {skips}; "
                  f"{result.run_dir}/summary.json")
        return 0
    except PreparedDataError as e:
        print(f"trex train: {e.detail}" + (f"; prepare it again: {prepare_command(args, e.refresh)}, or unset "
                                           f"data.prepared" if e.refresh else ""), file=sys.stderr)
        return 2
    except (RecipeError, ValueError) as e:  # config, data and checkpoint errors name their source
        print(f"trex train: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a data path that matches nothing, an unwritable or full disk: the path and why
        print(f"trex train: {logs.os_error_line(e)}", file=sys.stderr)
        return 2
    except NonFiniteError as e:
        print(f"trex train: {e} (summary.json and loss.png written)", file=sys.stderr)
        return 3
    except EngineDied as e:  # a process of the job is gone, as a lost rank (4); summary.json says so too
        print(f"trex train: {e}", file=sys.stderr)
        return 4
    except KeyboardInterrupt:
        print("trex train: interrupted; summary.json and loss.png written", file=sys.stderr)
        return 130
    except Terminated as e:  # a scheduler's preemption: every rank saved and stops; rank 0 says where
        if int(os.environ.get("RANK", "0")) == 0:
            if e.saved:
                again = ("the same trex launch command with --resume auto"
                         if int(os.environ.get("WORLD_SIZE", "1")) > 1 else resume_command(args))
                saved, resume = f"saved {e.saved}, ", f"resume: {again}"
            else:
                saved, resume = "", "no checkpoint (checkpoint.save_every = 0): a new run starts from step 0"
            print(f"trex train: stopped by SIGTERM at step {e.step}; {saved}{e.run_dir}/summary.json and loss.png "
                  f"written; {resume}", file=sys.stderr)
        return e.code


def _data_prepare(args: argparse.Namespace) -> int:
    """Prepare the recipe's data (its [data] section) into --out or the cache; one summary line."""
    import dataclasses
    import json
    from pathlib import Path

    from trex.data.prepared import ensure, every, prepare, writable_dir
    from trex.data.records import describe_skips
    from trex.recipe import RecipeError, load
    from trex.train.config import TrainRecipe
    from trex.train.loop import tokenizer_for

    # a line every 10 s (a prepare of billions of tokens runs for hours)
    report = every(10.0, lambda line: print(f"trex data prepare: {line}", file=sys.stderr, flush=True))
    try:
        if args.workers < 1:
            raise ValueError(f"--workers {args.workers}: expected at least 1")
        recipe = load(TrainRecipe, args.recipe, args.overrides)
        cfg = dataclasses.replace(recipe.data, prepared="")
        cfg.validate()
        tokenizer = tokenizer_for(cfg.tokenizer)
        if args.out:
            out = Path(args.out)
            if out.exists() and not args.refresh:
                raise ValueError(f"--out {out}: exists; add --refresh to prepare it again (the old copy is replaced "
                                 f"once the new one is complete)")
            writable_dir(out.parent, f"--out {out}: its parent directory")
            path, manifest, here = out, prepare(cfg, tokenizer, out, args.workers, report, replace=True), True
        else:
            path, manifest, here = ensure(cfg, tokenizer, args.workers, report=report, refresh=args.refresh)
    except (RecipeError, ValueError) as e:
        print(f"trex data prepare: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"trex data prepare: {logs.os_error_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("trex data prepare: interrupted; nothing was kept", file=sys.stderr)
        return 130
    if args.format == "json":
        print(json.dumps({"path": str(path), "prepared_here": here, **manifest}, indent=2))
        return 0
    c, p, t = manifest["counts"], manifest["packing"], manifest["prepared"]
    left_out = describe_skips(manifest["skips"])
    print(f"{'prepared' if here else 'already prepared'} {path}: {logs.plural(c['records_read'], 'record')} -> "
          f"{logs.plural(c['documents'], 'document')}, {logs.plural(c['tokens'], 'token')}, "
          f"{logs.plural(c['rows'], 'row')} of {p['seq_len']} "
          f"({p['algorithm']} packing {p['efficiency']:.1%}, padding {p['padding_share']:.1%}); "
          f"{t['seconds']:.1f}s, {c['tokens'] / max(t['seconds'], 1e-9) / 1e6:.2f}M tokens/s on "
          f"{logs.plural(t['workers'], 'worker')}" + (f"; {left_out}" if left_out else ""))
    return 0


def _bench_data(args: argparse.Namespace) -> int:
    """Time the data pipeline, then a few real training steps of the same recipe, and compare."""
    import dataclasses
    import json
    import tempfile

    from trex.data.bench import bench_data
    from trex.recipe import RecipeError, load
    from trex.train.config import EvalSection, TrainRecipe
    from trex.train.loop import tokenizer_for, train

    try:
        recipe = load(TrainRecipe, args.recipe, args.overrides)
        tokenizer = tokenizer_for(recipe.data.tokenizer)
        result = bench_data(recipe.data, tokenizer, args.batches)
        step_tps = None
        if args.steps:
            with tempfile.TemporaryDirectory() as out:
                short = dataclasses.replace(recipe, eval=EvalSection(), train=dataclasses.replace(
                    recipe.train, steps=args.steps, out=out, eval_every=0, progress=False))
                step_tps = train(short, tokenizer=tokenizer).summary["final"]["tokens_per_s"]
    except (RecipeError, ValueError) as e:
        print(f"trex bench data: {e}", file=sys.stderr)
        return 2
    report = result.report(step_tps)
    if args.format == "json":
        print(json.dumps(report, indent=2))
        return 0
    print(f"build:     {report['build_seconds']:.2f}s, {report['build_tokens_per_s']:,.0f} tokens/s "
          f"({logs.plural(report['summary']['documents'], 'document')}, packing "
          f"{report['summary']['packing_efficiency']:.1%}, {report['summary']['skipped']} skipped)")
    batches = logs.plural(report['batches'], 'micro-batch', 'micro-batches')
    print(f"iterate:   {report['iter_tokens_per_s']:,.0f} tokens/s over {batches}")
    if step_tps:
        verdict = "data keeps up" if report["headroom"] >= 1 else "DATA IS THE BOTTLENECK"
        print(f"training:  {step_tps:,.0f} tokens/s per step -> headroom {report['headroom']:.0f}x ({verdict})")
    return 0
