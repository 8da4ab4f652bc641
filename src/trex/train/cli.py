"""`trex train`: run a recipe, or the built-in default job when no recipe is given."""

from __future__ import annotations

import argparse
import sys


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
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from trex.recipe import RecipeError, load

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
        from trex.train.config import TrainRecipe
        from trex.train.loop import train

        overrides = list(args.overrides)
        for flag, key in ((args.out, "train.out"), (args.steps, "train.steps"), (args.seed, "train.seed"),
                          (args.device, "train.device")):
            if flag is not None:
                overrides.append(f"{key}={flag!r}" if isinstance(flag, str) else f"{key}={flag}")
        recipe = load(TrainRecipe, args.recipe, overrides)
        result = train(recipe)
        print(f"{result.summary['status']}: {result.summary['steps_completed']} steps, "
              f"final loss {result.summary['final'].get('loss', float('nan')):.4f}; {result.run_dir}/summary.json")
        return 0
    except (RecipeError, ValueError) as e:  # config, data and checkpoint errors name their source
        print(f"trex train: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("trex train: interrupted; summary.json and loss.png written", file=sys.stderr)
        return 130
