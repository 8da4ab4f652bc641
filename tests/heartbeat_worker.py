"""Run under torchrun (2 ranks, gloo) by tests/test_watchdog.py; prints one JSON line per rank."""

import json
import sys
import time

import torch.distributed as dist

from trex.parallel.watchdog import Heartbeat

dist.init_process_group("gloo")
rank = dist.get_rank()
verdicts = {}

# 1. rank 1 finishes early: its last beat says "done", and rank 0 does not call it lost
with Heartbeat(1.0, interval_s=0.1, exit=lambda m: None) as finished:
    finished.start()
    finished.at(1, "step")
    time.sleep(0.3 if rank == 1 else 2.5)
verdicts["finished"] = finished.verdict
dist.barrier()

# 2. rank 1 stays in step 1 while rank 0 moved on to step 2: both watchers name rank 1
with Heartbeat(1.0, interval_s=0.1, exit=lambda m: None) as stuck:
    stuck.start()
    stuck.at(1, "step")
    if rank == 0:
        stuck.at(2, "step")
    deadline = time.time() + 10
    while stuck.verdict is None and time.time() < deadline:
        time.sleep(0.05)
verdicts["stuck"] = stuck.verdict
dist.barrier()
sys.stdout.write(json.dumps({"rank": rank, **verdicts}) + "\n")  # one write: the ranks share the pipe (python -u)
sys.stdout.flush()
dist.destroy_process_group()
