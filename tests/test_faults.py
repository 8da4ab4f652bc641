"""The fault-injection suite (tests/faults.py): every fault once, with the seeded timings of trial 0.
Each trial asserts its outcome: bitwise-equal final checkpoint and a clean curve after resuming, or a
clean error naming the fault."""

from __future__ import annotations

import random

import pytest

from faults import FAULTS, Lab

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    return Lab(str(tmp_path_factory.mktemp("faults")))


@pytest.mark.parametrize("fault", list(FAULTS))
def test_fault(lab, fault):
    FAULTS[fault](lab, random.Random(f"{fault}/0"))
