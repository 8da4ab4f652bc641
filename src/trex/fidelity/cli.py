"""`trex fidelity compare | export | matrix | calibrate | record | ladder | seam | profiles`."""

from __future__ import annotations

import argparse
import os
import sys

from trex import logs
from trex.fidelity.profiles import PROFILES


def register(sub) -> None:
    p = sub.add_parser("fidelity", help="convergence fidelity: compare a run with a reference, golden files, matrix")
    fid = p.add_subparsers(dest="fidelity_command", required=True, metavar="WHAT")

    c = fid.add_parser("compare", help="does RUN converge like REFERENCE? exit 0 PASS, 1 FAIL, 2 bad input")
    c.add_argument("run", help="run directory (or golden file)")
    c.add_argument("reference", help="run directory or golden reference file")
    c.add_argument("--profile", choices=PROFILES, default="layout",
                   help="the tolerances; `trex fidelity profiles` prints them (default: %(default)s)")
    c.add_argument("--set", dest="overrides", action="append", default=[], metavar="MEASURE=VALUE",
                   help="override one threshold of the profile (VALUE or off); repeatable")
    c.add_argument("--metric", default="loss", help="the metrics.jsonl curve to compare (default: loss)")
    c.add_argument("--prefix", action="store_true", help="the run may stop before the reference ends")
    c.add_argument("--envelope", choices=("note", "widen"), default="note",
                   help="with a calibrated reference: note thresholds tighter than its own spread, or widen them to "
                        "it (default: %(default)s)")
    c.add_argument("--out", help="report directory (default: RUN/fidelity, or ./fidelity-report for a file)")
    c.add_argument("--format", choices=("text", "json"), default="text",
                   help="text: a table of the measures; json: the result (default: %(default)s)")
    c.set_defaults(func=_compare)

    e = fid.add_parser("export", help="store a run as a golden reference file")
    e.add_argument("run", help="run directory")
    e.add_argument("out", help="golden file to write (JSON)")
    e.set_defaults(func=_export)

    m = fid.add_parser("matrix", help="run a recipe's variants against its fp32 single-process control")
    m.add_argument("recipe", help="recipe TOML file")
    m.add_argument("--out", default="runs/fidelity-matrix",
                   help="matrix directory, its runs and report (default: %(default)s)")
    m.add_argument("--steps", type=int, help="optimizer steps of every variant (default: the recipe's)")
    m.add_argument("--only", action="append", default=[], metavar="VARIANT", help="run only these variants")
    m.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a recipe value for every variant; repeatable")
    m.add_argument("--overwrite", action="store_true", help="replace what --out holds (default: refuse)")
    m.add_argument("--switches", action="store_true",
                   help="the accelerator switches (compile, fused kernels, bf16 Newton-Schulz, ...) against the "
                        "bf16 eager control, profile vendor, each layer group bounded by the control's own spread")
    m.set_defaults(func=_matrix)

    ca = fid.add_parser("calibrate", help="train the reference N times with its nondeterminism; write its "
                                          "run-to-run envelope into a golden file")
    ca.add_argument("recipe", nargs="?", help="recipe TOML file (the reference configuration)")
    ca.add_argument("--golden", required=True, help="golden file to write (JSON), with the envelope")
    ca.add_argument("--merge", action="append", default=[], metavar="GOLDEN",
                    help="instead of training: merge golden files calibrated on other machines into --golden "
                         "(repeat it; the spread of each measure is the largest, and says which machine it came from)")
    ca.add_argument("--runs", type=int, default=3, help="training runs (default 3)")
    ca.add_argument("--threads", default="1,2", help="intra-op thread counts the runs cycle through (default 1,2)")
    ca.add_argument("--vary", action="append", default=[], metavar="'SECTION.KEY=VALUE[;...]'",
                    help="overrides of one run after the first (the runs cycle through them); repeatable")
    ca.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="override a recipe value for every run; repeatable")
    ca.add_argument("--profile", choices=PROFILES, default="layout",
                    help="the profile whose measures are taken (default: %(default)s)")
    ca.add_argument("--out", default="runs/fidelity-calibration",
                    help="directory of the runs and the report (default: %(default)s)")
    ca.add_argument("--overwrite", action="store_true", help="replace what --out holds (default: refuse)")
    ca.set_defaults(func=_calibrate)

    se = fid.add_parser("seam", help="a run that moved (device, precision, layout): do the steps after the move "
                                     "converge like the old configuration? exit 0 PASS, 1 FAIL, 2 bad input")
    se.add_argument("run", help="run directory with migrations.jsonl")
    se.add_argument("--steps", type=int, default=3, help="steps after the move to judge (default 3)")
    se.add_argument("--reference", help="run directory, golden file or `trex fidelity record --from-checkpoint` "
                                        "directory with those steps (default: train a continuation on the old "
                                        "configuration here)")
    se.add_argument("--at", type=int, help="the move at this step (default: the last)")
    se.add_argument("--profile", choices=PROFILES, help="override the profile the move's kind chose")
    se.add_argument("--envelope", choices=("note", "widen"), default="note",
                    help="with a calibrated golden reference: note or widen thresholds tighter than its spread "
                         "(default: %(default)s)")
    se.set_defaults(func=_seam)

    rec = fid.add_parser("record", help="record the reference side of the ladder's rungs (statistics, not tensors) "
                                         "for a ladder on another cluster; run it like trex train (any layout)")
    rec.add_argument("recipe", help="recipe TOML file (the reference configuration)")
    rec.add_argument("--out", required=True, help="the record's directory (copy it to the other cluster)")
    rec.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                     help="override a recipe value; repeatable")
    rec.add_argument("--steps", type=int, help="steps of the long run (default: the recipe's); with --from-checkpoint: "
                                               "steps after the checkpoint (default 3)")
    rec.add_argument("--from-checkpoint", metavar="CHECKPOINT",
                     help="record a seam's reference instead: the recipe resumed from CHECKPOINT (the one a run moved "
                          "from) in this job's layout; `trex fidelity seam RUN --reference OUT` judges the move")
    rec.add_argument("--lr0-steps", type=int, help="steps of the lr = 0 run (default: the long run's)")
    rec.add_argument("--overwrite", action="store_true", help="replace what --out holds (default: refuse)")
    rec.set_defaults(func=_record)

    la = fid.add_parser("ladder", help="where does a variant depart? forward, backward, optimizer, lr=0, long run; "
                                       "exit 0 PASS, 1 FAIL, 2 bad input")
    la.add_argument("recipe", help="recipe TOML file (the reference configuration)")
    la.add_argument("--reference", help="a `trex fidelity record` directory: climb against it in this job's layout "
                                        "(any number of processes) instead of running the reference here")
    la.add_argument("--variant", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="what the variant changes; repeatable (required without --reference)")
    la.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="override a recipe value of both sides (with --reference: of this job, e.g. its layout); "
                         "repeatable")
    la.add_argument("--reference-set", dest="reference_set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="override a recipe value of the reference only; repeatable")
    la.add_argument("--profile", choices=PROFILES, default="layout",
                    help="the tolerances; `trex fidelity profiles` prints them (default: %(default)s)")
    la.add_argument("--steps", type=int, help="steps of rung 5, the long run (default: the recipe's; with --reference: "
                                              "the record's)")
    la.add_argument("--lr0-steps", type=int, help="steps of rung 4 at lr = 0 (default: the long run's)")
    la.add_argument("--out", default="runs/fidelity-ladder",
                    help="report directory, and the rungs' runs (default: %(default)s)")
    la.add_argument("--overwrite", action="store_true", help="replace what --out holds (default: refuse)")
    la.set_defaults(func=_ladder)

    dr = fid.add_parser("drafter", help="how many draft tokens a checkpoint's drafter gets accepted (greedy speculative "
                                        "decoding): DeepSeek-V4.1's DSpark stages or the MTP modules of V4 and the "
                                        "V3 family, beside its --base; exit 0, 2 bad input")
    dr.add_argument("checkpoint", help="a checkpoint directory with its drafter's mtp.* tensors (a trex export "
                                       "carries them)")
    dr.add_argument("--prompts", required=True,
                    help='JSONL (or Parquet): {"prompt": text} or {"messages": [...]}, rendered as a chat prompt '
                         '(as grpo.prompts and drafter.prompts are), or {"ids": [token ids]} per line')
    # the choices are trex.data.config.ChatFormat's, which is not imported here: it would load torch
    dr.add_argument("--chat-format", default="deepseek-v4", choices=("deepseek-v4", "deepseek-v3", "deepseek-v3.1"),
                    help="how text prompts are rendered, as the run's data.chat_format (default: %(default)s)")
    dr.add_argument("--base", help="the checkpoint it was post-trained from, measured on the same prompts")
    dr.add_argument("--max-new-tokens", type=int, default=64, help="greedy tokens per prompt (default 64)")
    dr.add_argument("--batch-size", type=int, default=16, help="prompts decoded together (default 16)")
    dr.add_argument("--format", choices=("text", "json"), default="text",
                    help="text: a table; json: each checkpoint's acceptance histogram and rates (default: "
                         "%(default)s)")
    dr.set_defaults(func=_drafter)

    pr = fid.add_parser("profiles", help="print the tolerance profiles, their thresholds and rationale")
    pr.set_defaults(func=_profiles)


def _drafter(args: argparse.Namespace) -> int:
    from trex.atomic import strict_json
    from trex.fidelity.drafter import DrafterCheckError, check_checkpoint, measure, read_prompts, table, to_dict

    try:
        if args.max_new_tokens < 2 or args.batch_size < 1:
            raise DrafterCheckError("--max-new-tokens must be >= 2 and --batch-size >= 1")
        for path in [args.checkpoint] + ([args.base] if args.base else []):
            check_checkpoint(path)
        prompts = read_prompts(args.prompts, args.checkpoint, args.chat_format)
        results = {}
        for path in [args.checkpoint] + ([args.base] if args.base else []):
            results[path] = measure(path, prompts, args.max_new_tokens, args.batch_size, args.device)
    except DrafterCheckError as e:
        print(f"trex fidelity drafter: {e}", file=sys.stderr)
        return 2
    if args.format == "json":
        print(strict_json({p: to_dict(a) for p, a in results.items()}))
    else:
        print(f"drafter acceptance: greedy, {logs.plural(len(prompts), 'prompt')}, up to "
              f"{args.max_new_tokens} tokens each")
        print(table(results))
    return 0


def _compare(args: argparse.Namespace) -> int:
    from trex.fidelity.compare import compare
    from trex.fidelity.profiles import get_profile, parse_overrides
    from trex.fidelity.report import table, write_all
    from trex.fidelity.runs import load_signals

    try:
        profile = get_profile(args.profile).with_overrides(parse_overrides(args.overrides))
        run, ref = load_signals(args.run), load_signals(args.reference)
        result = compare(run, ref, profile, metric=args.metric, allow_prefix=args.prefix, envelope=args.envelope)
    except ValueError as e:
        print(f"trex fidelity compare: {e}", file=sys.stderr)
        return 2
    out = args.out or (os.path.join(args.run, "fidelity") if os.path.isdir(args.run) else "fidelity-report")
    ref_name = os.path.splitext(os.path.basename(os.path.normpath(args.reference)))[0]
    paths = write_all(result, out, f"{profile.name}_vs_{ref_name}")
    if args.format == "json":
        from trex.atomic import strict_json

        print(strict_json(result.to_dict()))
    else:
        print(table(result))
        print(f"report: {paths['json']}  plot: {paths['png']}")
    return 0 if result.passed else 1


def _export(args: argparse.Namespace) -> int:
    from trex.fidelity.golden import export

    try:
        golden = export(args.run, args.out)
    except ValueError as e:
        print(f"trex fidelity export: {e}", file=sys.stderr)
        return 2
    print(f"{args.out}: {logs.plural(len(golden['metrics']), 'metric step')}, "
          f"{logs.plural(len(golden['grad_norms']), 'grad-norm record')}, "
          f"{logs.plural(len(golden['probe']), 'probe record')} ({os.path.getsize(args.out) / 1024:.0f} KiB)")
    return 0


def _user_faults(command: str, call):
    """``call()``'s result, or None after one line on stderr for a user fault: a bad recipe or value,
    a path that cannot be written."""
    from trex.recipe import RecipeError

    try:
        return call()
    except (RecipeError, ValueError) as e:
        message = str(e)
    except OSError as e:
        message = logs.os_error_line(e)
    print(f"trex fidelity {command}: {message}", file=sys.stderr)
    return None


def _matrix(args: argparse.Namespace) -> int:
    from trex.fidelity.matrix import run_matrix

    report = _user_faults("matrix", lambda: run_matrix(args.recipe, args.out, steps=args.steps, only=args.only,
                                                       overrides=args.overrides, overwrite=args.overwrite,
                                                       switches=args.switches))
    if report is None:
        return 2
    return 0 if report["verdict"] == "PASS" else 1


def _calibrate(args: argparse.Namespace) -> int:
    from trex.fidelity.calibrate import calibrate, markdown, merge, merge_markdown, thread_list, vary_sets
    from trex.fidelity.profiles import get_profile
    from trex.recipe import load
    from trex.train.config import TrainRecipe

    if args.merge or not args.recipe:
        if args.recipe or not args.merge:
            print("trex fidelity calibrate: give a RECIPE to calibrate, or --merge GOLDEN (twice or more) to merge; "
                  "not both", file=sys.stderr)
            return 2
        merged = _user_faults("calibrate", lambda: merge(args.merge, args.golden))
        if merged is None:
            return 2
        print(merge_markdown(merged, get_profile(args.profile)))
        return 0

    def call():
        load(TrainRecipe, args.recipe, args.overrides)  # a bad recipe is one line, before any run
        return calibrate(args.recipe, args.out, args.golden, get_profile(args.profile), runs=args.runs,
                         threads=thread_list(args.threads), vary=vary_sets(args.vary), overrides=args.overrides,
                         overwrite=args.overwrite)

    report = _user_faults("calibrate", call)
    if report is None:
        return 2
    print(markdown(report))
    return 0


def _seam(args: argparse.Namespace) -> int:
    from trex.fidelity.report import table
    from trex.fidelity.seam import seam

    done = _user_faults("seam", lambda: seam(args.run, steps=args.steps, reference=args.reference, at=args.at,
                                             profile=args.profile, envelope=args.envelope))
    if done is None:
        return 2
    print(table(done["result"]))
    for note in done["entry"]["notes"]:
        print(f"note: {note}")
    print(f"seams: {os.path.join(args.run, 'seams.json')}  report: {done['entry']['report']}  plot: "
          f"{done['entry']['plot']}")
    return 0 if done["entry"]["verdict"] == "PASS" else 1


def _main_rank() -> bool:
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0


def _in_job(command: str, call):
    """``_user_faults`` for a command every rank of a job runs; the process group is left at the end."""
    from trex.parallel.mesh import shutdown_distributed

    from trex.recipe import RecipeError

    try:
        if _main_rank():
            return _user_faults(command, call)
        try:
            return call()
        except (RecipeError, ValueError, OSError):  # rank 0 says it
            return None
    finally:
        shutdown_distributed()


def _record(args: argparse.Namespace) -> int:
    from trex.fidelity.record import record

    if args.from_checkpoint:
        from trex.fidelity.record import record_continuation

        done = _in_job("record", lambda: record_continuation(args.recipe, args.from_checkpoint, args.out,
                                                             args.overrides, steps=args.steps or 3,
                                                             overwrite=args.overwrite))
        if done is not None and _main_rank():
            print(f"{args.out}: steps {done['step'] + 1}-{done['step'] + done['steps']} after {done['checkpoint']} on "
                  f"{done['environment']['device']}: copy it to the run's cluster and run `trex fidelity seam RUN "
                  f"--reference {args.out}` there")
        return 2 if done is None else 0
    done = _in_job("record", lambda: record(args.recipe, args.out, args.overrides, steps=args.steps,
                                            lr0_steps=args.lr0_steps, overwrite=args.overwrite))
    if done is None:
        return 2
    if _main_rank():
        size = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(args.out) for f in files)
        print(f"{args.out}: the reference of every rung ({done['model']['parameter_tensors']:,} parameters, "
              f"{logs.plural(len(done['sets']['blocks']), 'block')}, {logs.plural(done['world_size'], 'rank')} on "
              f"{done['environment']['device']}; "
              f"{size / 1e6:.1f} MB): copy it to the other cluster and run `trex fidelity ladder RECIPE --reference "
              f"{args.out}` there")
    return 0


def _ladder(args: argparse.Namespace) -> int:
    from trex.fidelity.ladder import markdown, run_ladder
    from trex.fidelity.profiles import get_profile

    if args.reference:
        from trex.fidelity.record import climb

        report = _in_job("ladder", lambda: climb(args.recipe, args.reference, args.out, get_profile(args.profile),
                                                 [*args.overrides, *args.variant], overwrite=args.overwrite))
    else:
        if not args.variant:
            print("trex fidelity ladder: --variant SECTION.KEY=VALUE is required without --reference", file=sys.stderr)
            return 2
        report = _user_faults("ladder", lambda: run_ladder(
            args.recipe, [*args.overrides, *args.variant], args.out, get_profile(args.profile),
            reference_overrides=[*args.overrides, *args.reference_set],
            lr0_steps=args.lr0_steps, steps=args.steps, overwrite=args.overwrite))
    if report is None:
        return 2
    if _main_rank():
        print(markdown(report))
        print(f"report: {os.path.join(args.out, 'ladder.json')}  plot: {os.path.join(args.out, 'ladder.png')}")
    return 0 if report["verdict"] == "PASS" else 1


def _profiles(args: argparse.Namespace) -> int:
    from trex.fidelity.profiles import MEASURES, PROFILES

    for profile in PROFILES.values():
        print(f"== {profile.name}: {profile.use}")
        print(f"   {profile.rationale}")
        if profile.source:
            print(f"   source: {profile.source}")
        for measure in MEASURES:
            value = profile.thresholds.get(measure)
            print(f"   {measure:<26} {'off' if value is None else f'{value:g}':>8}")
        b = profile.ladder
        print(f"   ladder rungs 1-3: loss {b.loss:g}, block cosine >= {b.cosine:g}, block max-abs <= {b.max_abs_rel:g} "
              f"x max|ref|, gradient {b.grad:g}, update {b.update:g}, floor {b.floor:g}")
        print(f"   EMA weight {profile.ema:g}, layer-norm floor {profile.layer_norm_floor:g} x global norm"
              + (f", at least {logs.plural(profile.min_steps, 'step')}" if profile.min_steps else "") + "\n")
    return 0
