"""Resharding: a checkpoint saved by 2 FSDP2 processes resumes at 1 and at 4 processes and the
loss curve continues (gloo on CPU; the worker is tests/ckpt_reshard_worker.py)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from trex.checkpoint.manifest import verify_checkpoint

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ckpt_reshard_worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _torchrun(nproc: int, *args) -> dict:
    out = args[-1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d",
           "--rdzv-endpoint", f"localhost:{_free_port()}", WORKER, *map(str, args)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(open(out).read())


@pytest.mark.slow
def test_saved_at_2_processes_resumes_at_1_and_4(tmp_path):
    ckpt = tmp_path / "ckpt"
    saved = _torchrun(2, "save", ckpt, tmp_path / "save.json")
    report = verify_checkpoint(str(ckpt / "step_3"))
    assert report.ok and report.world["world_size"] == 2 and report.world["mesh"]["shape"] == [2]
    for nproc in (1, 4):
        resumed = _torchrun(nproc, "resume", ckpt, tmp_path / f"resume{nproc}.json")
        assert resumed["world"] == nproc
        for want, got in zip(saved["losses"], resumed["losses"], strict=True):
            assert abs(got - want) <= 1e-5 * abs(want), (nproc, saved["losses"], resumed["losses"])
