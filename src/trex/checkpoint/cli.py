"""``trex ckpt ...``: checkpoint commands (convert, inspect).

The group is extensible like the top-level CLI: a module listed in ``CKPT_COMMAND_MODULES``
exposes ``register(ckpt_subparsers)`` that adds its subcommand and sets ``func``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys

# Modules that add ``trex ckpt`` subcommands through register(ckpt_subparsers).
CKPT_COMMAND_MODULES: tuple[str, ...] = ("trex.checkpoint.training_cli",)


def add_output_arguments(p: argparse.ArgumentParser) -> None:
    """The options of every command that writes safetensors through the weights writer."""
    p.add_argument("--layout", choices=("hf", "official"), required=True)
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16",
                   help="dtype of unquantised tensors (default: %(default)s; fp32 keeps a full-precision source whole)")
    p.add_argument("--quantize", choices=("fp8", "fp8+fp4experts"), default=None)
    p.add_argument("--max-shard-size", default="5GB")
    p.add_argument("--overwrite", action="store_true", help="replace the output directory if it exists")


def register(subparsers: argparse._SubParsersAction) -> None:
    group = subparsers.add_parser("ckpt", help="convert and inspect DeepSeek-V4 checkpoints")
    sub = group.add_subparsers(dest="ckpt_command", required=True, metavar="CKPT_COMMAND")

    p = sub.add_parser("convert", help="stream a checkpoint into another layout / precision (bounded memory)")
    p.add_argument("src", help="checkpoint directory (any layout, bf16/fp32/FP8/FP4)")
    p.add_argument("dst", help="new directory (written atomically)")
    add_output_arguments(p)
    p.add_argument("--src-layout", choices=("auto", "hf", "official"), default="auto")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=_cmd_convert)

    p = sub.add_parser("inspect", help="layout, dtypes, quantisation, parameters, missing/unexpected keys, shards")
    p.add_argument("path")
    p.add_argument("--layout", choices=("auto", "hf", "official"), default="auto")
    p.add_argument("--format", choices=("text", "json"), default="text")
    p.set_defaults(func=_cmd_inspect)

    for module in CKPT_COMMAND_MODULES:
        importlib.import_module(module).register(sub)


def _cmd_convert(args: argparse.Namespace) -> int:
    from trex.checkpoint.errors import CheckpointError
    from trex.checkpoint.save import convert

    try:
        files = convert(args.src, args.dst, layout=args.layout, dtype=args.dtype, quantize=args.quantize,
                        max_shard_size=args.max_shard_size, src_layout=args.src_layout, overwrite=args.overwrite,
                        progress=not args.no_progress)
    except (CheckpointError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {len(files)} shard(s) to {args.dst}")
    return 0


def _cmd_inspect(args: argparse.Namespace) -> int:
    from trex.checkpoint.errors import CheckpointError
    from trex.checkpoint.inspect import format_report, inspect_checkpoint

    if os.path.exists(os.path.join(args.path, ".metadata")) or os.path.isdir(os.path.join(args.path, "checkpoints")) \
            or os.path.basename(os.path.normpath(args.path)) == "checkpoints":
        print(f"trex ckpt inspect: {args.path} is a training checkpoint (DCP) or holds them: `trex ckpt verify "
              f"{args.path}` checks it, and `trex ckpt export {args.path} OUT` writes its model as safetensors, "
              "which inspect reads", file=sys.stderr)
        return 2
    try:
        report = inspect_checkpoint(args.path, layout=args.layout)
    except (CheckpointError, ValueError) as e:
        print(f"trex ckpt inspect: {e}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=2) if args.format == "json" else format_report(report))
    return 1 if report["problems"] else 0
