"""The device layer on CPU, and the rule that no other module names a vendor."""

from __future__ import annotations

import json
import pathlib
import re

import pytest
import torch

from trex import device

SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "trex"
VENDOR = re.compile(r"torch\.cuda|\.cuda\(|import torch_npu|from torch_npu|[\"'](nccl|hccl)[\"']")
# The device layer is the one place allowed to name vendors; the audit's rule tables are data
# describing vendor APIs (they look for them in other people's code).
ALLOWED = {SRC / "device.py"}
ALLOWED_DIRS = {SRC / "audit"}


def test_only_the_device_layer_names_a_vendor():
    offenders = []
    for path in sorted(SRC.rglob("*.py")):
        if path in ALLOWED or any(d in path.parents for d in ALLOWED_DIRS):
            continue
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            if VENDOR.search(line):
                offenders.append(f"{path.relative_to(SRC.parent)}:{lineno}: {line.strip()}")
    assert not offenders, "vendor names outside the device layer:\n" + "\n".join(offenders)


def test_scan_pattern_catches_vendor_code():
    for bad in ('x = x.cuda()', 'torch.cuda.synchronize()', 'import torch_npu', 'backend="nccl"', "b = 'hccl'"):
        assert VENDOR.search(bad), bad
    for ok in ("torch.accelerator.synchronize()", "dev.backend()", "# runs on any accelerator"):
        assert not VENDOR.search(ok), ok


def test_cpu_detection_names_and_backend(monkeypatch):
    monkeypatch.setenv("TREX_DEVICE", "cpu")
    dev = device.detect()
    assert dev.type == "cpu" and dev.name == "cpu" and dev.torch_device == torch.device("cpu")
    assert dev.backend() == "gloo"
    assert dev.count() == 1
    assert device.Device("cuda", 3).name == "cuda:3"  # names with index, never bare integers


def test_override_to_missing_accelerator_is_a_clear_error(monkeypatch):
    if "npu" in device.available_types():
        pytest.skip("this machine has an NPU")
    monkeypatch.setenv("TREX_DEVICE", "npu:0")
    with pytest.raises(RuntimeError, match="'npu:0' was requested .* torch sees no 'npu' device"):
        device.detect()


def test_memory_readings_track_allocations():
    """On CPU the readings are the process's resident set: a tensor over 64 MiB of fresh pages, touched, raises
    it and its peak. The pages are a new anonymous mapping (``torch.frombuffer`` over ``mmap``): a plain
    ``torch.ones`` may be served by malloc from memory an earlier test freed and the process still holds,
    which moves no reading (it did, once another test file ran before this one in the same worker)."""
    import mmap

    dev = device.Device("cpu")
    was_reset = dev.reset_peak_memory()
    before, peak_before = dev.memory_allocated(), dev.max_memory_allocated()
    pages = mmap.mmap(-1, 64 * 1024 * 1024)
    block = torch.frombuffer(pages, dtype=torch.float32)  # 64 MiB
    block.fill_(1.0)  # touched
    assert dev.memory_allocated() >= before + 48 * 1024 * 1024
    assert dev.max_memory_allocated() >= dev.memory_allocated()
    if was_reset:  # the peak since the reset, not the process's lifetime peak
        assert peak_before <= before + 8 * 1024 * 1024
        assert dev.max_memory_allocated() >= peak_before + 48 * 1024 * 1024
    del block
    pages.close()


def test_a_refused_peak_reset_is_reported(monkeypatch):
    real_open = open

    def refuse(path, *args, **kwargs):
        if str(path) == "/proc/self/clear_refs":
            raise PermissionError(13, "Permission denied", path)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr("builtins.open", refuse)
    assert device.Device("cpu").reset_peak_memory() is False


def test_rng_state_round_trip():
    dev = device.Device("cpu")
    dev.manual_seed(123)
    state = dev.get_rng_state()
    a = torch.rand(4)
    dev.set_rng_state(state)
    assert torch.equal(a, torch.rand(4))


def test_capabilities_are_measured_and_default_dtype_is_fp32_on_cpu():
    dev = device.Device("cpu")
    caps = dev.capabilities()
    speedup = device.measure_cpu_bf16_speedup(n=128, repeats=2)
    assert speedup > 0
    assert isinstance(caps.bf16_fast, bool) and caps.fp8 is False
    assert dev.default_dtype() == torch.float32


def test_deterministic_switch():
    dev = device.Device("cpu")
    dev.set_deterministic(True)
    try:
        assert torch.are_deterministic_algorithms_enabled()
    finally:
        dev.set_deterministic(False)
    assert not torch.are_deterministic_algorithms_enabled()


def test_environment_report_has_what_doctor_prints():
    report = device.environment_report(device.Device("cpu"))
    for key in ("device", "device_count", "backend", "torch", "torch_npu", "cann", "capabilities", "default_dtype"):
        assert key in report
    assert report["backend"] == "gloo" and report["torch"] == torch.__version__


def test_flight_recorder_env_names_each_backends_own_variables():
    assert device.Device("cpu", 0).flight_recorder_env("/run/flight_recorder/rank_") == {}  # gloo has none
    for dev_type, prefix in (("cuda", "TORCH_NCCL"), ("npu", "TORCH_HCCL")):
        env = device.Device(dev_type, 0).flight_recorder_env("/run/flight_recorder/rank_", entries=500)
        assert env == {f"{prefix}_TRACE_BUFFER_SIZE": "500", f"{prefix}_DUMP_ON_TIMEOUT": "1",
                       f"{prefix}_DEBUG_INFO_TEMP_FILE": "/run/flight_recorder/rank_"}


def test_the_cpu_peak_is_the_best_this_machine_has_shown_and_survives_a_busy_moment(monkeypatch, tmp_path):
    rates = iter([5e9, 3e9, 8e9])  # the second run measured on a busy machine
    monkeypatch.setattr(device, "measure_matmul_flops", lambda *a, **k: next(rates))
    cpu = device.Device("cpu", 0)
    got = [device.cached_peak_flops(cpu, torch.float32, str(tmp_path))[0] for _ in range(3)]
    assert got == [5e9, 5e9, 8e9]
    cache = json.loads((tmp_path / "peak_flops.json").read_text())
    assert list(cache.values()) == [8e9] and "float32" in next(iter(cache))
