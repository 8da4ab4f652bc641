"""The CPU parts of bench/accelerator.sh: the eager vs compiled step measurement and the report that
writes the figures (the script itself runs on a machine with an accelerator)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "bench", "accelerator.py")


def test_shell_script_parses():
    proc = subprocess.run(["bash", "-n", os.path.join(ROOT, "bench", "accelerator.sh")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.slow
def test_step_measurement_and_report_on_cpu(tmp_path):
    out = tmp_path / "step-eager.json"  # both forms in one file, as an older run wrote them
    proc = subprocess.run([sys.executable, SCRIPT, "step", "--device", "cpu", "--dtype", "fp32", "--seq", "64",
                           "--steps", "2", "--smoke", "--backend", "eager", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    eager, compiled = json.loads(out.read_text())
    assert (eager["compiled"], compiled["compiled"]) == (False, True)
    assert eager["syncs_per_step"] == 0  # the loop's step, counted
    assert compiled["graphs"] >= 1 and eager["tokens_per_s"] > 0 and compiled["tokens_per_s"] > 0
    assert abs(eager["loss"] - compiled["loss"]) <= 1e-5 * abs(eager["loss"])  # the same steps, the same loss
    assert eager["mfu"] is None  # no hardware profile for a CPU
    (tmp_path / "tests.txt").write_text("....\n4 passed in 1.0s\n")
    (tmp_path / "fidelity-eager.txt").write_text("verdict: PASS\n")
    (tmp_path / "parts.json").write_text(json.dumps([{"part": "step, eager", "status": "ok", "seconds": 3, "limit": 120},
                                                     {"part": "step, compiled", "status": "skipped", "seconds": 0}]))
    doc = os.path.join(ROOT, "docs", "benchmarks.md")
    before = open(doc).read()
    report = subprocess.run([sys.executable, SCRIPT, "report", str(tmp_path)], capture_output=True,
                            text=True, cwd=ROOT)
    assert report.returncode == 0, report.stderr
    assert open(doc).read() == before  # printed, not written, without --write
    text = report.stdout
    assert text.startswith("<!-- accelerator-bench:begin -->") and text.rstrip().endswith("<!-- accelerator-bench:end -->")
    assert "4 passed in 1.0s" in text and "verdict: PASS" in text
    assert "| eager | " in text and "| compiled | " in text
    assert "| step, eager | ok | 3 | 120 |" in text and "| step, compiled | skipped | 0 | - |" in text
