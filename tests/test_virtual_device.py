"""The single-process path end to end on a device trex has never heard of: trex_vdev, a PrivateUse1
virtual accelerator registered from Python (its data stays in CPU memory, so every result must equal
the CPU run). trex finds it through torch.accelerator, with no special case: training, checkpoint
save and ``--resume auto``, export, fidelity recording and comparison, generation."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VDEV = {"TREX_DEVICE_PLUGINS": "trex_vdev", "TREX_DEVICE": "vdev"}
RECIPE = "recipes/fidelity_default.toml"


def _run(args: list[str], env: dict, timeout: int = 300) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **env})
    assert proc.returncode == 0, f"{args}:\n{proc.stderr[-3000:]}"
    return proc


def _train(out, env, steps: int, *extra):
    # the same settings on both devices: "auto" picks bf16 Newton-Schulz for Muon on an accelerator
    return _run(["-m", "trex", "train", RECIPE, "--out", str(out), "--set", 'train.device=""',
                 "--set", f"train.steps={steps}", "--set", "checkpoint.save_every=3", "--set", "fidelity.every=3",
                 "--set", 'optim.ns_dtype="fp32"', *extra], env)


def _rows(out):
    return [json.loads(line) for line in open(out / "metrics.jsonl")]


GENERATE = """
import json, sys, torch
from trex import device
from trex.rollout.generate import greedy_generate
from trex.checkpoint import load_pretrained
dev = device.detect()
model = load_pretrained(sys.argv[1], dtype=torch.float32, device=dev.name).eval()
prompts = [[5, 9, 17, 3], [7, 7, 2], [11, 4, 30, 8, 1]]
print(json.dumps({"device": dev.type, "ids": greedy_generate(model, prompts, 8, stop_id=0, pad_id=0)}))
"""


def test_training_resume_export_fidelity_and_generation_on_a_virtual_accelerator(tmp_path):
    cpu, vdev = tmp_path / "cpu", tmp_path / "vdev"
    _train(cpu, {"TREX_DEVICE": "cpu"}, 6)
    _train(vdev, VDEV, 3)  # stops after step 3 with a checkpoint ...
    resumed = _train(vdev, VDEV, 6, "--resume", "auto")  # ... and a second process goes on from it
    assert "checkpoints/step_3 at step 3" in resumed.stderr  # it went on from step 3
    assert [r["step"] for r in _rows(vdev)] == [1, 2, 3, 4, 5, 6]  # each step once

    summary = json.loads((vdev / "summary.json").read_text())
    assert summary["device"]["device_type"] == "vdev" and summary["steps_completed"] == 6
    cpu_rows, vdev_rows = _rows(cpu), _rows(vdev)
    assert [r["step"] for r in vdev_rows] == [1, 2, 3, 4, 5, 6]
    for a, b in zip(cpu_rows, vdev_rows):
        for key in ("loss", "grad_norm", "mtp_loss"):
            assert abs(a[key] - b[key]) <= 1e-6 * abs(a[key]), (key, a["step"], a[key], b[key])

    # the fidelity signals recorded on the device judge equal to the CPU run's at the layout profile
    _run(["-m", "trex", "fidelity", "compare", str(vdev), str(cpu), "--profile", "layout"], VDEV)

    # export the device run's checkpoint, then greedy generation from it on both devices
    exported = tmp_path / "exported"
    _run(["-m", "trex", "ckpt", "export", str(vdev / "checkpoints" / "step_6"), str(exported), "--layout", "hf"],
         VDEV)
    gen = {}
    for name, env in (("cpu", {"TREX_DEVICE": "cpu"}), ("vdev", VDEV)):
        gen[name] = json.loads(_run(["-c", GENERATE, str(exported)], env).stdout.strip().splitlines()[-1])
    assert gen["vdev"]["device"] == "vdev" and gen["cpu"]["device"] == "cpu"
    assert gen["vdev"]["ids"] == gen["cpu"]["ids"] and any(gen["cpu"]["ids"])
