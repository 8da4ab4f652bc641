"""The ``trex`` command line.

Small commands live here; larger ones live in their own modules, each exposing
``register(subparsers)`` that adds its parser and sets ``func``. Listing the module in
``COMMAND_MODULES`` is all it takes to add one. Registering imports no torch (a command's function
imports what it needs when it runs), so ``trex --help``, ``trex audit`` and ``trex plan`` start in a
fraction of a second.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import sys

# Modules that add subcommands through register(subparsers).
COMMAND_MODULES: tuple[str, ...] = ("trex.train.cli", "trex.audit.cli", "trex.checkpoint.cli", "trex.profile.cli",
                                    "trex.plan.cli", "trex.fidelity.cli", "trex.report.cli", "trex.launch")


def _cmd_env(args: argparse.Namespace) -> int:
    from trex import device

    report = device.environment_report(device.detect(args.device))
    if args.format == "json":
        print(json.dumps(report, indent=2))
    else:
        for key, value in report.items():
            print(f"{key:>16}: {value}")
    return 0


def _cmd_doctor(args: argparse.Namespace) -> int:
    from trex import doctor

    return doctor.run(args)


def _cmd_smoke(args: argparse.Namespace) -> int:
    """Forward, backward and one AdamW step of the default tiny model; prints the loss."""
    import time

    import torch

    from trex import device
    from trex.models import build_model, get_preset

    dev = device.detect(args.device)
    dtype = dev.default_dtype()
    cfg = get_preset("tiny")
    model = build_model(cfg, device=dev.torch_device, dtype=dtype, seed=args.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, cfg.vocab_size, (2, args.seq), generator=gen).to(dev.torch_device)
    t0 = time.perf_counter()
    for step in range(2):
        out = model(ids, labels=ids)
        loss = out.loss + 0.1 * out.mtp_loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        print(f"step {step}: loss {out.loss.item():.4f}  mtp_loss {out.mtp_loss.item():.4f}")
    print(f"device {dev.name} dtype {str(dtype).replace('torch.', '')}  {time.perf_counter() - t0:.2f}s")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trex", description="Full-parameter post-training of DeepSeek-V4 models on any accelerator.")
    parser.add_argument("--device", default=None, help="cpu, cuda, npu, cuda:1 ... (default: auto / TREX_DEVICE)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("env", help="print the device, versions, backend and capabilities")
    p.add_argument("--format", choices=("text", "json"), default="text",
                   help="text: one key per line; json: one object (default: %(default)s)")
    p.set_defaults(func=_cmd_env)

    p = sub.add_parser("doctor", help="check devices, versions, precision and collectives before launch")
    p.add_argument("--format", choices=("text", "json"), default="text",
                   help="text: a summary per section; json: the full report (default: %(default)s)")
    p.add_argument("--size-mb", type=float, default=64.0,
                   help="message size for the bandwidth test, MiB (default: %(default)s)")
    p.add_argument("--iters", type=int, default=5, help="timed iterations per collective (default: %(default)s)")
    p.add_argument("--timeout", type=float, default=120.0,
                   help="process-group timeout, seconds (default: %(default)s)")
    p.set_defaults(func=_cmd_doctor)

    p = sub.add_parser("smoke", help="forward + backward + one optimizer step of the tiny model")
    p.add_argument("--seq", type=int, default=64, help="tokens per sequence (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the weights and the random tokens (default: %(default)s)")
    p.set_defaults(func=_cmd_smoke)

    for module in COMMAND_MODULES:
        importlib.import_module(module).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["launch"]:  # torchrun's flags, parsed by torchrun's own parser
        from trex.launch import launch

        sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
        return launch(argv[1:], commands=set(sub.choices) - {"launch"})
    args = build_parser().parse_args(argv)
    from trex import logs

    try:
        logs.to_terminal()
    except ValueError as e:  # TREX_LOG_LEVEL
        print(f"trex: {e}", file=sys.stderr)
        return 2
    try:
        return args.func(args)
    except BrokenPipeError:  # `trex ... | head`: the reader left; stop quietly, as SIGPIPE would
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # Python's final flush of stdout must not fail again
        return 128 + signal.SIGPIPE
    except Exception as e:
        # only a command that used the device layer can raise its error, so a command that never needs torch
        # (audit, --help, ...) does not import it to catch one
        device = sys.modules.get("trex.device")
        if device is not None and isinstance(e, device.DeviceUnavailable):
            print(f"trex: {e}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
