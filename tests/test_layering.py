"""Every import points down a floor (docs/architecture.md).

Reads the import statements of every module under src/trex (function-level imports too) and
checks that a package imports only packages on floors below its own, never one on its floor or
above: the model knows nothing of training, parallelism, checkpoints or data; the loop knows
nothing of the tools built on it. Inside trex.models (families, the shared parts, no import of a shared
part through a family): tests/test_models_layering.py.
"""

from __future__ import annotations

import ast
import os

import pytest

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src", "trex")

# Lowest first. A top-level module (trex/device.py) is its own package.
FLOORS = [
    {"__init__", "atomic", "lazy"},       # ground: the version, atomic writes, lazy package exports
    {"logs", "recipe", "syncs", "device", "hardware"},  # logging, TOML recipes, sync counter, the device layer
    {"kernels"},                          # vendor fast paths behind a registry, each with a reference
    {"models"},                           # the DeepSeek families: common/, one package per family, the registry
    {"precision", "data", "checkpoint"},  # what a model is trained in, on, stored as
    {"parallel"},                         # FSDP2, EP, meshes, sharded loading
    {"rollout"},                          # what it is sampled with: the sampler, the engine boundary, weight sync
    {"posttrain"},                        # objectives: SFT, DPO, GRPO, distillation
    {"train"},                            # the loop, its config, run directory, optimizers
    {"fidelity", "plan", "audit", "doctor", "launch", "report", "profile"},  # tools built on the loop
    {"cli"},                              # the command line: each package's cli.py registers its subcommands
    {"__main__"},
]
FLOOR = {pkg: i for i, floor in enumerate(FLOORS) for pkg in floor}


def package_of(path: str) -> str:
    rel = os.path.relpath(path, SRC)
    return rel.split(os.sep)[0] if os.sep in rel else rel[:-3]


def trex_imports(path: str) -> list[tuple[int, str]]:
    """(line, imported trex package) for every import in the file, at any depth."""
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] if node.module != "trex" else [f"trex.{a.name}" for a in node.names]
        else:
            continue
        found += [(node.lineno, n.split(".")[1]) for n in names if n.startswith("trex.")]
    return found


def modules() -> list[str]:
    return sorted(os.path.join(d, f) for d, _, files in os.walk(SRC) for f in files if f.endswith(".py"))


def violations() -> list[str]:
    bad = []
    for path in modules():
        pkg = package_of(path)
        for line, target in trex_imports(path):
            if target == pkg or target == "__version__":
                continue
            if FLOOR[target] >= FLOOR[pkg]:
                bad.append(f"{os.path.relpath(path, SRC)}:{line}: {pkg} (floor {FLOOR[pkg]}) imports "
                           f"{target} (floor {FLOOR[target]})")
    return bad


def test_every_package_has_a_floor():
    assert {package_of(p) for p in modules()} <= set(FLOOR), set(map(package_of, modules())) - set(FLOOR)


def test_every_import_points_down():
    assert violations() == []


@pytest.mark.parametrize("source, target", [("models/deepseek_v4/model.py", "checkpoint"),
                                            ("parallel/plan.py", "train"),
                                            ("train/loop.py", "fidelity"),
                                            ("data/config.py", "data")])
def test_the_check_sees_an_upward_import(source, target, monkeypatch, tmp_path):
    # an import of today's kind put back (the model reaching into checkpoints, ...) is caught
    real = trex_imports
    path = os.path.join(SRC, source)

    def with_one_more(p):
        return real(p) + ([(1, target)] if p == path else [])

    monkeypatch.setitem(globals(), "trex_imports", with_one_more)
    expect = target != package_of(path)
    assert bool(violations()) == expect


def test_docs_architecture_states_these_floors_and_names_what_exists():
    import importlib
    import re

    doc = open(os.path.join(SRC, "..", "..", "docs", "architecture.md"), encoding="utf-8").read()
    rows = re.findall(r"^\| (\d+) \| ([^|]+) \|", doc, re.M)
    stated = [{re.sub(r"(^trex/|\.py$|/$)", "", name) for name in re.findall(r"`([^`]+)`", cell)} for _, cell in rows]
    assert stated == FLOORS, "docs/architecture.md's floor table and FLOORS disagree"
    # every dotted trex name in the page (`parallel.load.load_sharded`, `checkpoint.training.Checkpointer`) exists
    for name in {n for n in re.findall(r"`((?:%s)(?:\.\w+)+)`" % "|".join(FLOOR), doc) if not n.endswith(".py")}:
        parts = name.split(".")
        for cut in range(len(parts), 0, -1):
            try:
                obj = importlib.import_module("trex." + ".".join(parts[:cut]))
                break
            except ModuleNotFoundError:
                continue
        for attr in parts[cut:]:
            assert hasattr(obj, attr), f"docs/architecture.md names `{name}`, which does not exist"
            obj = getattr(obj, attr)
