"""trex doctor: single process on CPU, the collective checks, and 2 processes under torchrun."""

from __future__ import annotations

import json

import pytest
import torch

from trex import cli, device, doctor


@pytest.fixture
def single_process(monkeypatch):
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TREX_DEVICE"):
        monkeypatch.delenv(key, raising=False)


def test_cpu_single_process_json(single_process, capsys):
    assert cli.main(["--device", "cpu", "doctor", "--format", "json"]) == 0
    report = json.loads(capsys.readouterr().out)
    env = report["environment"]
    assert env["device"] == "cpu" and env["device_count"] == 1
    assert env["backend"] == device.detect("cpu").backend()
    assert env["torch"] == torch.__version__
    for name in ("bf16", "fp16"):  # torch on CPU computes both; the error must be within dtype tolerance
        probe = report["precision"][name]
        assert probe["supported"], probe
        assert 0 < probe["rel_error"] < 0.05 and probe["speedup_vs_fp32"] > 0
    assert set(report["precision"]) == {"bf16", "fp16", "fp8"}
    assert "skipped" in report["distributed"] and report["ok"] is True


def test_json_holds_a_non_finite_error_as_null(single_process, monkeypatch, capsys):
    """A matmul that gives NaN on a broken device: its rel_error is null in the JSON, never a bare NaN."""
    probe = doctor.probe_precision
    monkeypatch.setattr(doctor, "probe_precision", lambda dev, name, *a, **k: doctor.PrecisionProbe(
        supported=False, rel_error=float("nan"), error="result off by nan") if name == "fp8" else probe(dev, name, *a, **k))
    cli.main(["--device", "cpu", "doctor", "--format", "json"])
    report = json.loads(capsys.readouterr().out, parse_constant=lambda name: pytest.fail(f"bare {name} in JSON"))
    assert report["precision"]["fp8"]["rel_error"] is None and report["precision"]["bf16"]["rel_error"] > 0


def test_text_report_lists_every_section(single_process, capsys):
    assert cli.main(["--device", "cpu", "doctor"]) == 0
    out = capsys.readouterr().out
    for needle in ("device: cpu", "bf16:", "fp16:", "fp8:", "skipped", "torchrun"):
        assert needle in out
    # the precision lines agree with the capabilities: a kernel that is not fast here is not called ok
    assert not device.detect("cpu").capabilities().fp8
    fp8_line = next(line.strip() for line in out.splitlines() if line.strip().startswith("fp8: "))
    assert fp8_line.startswith(("fp8: computes correctly but slowly", "fp8: unsupported")), fp8_line


def test_precision_probe_reports_an_unsupported_kernel(monkeypatch):
    def refuse(*args, **kwargs):
        raise RuntimeError("scaled_mm is not implemented for this device\nmore detail")

    monkeypatch.setattr(torch, "_scaled_mm", refuse)
    probe = doctor.probe_precision(device.detect("cpu"), "fp8")
    assert not probe.supported
    assert probe.error == "RuntimeError: scaled_mm is not implemented for this device"


def test_precision_probe_measures_instead_of_trusting_the_dtype(monkeypatch):
    """A matmul that returns garbage is unsupported, whatever the dtype claims."""
    original = torch.Tensor.__matmul__

    def garbage(self, other):
        out = original(self, other)
        return out * 2 if out.dtype == torch.float16 else out

    monkeypatch.setattr(torch.Tensor, "__matmul__", garbage)
    probe = doctor.probe_precision(device.detect("cpu"), "fp16")
    assert not probe.supported and probe.rel_error > 0.5 and "tolerance" in probe.error


def test_collective_checks_accept_exact_results_and_name_the_bad_sender():
    world = 3
    good = torch.arange(16, dtype=torch.float32) * 6  # sum of (rank + 1) over 3 ranks
    assert doctor.all_reduce_error(good, world) is None
    bad = good.clone()
    bad[5] += 1
    assert doctor.all_reduce_error(bad, world) == "1 of 16 elements wrong; element 5: expected 30.0, got 31.0"

    # what rank 1 receives: chunk i from rank i holds i * 1000 + 1
    sent = [doctor.all_to_all_input(r, world) for r in range(world)]
    received = torch.cat([s.view(world, -1)[1] for s in sent])
    assert doctor.all_to_all_error(received, rank=1, world=world) is None
    received[-1] = -1.0  # a corrupted element from rank 2
    message = doctor.all_to_all_error(received, rank=1, world=world)
    assert message.startswith("chunk from rank 2: expected 2001") and "rank 0" not in message


def test_failed_ranks_names_rank_host_and_device():
    per_rank = [
        {"rank": 1, "host": "node-b", "device": "cpu", "errors": {"all_to_all": "chunk from rank 0: ..."}},
        {"rank": 0, "host": "node-a", "device": "cpu", "errors": {}},
    ]
    assert doctor.failed_ranks(per_rank) == ["rank 1 (node-b, cpu): all_to_all: chunk from rank 0: ..."]


@pytest.mark.slow
def test_torchrun_two_processes_collectives():
    from trex_run import trex  # torchrun, each rank forked from a warm process

    proc = trex(["--device", "cpu", "doctor", "--format", "json", "--size-mb", "1", "--iters", "2", "--timeout", "30"],
                procs=2, timeout=90)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout[proc.stdout.index("{"):])  # only rank 0 prints
    dist_report = report["distributed"]
    assert dist_report["backend"] == "gloo" and dist_report["world_size"] == 2
    assert dist_report["ok"] and dist_report["failures"] == []
    assert sorted(r["rank"] for r in dist_report["ranks"]) == [0, 1]
    assert all(bw > 0 for bw in dist_report["busbw_GBps"].values())
