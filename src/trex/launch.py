"""`trex launch`: torchrun, with exit codes a scheduler can act on.

``trex launch [torchrun flags] COMMAND ...`` starts ``python -m trex COMMAND ...`` on every rank
exactly as ``torchrun [flags] -m trex COMMAND ...`` would (it is torch's own launcher, called as a
library), and differs only in how it ends:

- stopped by a signal (SIGTERM from a scheduler's preemption, Ctrl-C): torchrun forwards the signal,
  the ranks save a checkpoint and exit, and ``trex launch`` exits 128 + the signal number (143 for
  SIGTERM), where torchrun prints a ``SignalException`` traceback and exits 1;
- a rank failed: the exit code of the failure that explains it (`first_failure`: 2 a user error,
  3 stopped on non-finite steps, 4 a rank stopped answering or a rank's rollout engine died, see
  docs/training.md; else 128 + the signal that killed a rank, or its code), where torchrun exits 1.

``--shutdown-timeout`` (the seconds torchrun waits for the ranks to exit after forwarding a signal
before it kills them) defaults to 300 here instead of torchrun's 30, so that a rank stopped while it
writes a large checkpoint can finish it. (After a rank *failed*, torch stops the others with its own
fixed 30 s.)
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

SHUTDOWN_TIMEOUT_S = 300
TREX_EXIT_CODES = {2: "a user error: a recipe, data, path or disk to fix before rerunning",
                   3: "stopped after precision.max_consecutive_skips non-finite steps",
                   4: "a rank stopped answering, or a rank's rollout engine died"}
"""Exit codes by which a trex rank explains itself (docs/training.md), and what each means."""


def description() -> str:
    """What ``trex launch --help`` says before torchrun's options: what trex adds, and its exit codes
    (the table is built from `TREX_EXIT_CODES` and `launch`'s own rules). Wrapped by hand: the help
    formatter prints it as it is."""
    rows = [("0", "every rank completed"), *((str(code), meaning) for code, meaning in TREX_EXIT_CODES.items()),
            ("128+N", "stopped by signal N (143 SIGTERM, 130 Ctrl-C): the ranks save and exit"),
            ("other", "a failed rank's own code, or 128 + the signal that killed it")]
    return ("torchrun for trex commands: runs `python -m trex COMMAND ARGS` on every rank\n"
            "as `torchrun [options] -m trex COMMAND ARGS` would (torch's own launcher,\n"
            "called as a library). What trex adds:\n"
            "  - a COMMAND that is not a trex command is refused in one line (exit 2)\n"
            "    before any rank starts;\n"
            f"  - --shutdown-timeout defaults to {SHUTDOWN_TIMEOUT_S} s instead of 30, so that a rank\n"
            "    stopped while it writes a large checkpoint can finish it;\n"
            "  - exit codes a scheduler can act on, where torchrun exits 1: after a\n"
            "    failure, the code of the rank that explains it.\n\n"
            "exit codes:\n" + "".join(f"  {code:<7}{meaning}\n" for code, meaning in rows) +
            "\nThe options below are torchrun's.")


def register(sub) -> None:
    """Lists the command in ``trex --help``; ``trex.cli.main`` hands its arguments to `launch`."""
    sub.add_parser("launch", help="torchrun for trex commands: exits 143 on SIGTERM and with a failed rank's "
                                  "own code (trex launch [torchrun flags] COMMAND ...)",
                   description=description(), formatter_class=argparse.RawDescriptionHelpFormatter)


def launcher_parser() -> argparse.ArgumentParser:
    """torchrun's own parser, as ``trex launch``: trex's `description` first, its positionals named
    COMMAND and ARGS, and trex's --shutdown-timeout default in that option's help."""
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.prog = "trex launch"
    parser.description = description()
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    for action in parser._actions:
        if action.dest == "training_script":
            action.metavar, action.help = "COMMAND", "the trex command every rank runs (`trex --help` lists them)"
        elif action.dest == "training_script_args":
            action.metavar, action.help = "ARGS", "the command's arguments"
        elif action.dest == "shutdown_timeout":
            action.help = (f"seconds the ranks have to exit after a forwarded signal before they are killed (default: "
                           f"TORCH_ELASTIC_SHUTDOWN_TIMEOUT, else {SHUTDOWN_TIMEOUT_S}; torchrun's is 30)")
    return parser


def torchrun_args(argv: list[str]) -> argparse.Namespace:
    """torchrun's parsed arguments for ``trex launch ARGV``: the first positional is the trex command."""
    args = launcher_parser().parse_args(["--module", *argv])
    args.training_script_args = [args.training_script, *args.training_script_args]
    args.training_script = "trex"
    if args.shutdown_timeout is None and "TORCH_ELASTIC_SHUTDOWN_TIMEOUT" not in os.environ:
        args.shutdown_timeout = SHUTDOWN_TIMEOUT_S
    return args


def first_failure(failures: dict) -> tuple[int, object]:
    """The failure that explains the job: the earliest rank exit with one of trex's own codes (it says
    why, e.g. 4 names the rank that stopped answering), else the earliest that the launcher's own
    SIGTERM did not cause, else the earliest. The others are ranks that the launcher stopped after
    the first failure, or that lost a dead peer."""
    own = {r: f for r, f in failures.items() if f.exitcode in TREX_EXIT_CODES}
    not_stopped = {r: f for r, f in failures.items() if f.exitcode != -signal.SIGTERM}
    pool = own or not_stopped or failures
    rank = min(pool, key=lambda r: (pool[r].timestamp, r))
    return rank, pool[rank]


def launch(argv: list[str], commands: set[str] | None = None) -> int:
    """Run ``trex launch ARGV``; returns the exit code described above. ``commands``: the trex
    commands a rank may run; any other is refused in one line (exit 2) before anything starts."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import run

    args = torchrun_args(argv)
    command = args.training_script_args[0]
    if commands is not None and command not in commands:
        print(f"trex launch: {command!r} is not a trex command; expected one of {', '.join(sorted(commands))} "
              "(trex launch [torchrun flags] COMMAND ...)", file=sys.stderr)
        return 2
    try:
        run(args)
    except SignalException as e:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the ranks have stopped: a late signal changes nothing
        print(f"trex launch: stopped by signal {e.sigval}; the ranks were told to save and exit", file=sys.stderr)
        return 128 + int(e.sigval)
    except ChildFailedError as e:
        rank, failure = first_failure(e.failures)
        code = failure.exitcode if failure.exitcode > 0 else 128 - failure.exitcode
        print(f"trex launch: rank {rank} exited with {failure.exitcode} ({len(e.failures)} of the ranks failed)",
              file=sys.stderr)
        return code
    return 0
