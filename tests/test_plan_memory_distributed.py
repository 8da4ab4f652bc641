"""The planner's per-device memory against measured peaks of real 2-process CPU training steps.

One torchrun launch (gloo) runs every case on two ranks as trex train builds them: FSDP2 per block
and root, expert parallelism, bf16 mixed precision, selective activation checkpointing, gradient accumulation without
reduce-scatter before the last micro-batch. Each rank measures its step peak as the single-process
test does (tests/plan_memory_worker.py: MALLOC_MMAP_THRESHOLD_=4096, clear_refs, VmHWM growth over
the resident set after a warm-up step) and is compared with the planner's step peak for that exact
layout (dp_shard=2), within 15%.
"""

import os

import pytest
from plan_memory_worker import SMALL, explain, launch, predicted

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux peak-RSS reset")]

NPROC = 2
# one case per branch of the memory model on two ranks: bf16 compute, expert parallelism, selective and
# full recompute, gradient accumulation; plain FSDP2 at tiny size is the bf16 case's layout without EP and
# adds no branch, and selective recompute with EP is the sum of two cases below
CASES = {
    "tiny-512 fsdp2+ep2 bf16": {"overrides": {}, "seq": 512, "ep": 2, "dtype": "bf16"},  # first: a fresh heap
    "small-512 fsdp2+ep2": {"overrides": SMALL, "seq": 512, "ep": 2},
    "small-512 fsdp2 selective": {"overrides": SMALL, "seq": 512, "recompute": "selective"},
    "small-256 fsdp2 grad_accum=2": {"overrides": SMALL, "seq": 256, "grad_accum": 2},
    "small-512 fsdp2+ep2 full": {"overrides": SMALL, "seq": 512, "ep": 2, "recompute": "full"},
}


@pytest.fixture(scope="module")
def measured():
    results = launch(list(CASES.values()), nproc=NPROC)
    assert len(results) == NPROC * len(CASES)
    names = list(CASES)
    return {(names[r["case"]], r["rank"]): r for r in results}


@pytest.mark.parametrize("name", list(CASES))
def test_predicted_per_device_step_peak_within_15_percent_of_each_rank(measured, name):
    memory = predicted(CASES[name], NPROC)
    for rank in range(NPROC):
        result = measured[name, rank]
        assert memory.step_peak == pytest.approx(result["step_peak"], rel=0.15), explain(result, memory)
