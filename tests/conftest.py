import os
import resource
import sys
import tempfile

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))  # tests/hf_oracle.py and other helpers
if os.environ.get("PYTEST_XDIST_WORKER"):  # `make test`: two workers share the two cores
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # and so do the trex processes a test starts
    # Inductor compiles in its own process, not in a pool of one per core beside the other worker's tests
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    # each worker its own Inductor cache (and the processes it starts): a test's compiled kernels are
    # built by its own worker, not loaded from what a test in the other worker compiled under its settings
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(
        tempfile.gettempdir(), f"torchinductor-{os.getuid()}-{os.environ['PYTEST_XDIST_WORKER']}"))
else:
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
# the machine's measured matmul peak (trex.device.cached_peak_flops) is kept out of the user's home
os.environ.setdefault("TREX_CACHE_DIR", tempfile.mkdtemp(prefix="trex-cache-"))

# The longest test files (`make test` prints the slowest tests), handed out to the workers first (the
# Makefile's --no-loadscope-reorder keeps this order) so that neither worker is left running one of them
# at the end while the other idles (ordered by their wall time in a `make test` of 2026-12-07).
LONGEST_FIRST = ("test_faults.py", "test_compile.py", "test_docs_commands.py", "test_migration.py",
                 "test_tensor_parallel.py", "test_fidelity_record.py", "test_tool_demo.py", "test_drafter_refit.py",
                 "test_posttrain_dpo.py", "test_context_parallel.py", "test_mtp_refit.py", "test_posttrain_grpo.py",
                 "test_profile.py", "test_vdev_plugin.py", "test_syncs.py")


def pytest_collection_modifyitems(items):
    first = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: first.get(item.path.name, len(first)))  # stable: the rest as collected


def _cpu_seconds() -> float:
    """CPU time of this process and of the children it has waited for (the trex and torchrun processes a
    test starts), user and system."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    item.cpu_start = _cpu_seconds()
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Each test's CPU seconds (its fixtures' setup included) as the junit property ``cpu_s``: on two
    cores the suite is CPU-bound, so CPU, not wall time, says what a test costs
    (``pytest -o junit_family=xunit1 --junitxml=suite.xml``)."""
    outcome = yield
    report = outcome.get_result()
    if report.when == "teardown":
        report.user_properties.append(("cpu_s", round(_cpu_seconds() - item.cpu_start, 1)))
