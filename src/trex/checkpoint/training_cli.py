"""``trex ckpt verify DIR`` and ``trex ckpt export DIR OUT``: training checkpoints (trex.checkpoint.training)."""

from __future__ import annotations

import argparse
import json
import sys

from trex.checkpoint.cli import add_output_arguments
from trex.logs import plural


def register(sub) -> None:
    p = sub.add_parser("verify", help="check a training checkpoint's files and checksums against its manifest",
                       description="Check that every file of a training checkpoint is present with the size and "
                                   "sha256 of its manifest. DIR is a step_<N> directory, or a checkpoints "
                                   "directory: then every step_<N> in it is checked. Exit code 1 if any fails.")
    p.add_argument("dir", help="a step_<N> checkpoint directory, or the directory holding them")
    p.add_argument("--format", choices=("text", "json"), default="text",
                   help="text: a verdict per checkpoint; json: a report per checkpoint (default: %(default)s)")
    p.set_defaults(func=_cmd_verify)

    p = sub.add_parser("export", help="write a training checkpoint's model as safetensors (hf or official layout)")
    p.add_argument("dir", help="a step_<N> training checkpoint directory")
    p.add_argument("out", help="new directory (written atomically)")
    add_output_arguments(p)
    p.add_argument("--source", help="the checkpoint the run started from (default: its recipe's model.path): its "
                                    "tokenizer, and V4.1's vision tower and DSpark stages, are written along")
    p.set_defaults(func=_cmd_export)


def _cmd_verify(args: argparse.Namespace) -> int:
    import os

    from trex.checkpoint.training import list_checkpoints
    from trex.checkpoint.manifest import MANIFEST, verify_checkpoint

    paths = [args.dir]
    if not os.path.exists(os.path.join(args.dir, MANIFEST)) and list_checkpoints(args.dir):
        paths = [p for _, p in list_checkpoints(args.dir)]
    reports = [verify_checkpoint(p) for p in paths]
    if args.format == "json":
        print(json.dumps([r.to_dict() for r in reports], indent=2))
    else:
        print("\n".join(r.format() for r in reports))
    return 0 if all(r.ok for r in reports) else 1


def _cmd_export(args: argparse.Namespace) -> int:
    from trex.checkpoint.errors import CheckpointError
    from trex.checkpoint.export import export_checkpoint

    try:
        files = export_checkpoint(args.dir, args.out, layout=args.layout, dtype=args.dtype, quantize=args.quantize,
                                  max_shard_size=args.max_shard_size, overwrite=args.overwrite, source=args.source)
    except (CheckpointError, ValueError) as e:
        print(f"trex ckpt export: {e}", file=sys.stderr)
        return 2
    print(f"wrote {plural(len(files), 'shard')} to {args.out}")
    return 0
