"""`trex launch`: torchrun, with exit codes a scheduler can act on.

``trex launch [torchrun flags] COMMAND ...`` starts ``python -m trex COMMAND ...`` on every rank
exactly as ``torchrun [flags] -m trex COMMAND ...`` would (it is torch's own launcher, called as a
library), and differs only in how it ends:

- stopped by a signal (SIGTERM from a scheduler's preemption, Ctrl-C): torchrun forwards the signal,
  the ranks save a checkpoint and exit, and ``trex launch`` exits 128 + the signal number (143 for
  SIGTERM), where torchrun prints a ``SignalException`` traceback and exits 1;
- a rank failed: the exit code of the failure that explains it (`first_failure`: 2 a user error,
  3 stopped on non-finite steps, 4 a rank stopped answering, see docs/training.md; else 128 + the
  signal that killed a rank, or its code), where torchrun exits 1.

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
TREX_EXIT_CODES = (2, 3, 4)
"""Exit codes by which a trex rank explains itself: a user error, non-finite steps, a lost rank."""


def register(sub) -> None:
    """Lists the command in ``trex --help``; ``trex.cli.main`` hands its arguments to `launch`."""
    sub.add_parser("launch", help="torchrun for trex commands: exits 143 on SIGTERM and with a failed rank's "
                                  "own code (trex launch [torchrun flags] COMMAND ...)")


def torchrun_args(argv: list[str]) -> argparse.Namespace:
    """torchrun's parsed arguments for ``trex launch ARGV``: the first positional is the trex command."""
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.prog = "trex launch"
    args = parser.parse_args(["--module", *argv])
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
