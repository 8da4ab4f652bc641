# Two entry points, both from a clean clone:
#   make run   set up .venv and run the main job on its built-in default
#   make test  set up .venv with test dependencies and run the whole suite
PYTHON ?= python3
# the suite's processes: one thread each (tests/conftest.py), each test file on one of them, so that a
# module's fixtures are made once, the longest files first (tests/conftest.py); the slowest tests are
# listed at the end of every run
TEST_WORKERS ?= 2
VENV   := .venv
BIN    := $(VENV)/bin

.PHONY: run test setup setup-test bench clean

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

run: setup
	$(BIN)/trex train

test: setup-test
	$(BIN)/python -m compileall -q -x /fixtures/ src tests  # bytecode every process the tests start would compile again
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=15

bench: setup-test
	$(BIN)/python bench/model_step.py
	$(BIN)/python bench/data_pipeline.py --write

clean:
	rm -rf $(VENV) build src/*.egg-info
