"""Inside trex.models, every import points down too (tests/test_layering.py checks the packages).

The modules of src/trex/models sit in groups, lowest first: the shared parts (``common/``, and the
leaf ``modes``), the families (one package each: its config, model, decode cache ...; a family imports only
the shared parts and itself, never another family), and on top what dispatches over every architecture
(``registry``, ``build``, ``params``, ``flops``, the package's lazy ``__init__``), which nothing below
imports. Within all that, no circle. Every import counts: at module level, inside functions, under
``if TYPE_CHECKING:``, and the submodules a ``lazy_exports`` table names.

And every import of a name from a module of trex.models, anywhere in src/trex, tests and bench, names the
module that defines it: nothing takes a shared part (or anything else) through a family's module that
merely imports it.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest

MODELS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src", "trex", "models")

SHARED_LEAVES = {"modes"}  # a shared part that stays beside the families
FAMILIES = {"deepseek_v4", "deepseek_v3"}  # each a package below trex.models
TOP = {"__init__", "registry", "build", "params", "flops"}
TORCH_FREE = ("common.config", "deepseek_v4", "deepseek_v4.config", "deepseek_v4.config_v41",
              "deepseek_v4.engram_layout", "deepseek_v3", "deepseek_v3.config", "registry",  # read by `trex --help`
              "common.checkpoint_names", "deepseek_v4.checkpoint_names", "deepseek_v3.checkpoint_names")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def module_files() -> dict[str, str]:
    """Dotted name below trex.models (``common.moe``; a package's ``common.__init__``) -> its file."""
    found = {}
    for d, _, files in os.walk(MODELS):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(d, f)
                found[os.path.relpath(path, MODELS)[:-3].replace(os.sep, ".")] = path
    return found


def resolve(name: str, modules: dict[str, str]) -> str | None:
    """``trex.models.common.moe`` -> ``common.moe``; the package -> ``__init__``; None outside trex.models."""
    if name != "trex.models" and not name.startswith("trex.models."):
        return None
    rel = name[len("trex.models."):] if name != "trex.models" else ""
    if rel in modules:
        return rel
    return f"{rel}.__init__" if rel else "__init__"


def model_imports(module: str, path: str, modules: dict[str, str]) -> list[tuple[int, str]]:
    """(line, imported module of trex.models) for every import of the file, at any depth."""
    package = ".".join(["trex", "models", *module.split(".")[:-1]])  # the package the module is in
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    found = []
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            source = node.module or ""
            if node.level:  # relative: from the module's package, up level - 1
                parts = package.split(".")
                source = ".".join(parts[: len(parts) - node.level + 1] + ([source] if source else []))
            # `from package import submodule` imports the submodule; `from package import name`, the package
            targets = [f"{source}.{a.name}" if resolve(f"{source}.{a.name}", modules) in modules else source
                       for a in node.names]
        elif (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "lazy_exports"
              and len(node.args) == 2 and isinstance(node.args[1], ast.Dict)):  # name -> submodule, imported on use
            targets = [f"{package}.{v.value}" for v in node.args[1].values if isinstance(v, ast.Constant)]
        for target in targets:
            resolved = resolve(target, modules)
            if resolved is not None and resolved != module:
                found.append((node.lineno, resolved))
    return found


def graph() -> dict[str, list[tuple[int, str]]]:
    modules = module_files()
    return {m: model_imports(m, p, modules) for m, p in modules.items()}


def group_of(module: str) -> str:
    if module.startswith("common.") or module in SHARED_LEAVES:
        return "shared"
    if module in TOP:
        return "top"
    family = module.split(".")[0]
    return family if family in FAMILIES and "." in module else "?"


def cycles(edges: dict[str, list[tuple[int, str]]]) -> list[list[str]]:
    """Every import circle found by a depth-first search (each as the modules around it)."""
    found, state, stack = [], {}, []

    def visit(m: str) -> None:
        state[m] = "open"
        stack.append(m)
        for target in sorted({target for _, target in edges.get(m, [])}):
            if state.get(target) == "open":
                found.append(stack[stack.index(target):] + [target])
            elif target not in state:
                visit(target)
        stack.pop()
        state[m] = "done"

    for m in sorted(edges):
        if m not in state:
            visit(m)
    return found


def violations(edges: dict[str, list[tuple[int, str]]]) -> list[str]:
    bad = []
    for module, imports in sorted(edges.items()):
        group = group_of(module)
        for line, target in imports:
            to = group_of(target)
            where = f"models/{module.replace('.', '/')}.py:{line}: {module} ({group}) imports {target} ({to})"
            if group == "shared" and to != "shared":
                bad.append(where + ": a shared part imports no architecture and nothing above them")
            elif group not in ("shared", "top") and to not in ("shared", group):
                bad.append(where + ": a family imports the shared parts and itself, no other family")
            elif to == "top" and group != "top":
                bad.append(where + ": what dispatches over the architectures sits on top")
    return bad


def test_every_module_has_a_group():
    assert [m for m in module_files() if group_of(m) == "?"] == []


def test_no_import_circle_in_models():
    assert cycles(graph()) == []


def test_shared_parts_then_families_then_the_dispatch():
    assert violations(graph()) == []


@pytest.mark.parametrize("source, target, what", [
    ("common.moe", "deepseek_v4.model", "violation"),  # a shared part reaching into V4
    ("deepseek_v4.config", "registry", "violation"),  # V4's config asking the registry (the presets' old circle)
    ("deepseek_v4.attention", "deepseek_v4.decode", "cycle"),  # attention naming its decode cache's class (a circle)
    ("deepseek_v3.model", "deepseek_v4.model", "violation"),  # V3 built over V4's model instead of the shared parts
    ("deepseek_v3.attention", "deepseek_v4.config", "violation"),  # V3 reading V4's config
    ("deepseek_v4.model_v41", "deepseek_v3.config", "violation"),  # V4.1 reaching into the V3 family
])
def test_the_check_sees_a_bad_import(source, target, what):
    edges = graph()
    edges[source] = edges[source] + [(1, target)]
    assert bool(violations(edges) if what == "violation" else cycles(edges))


def test_configs_and_the_registry_import_no_torch():
    """A fresh interpreter reads every preset (V4.1's validate their Engram tables) and dispatches a
    config.json without importing torch."""
    code = ("import sys\nfrom trex.models.registry import PRESETS, config_from_dict, get_preset\n"
            "for name in PRESETS:\n    config_from_dict(get_preset(name).to_hf_dict())\n"
            + "".join(f"import trex.models.{m}\n" for m in TORCH_FREE)
            + "print('torch' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip() == "False", proc.stderr[-2000:]


def bindings(path: str) -> dict[str, str]:
    """The names a module's top level binds by importing them: name -> the module it takes them from."""
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    return {(a.asname or a.name): node.module for node in tree.body
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module for a in node.names}


def passed_through(roots: list[str]) -> list[str]:
    """Every ``from trex.models.<module> import name`` (any depth, in every file under ``roots``) where
    ``<module>`` does not define ``name`` but imports it from elsewhere: an import through a module."""
    modules, bad, bound = module_files(), [], {}
    for root in roots:
        for d, _, files in os.walk(root):
            for f in sorted(files):
                if not f.endswith(".py"):
                    continue
                path = os.path.join(d, f)
                try:
                    tree = ast.parse(open(path, encoding="utf-8").read(), path)
                except (SyntaxError, ValueError, UnicodeDecodeError):  # fixtures that are not Python
                    continue
                for node in ast.walk(tree):
                    if not (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
                            and node.module.startswith("trex.models.")):
                        continue
                    target = node.module[len("trex.models."):]
                    if target not in modules:  # a package: its lazy table, or a submodule
                        continue
                    if target not in bound:
                        bound[target] = bindings(modules[target])
                    for a in node.names:
                        if a.name in bound[target]:
                            bad.append(f"{os.path.relpath(path, ROOT)}:{node.lineno}: {a.name} through "
                                       f"trex.models.{target}; it is defined in {bound[target][a.name]}")
    return bad


def test_every_import_names_the_defining_module():
    """Generic code reaches a shared part through ``trex.models.common``, not through a family's module
    that imports it (and a family's own part through the module that defines it)."""
    assert passed_through([os.path.join(ROOT, d) for d in ("src", "tests", "bench")]) == []


def test_the_check_sees_an_import_through_a_family(tmp_path):
    bad = tmp_path / "generic.py"
    bad.write_text("from trex.models.deepseek_v4.model import RMSNorm\n"
                   "from trex.models.common.norm import RMSNorm as Fine\n")
    found = passed_through([str(tmp_path)])
    assert len(found) == 1 and "RMSNorm through trex.models.deepseek_v4.model" in found[0], found


SRC = os.path.dirname(MODELS)


def family_imports(paths: list[str]) -> list[str]:
    """Every import (any depth) in ``paths`` of a family's package or module (``trex.models.<family>...``, or
    ``from trex.models import <family>``), as ``path:line: module``."""
    bad = []
    for path in paths:
        tree = ast.parse(open(path, encoding="utf-8").read(), path)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            else:
                continue
            for name in names:
                parts = name.split(".")
                if parts[:2] == ["trex", "models"] and len(parts) > 2 and parts[2] in FAMILIES:
                    bad.append(f"{os.path.relpath(path, ROOT)}:{node.lineno}: {name}")
                    break
    return bad


def outside_packages() -> dict[str, list[str]]:
    """Each top-level package (or module) of src/trex but trex.models -> its Python files."""
    found: dict[str, list[str]] = {}
    for d, _, files in os.walk(SRC):
        for f in sorted(files):
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(d, f), SRC)
                package = rel.split(os.sep)[0] if os.sep in rel else rel[:-3]
                found.setdefault(package, []).append(os.path.join(d, f))
    found.pop("models")
    return found


@pytest.mark.parametrize("package", sorted(outside_packages()))
def test_code_outside_the_models_imports_no_family(package):
    """Generic code reaches a family only through its Architecture (trex.models.registry); it imports the shared
    parts and the registry, never a family's package: a new family adds its package and one registry line."""
    assert family_imports(outside_packages()[package]) == []


def test_the_check_sees_a_family_import(tmp_path):
    generic = tmp_path / "generic.py"
    generic.write_text("from trex.models.registry import architecture\nfrom trex.models.common.moe import MoE\n"
                       "def f():\n    from trex.models.deepseek_v3.config import V3Config\n"
                       "from trex.models import deepseek_v4\nimport trex.models.deepseek_v4.spec\n")
    found = sorted(line.split(": ", 1)[1] for line in family_imports([str(generic)]))
    assert found == ["trex.models.deepseek_v3.config", "trex.models.deepseek_v4", "trex.models.deepseek_v4.spec"]


def architecture_strings(paths: list[str]) -> list[tuple[str, int, str]]:
    """(file, line, string) for each string constant in ``paths`` equal to a config ``architecture``."""
    from trex.models.registry import ARCHITECTURES

    found = []
    for path in paths:
        tree = ast.parse(open(path, encoding="utf-8").read(), path)
        found += [(os.path.relpath(path, SRC), n.lineno, n.value) for n in ast.walk(tree)
                  if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value in ARCHITECTURES]
    return found


def test_code_outside_the_models_names_no_architecture():
    """What differs per architecture is the family's (its Architecture: checkpoint names, plan terms, ...): code
    outside trex.models names one architecture only, the default of a checkpoint caller that names none."""
    found = [f for paths in outside_packages().values() for f in architecture_strings(paths)]
    default = (os.path.join("checkpoint", "naming.py"), "deepseek_v4")
    assert [(path, value) for path, _, value in found] == [default], found
