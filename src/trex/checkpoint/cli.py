"""``trex ckpt ...``: checkpoint commands (convert, inspect).

The group is extensible like the top-level CLI: a module listed in ``CKPT_COMMAND_MODULES``
exposes ``register(ckpt_subparsers)`` that adds its subcommand and sets ``func``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shlex
import sys

from trex.logs import plural

# Modules that add ``trex ckpt`` subcommands through register(ckpt_subparsers).
CKPT_COMMAND_MODULES: tuple[str, ...] = ("trex.checkpoint.training_cli",)


def add_output_arguments(p: argparse.ArgumentParser) -> None:
    """The options of every command that writes safetensors through the weights writer."""
    p.add_argument("--layout", choices=("hf", "official"), required=True,
                   help="names to write: hf (transformers modules, fused experts; for the V3 family its released "
                        "checkpoints, expert by expert) or official (V4's released checkpoints)")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16",
                   help="dtype of unquantised tensors (default: %(default)s; fp32 keeps a full-precision source whole)")
    p.add_argument("--quantize", choices=("fp8", "fp8+fp4experts"), default=None,
                   help="fp8: the released FP8 weights with block scales (V4: ue8m0, V3 family: fp32); "
                        "fp8+fp4experts: routed experts as FP4 too (default: none, every tensor in --dtype)")
    p.add_argument("--max-shard-size", default="5GB", metavar="SIZE",
                   help="largest safetensors file, e.g. 500MB, 2GiB or bytes (default: %(default)s)")
    p.add_argument("--overwrite", action="store_true", help="replace the output directory if it exists")


def training_checkpoint(path: str) -> str | None:
    """What ``trex ckpt export`` and ``verify`` take for ``path`` when it is a training checkpoint rather
    than a safetensors one: a ``step_<N>`` directory (DCP ``.metadata`` or the manifest) or a directory
    of them (``<run>/checkpoints``) is itself; a run directory stands for its ``checkpoints``. None
    for anything else."""
    from trex.checkpoint.manifest import DCP_INDEX, MANIFEST
    from trex.checkpoint.training import list_checkpoints

    if any(os.path.exists(os.path.join(path, name)) for name in (DCP_INDEX, MANIFEST)) or list_checkpoints(path):
        return path
    if os.path.exists(os.path.join(path, "config.json")):
        return None
    if os.path.basename(os.path.normpath(path)) == "checkpoints" and os.path.isdir(path):
        return path
    run = os.path.join(path, "checkpoints")
    return run if os.path.isdir(run) else None


def _describe(path: str, trained: str) -> str:
    """``path`` as `training_checkpoint` read it (``trained``)."""
    if trained != path:
        return f"a run directory, whose training checkpoints (DCP) are in {trained}"
    if os.path.isdir(path) and not any(n.endswith(".distcp") or n in (".metadata", "manifest.json")
                                       for n in os.listdir(path)):
        return "a directory of training checkpoints (DCP step_<N>; export takes the newest that verifies)"
    return "a training checkpoint (DCP)"


def register(subparsers: argparse._SubParsersAction) -> None:
    group = subparsers.add_parser("ckpt", help="convert and inspect DeepSeek-V4 and V3-family checkpoints")
    sub = group.add_subparsers(dest="ckpt_command", required=True, metavar="CKPT_COMMAND")

    p = sub.add_parser("convert", help="stream a checkpoint into another layout / precision (bounded memory)")
    p.add_argument("src", help="checkpoint directory (any layout, bf16/fp32/FP8/FP4)")
    p.add_argument("dst", help="new directory (written atomically)")
    add_output_arguments(p)
    p.add_argument("--src-layout", choices=("auto", "hf", "official"), default="auto",
                   help="the source's names; auto: read from its tensor names (default: %(default)s)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (default: show one)")
    p.set_defaults(func=_cmd_convert)

    p = sub.add_parser("inspect", help="layout, dtypes, quantisation, parameters, missing/unexpected keys, shards")
    p.add_argument("path", help="checkpoint directory (safetensors and config.json)")
    p.add_argument("--layout", choices=("auto", "hf", "official"), default="auto",
                   help="the checkpoint's names; auto: read from its tensor names (default: %(default)s)")
    p.add_argument("--format", choices=("text", "json"), default="text",
                   help="text: a summary; json: the full report (default: %(default)s)")
    p.set_defaults(func=_cmd_inspect)

    for module in CKPT_COMMAND_MODULES:
        importlib.import_module(module).register(sub)


def _cmd_convert(args: argparse.Namespace) -> int:
    from trex.checkpoint.errors import CheckpointError
    from trex.checkpoint.save import convert

    trained = training_checkpoint(args.src)
    if trained is not None:
        export = ["trex", "ckpt", "export", trained, args.dst, "--layout", args.layout, "--dtype", args.dtype,
                  *(["--quantize", args.quantize] if args.quantize else []),
                  *(["--max-shard-size", args.max_shard_size] if args.max_shard_size != "5GB" else []),
                  *(["--overwrite"] if args.overwrite else [])]
        print(f"trex ckpt convert: {args.src} is {_describe(args.src, trained)}, which convert does not read; "
              f"export it instead, which writes the same output: {shlex.join(export)}", file=sys.stderr)
        return 2
    try:
        files = convert(args.src, args.dst, layout=args.layout, dtype=args.dtype, quantize=args.quantize,
                        max_shard_size=args.max_shard_size, src_layout=args.src_layout, overwrite=args.overwrite,
                        progress=not args.no_progress)
    except (CheckpointError, ValueError) as e:
        print(f"trex ckpt convert: {e}", file=sys.stderr)
        return 2
    print(f"wrote {plural(len(files), 'shard')} to {args.dst}")
    return 0


def _cmd_inspect(args: argparse.Namespace) -> int:
    from trex.checkpoint.errors import CheckpointError
    from trex.checkpoint.inspect import format_report, inspect_checkpoint

    trained = training_checkpoint(args.path)
    if trained is not None:
        print(f"trex ckpt inspect: {args.path} is {_describe(args.path, trained)}, which inspect does not read: "
              f"`{shlex.join(['trex', 'ckpt', 'verify', trained])}` checks it, and "
              f"`{shlex.join(['trex', 'ckpt', 'export', trained, 'OUT', '--layout', 'hf'])}` writes its model as "
              "safetensors, which inspect reads", file=sys.stderr)
        return 2
    try:
        report = inspect_checkpoint(args.path, layout=args.layout)
    except (CheckpointError, ValueError) as e:
        print(f"trex ckpt inspect: {e}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=2) if args.format == "json" else format_report(report))
    return 1 if report["problems"] else 0
