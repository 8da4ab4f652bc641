"""The memory model against the measured peak of real single-process CPU training steps.

Each case runs in a process of its own, forked from a warm one (tests/plan_memory_worker.py: fp32 or bf16 compute on fp32
parameters, the real MuonAdamW, a frozen indexer, activation checkpointing as trex train applies it). glibc keeps freed small blocks in its
heap, which would hide a step's growth, so the child maps as MALLOC_MMAP_THRESHOLD_=4096 does: every tensor
above 4 KiB is its own mapping, returned to the system when freed. The baseline is the resident set
after a warm-up step (model and optimizer state exist, gradients freed); the measured peak is the
VmHWM growth during the next step, compared with the planner's step peak (the larger of the
backward and optimizer moments, trex.plan.memory). Two processes: test_plan_memory_distributed.py.
"""

import os

import pytest
from plan_memory_worker import SMALL, explain, launch, predicted

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux peak-RSS reset")]

CASES = {
    "tiny-512": {"overrides": {}, "seq": 512},
    "small-1024": {"overrides": SMALL, "seq": 1024},
    "small-512-selective": {"overrides": SMALL, "seq": 512, "recompute": "selective"},
    # full recompute peaks late in backward: one block rebuilt while most gradients already exist
    "tiny-1024-full": {"overrides": {}, "seq": 1024, "recompute": "full"},
}
# bf16 compute and full recompute of the small model are measured on two ranks (test_plan_memory_distributed)


@pytest.fixture(scope="module")
def measured():
    return {name: launch([case], nproc=1)[0] for name, case in CASES.items()}  # a process of its own each


@pytest.mark.parametrize("name", list(CASES))
def test_predicted_step_peak_within_15_percent_of_measured(measured, name):
    result, memory = measured[name], predicted(CASES[name], 1)
    assert memory.step_peak == pytest.approx(result["step_peak"], rel=0.15), explain(result, memory)
