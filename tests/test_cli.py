"""The command line's own contract: user faults end in one clean line, never a traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest

from trex import device
from trex.cli import main


def test_a_device_this_machine_lacks_is_one_line_and_exit_2(capsys):
    missing = next(t for t in ("npu", "xpu", "mps") if t not in device.available_types())
    assert main(["--device", missing, "env"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"trex: device '{missing}' was requested")


def test_a_reader_that_leaves_early_is_not_an_error_trace():
    proc = subprocess.Popen([sys.executable, "-m", "trex", "fidelity", "profiles"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    proc.stdout.close()  # like `| head` that has already exited: every write gets EPIPE
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141 and "Traceback" not in err, err


@pytest.mark.parametrize("argv", [["audit", "/no/such/path"]])
def test_one_prefix_per_message(argv, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("trex audit: '/no/such/path'") and err.count("trex audit:") == 1
