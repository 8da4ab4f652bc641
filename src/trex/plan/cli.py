"""``trex plan``: will a post-training run fit, how fast will it go, on how many devices.

The parser; the command itself is trex.plan.command, imported when it runs (it imports torch).
"""

from __future__ import annotations

import argparse

from trex.models.registry import PRESETS


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
    p.add_argument("--layout", default="", help="Layout fields, e.g. dp_shard=64,ep=32,pp=1,micro_batch=1; tp=N for tensor "
                                                "parallelism, with sequence parallelism unless "
                                                "sequence_parallel=false; train_engram=true, train_indexer=true for what trains "
                                                "beyond the default (default: none: the recipe's layout, or the "
                                                "fastest that fits)")
    p.add_argument("--override", default="", metavar="FIELD=VALUE,...",
                   help="model config fields changed on the preset, as a recipe's [model] overrides, e.g. "
                        "num_nextn_predict_layers=0 (no MTP module)")
    p.add_argument("--recompute", choices=("none", "selective", "full"),
                   help="activation recomputation (default: the recipe's, else none)")
    p.add_argument("--optimizer", choices=("adamw", "muon"), help="optimizer (default: the recipe's, else muon)")
    p.add_argument("--offload", action="store_true", help="optimizer moments in host memory")
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), help="compute dtype (default: recipe or bf16)")
    # the defaults are trex.plan.timing.TimeAssumptions' (which imports torch); tests/test_cli_help.py keeps them equal
    p.add_argument("--efficiency", type=float, help="achieved share of peak FLOP/s while computing (default: 0.55)")
    p.add_argument("--efficiency-from", metavar="PROFILE_JSON",
                   help="take --efficiency from a `trex profile` report: its measured forward+backward MFU (a device "
                        "run), or its compiled estimate on --hardware (a --meta or CPU run); default: none, --efficiency's value")
    p.add_argument("--fsdp-overlap", type=float, help="share of FSDP traffic hidden behind compute (default: 0.9)")
    p.add_argument("--ep-overlap", type=float, help="share of the EP all-to-all hidden behind compute (default: 0.5)")
    p.add_argument("--search", action="store_true", help="rank every fitting layout by step time")
    p.add_argument("--top", type=int, default=15, help="rows of the --search table (default: %(default)s)")
    p.add_argument("--format", choices=("table", "json"), default="table",
                   help="table: for people; json: the plan, for scripts and trex report (default: %(default)s)")
    p.add_argument("--annotate", action="store_true",
                   help="rewrite the recipe's planned lines ('#   512 x h200-sxm: ...') with fresh plans")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from trex.plan.command import run

    return run(args)
