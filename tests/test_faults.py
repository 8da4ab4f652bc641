"""The fault-injection suite (tests/faults.py): each fault once, with the seeded timings of trial 0.
Each trial asserts its outcome: bitwise-equal final checkpoint and a clean curve after resuming, or a
clean error naming the fault.

Faults that a focused test already drives end to end are left to it here, to keep CI within its
time; `python tests/faults.py --trials 3` runs every fault (docs/reliability.md)."""

from __future__ import annotations

import os
import random

import pytest

from faults import FAULTS, Lab


COVERED_ELSEWHERE = {  # fault -> the test that drives the same outcome through `trex train`
    "truncated checkpoint file": "test_checkpointing.py::test_verify_catches_truncation_and_a_flipped_byte_and_resume_skips_them",
    "flipped bit in a checkpoint file": "test_checkpointing.py::test_verify_catches_truncation_and_a_flipped_byte_and_resume_skips_them",
    "bad data records": "test_train_loop.py::test_the_cli_names_the_skipped_records_on_the_console",
    "non-finite losses": "test_train_loop.py::test_non_finite_steps_are_skipped_counted_and_stop_the_run",
    "non-finite gradients": "test_train_loop.py::test_cli_non_finite_stop_is_one_line_with_its_own_exit_code",
    # the same SIGKILL of the one process and bitwise resume, at the hardest moment: inside a save
    "kill -9 of the process": "test_faults.py::test_fault",  # [kill -9 during a checkpoint write]
    # the same SIGKILL of one rank of two and bitwise resume, inside a save, resumed by torchrun's own restart
    "kill -9 of one rank of two": "test_faults.py::test_fault",  # [kill -9 of one rank during a save, restarted ...]
    # the same repeated SIGTERM, save, exit 143 and bitwise resume, reaching each rank through trex launch
    "SIGTERM to the process": "test_faults.py::test_fault",  # [SIGTERM to the launcher (trex launch)]
}


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    return Lab(str(tmp_path_factory.mktemp("faults")))


@pytest.mark.slow
@pytest.mark.parametrize("fault", [f for f in FAULTS if f not in COVERED_ELSEWHERE])
def test_fault(lab, fault):
    FAULTS[fault](lab, random.Random(f"{fault}/0"))


def test_every_fault_left_out_names_a_test_that_exists():
    assert set(COVERED_ELSEWHERE) <= set(FAULTS)
    here = os.path.dirname(os.path.abspath(__file__))
    for fault, where in COVERED_ELSEWHERE.items():
        path, name = where.split("::")
        assert f"def {name}(" in open(os.path.join(here, path)).read(), f"{fault}: {where} does not exist"
