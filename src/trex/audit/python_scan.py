"""Python source analysis: one pass over the AST, names resolved through the file's imports.

``torch.cuda.synchronize()``, ``from torch import cuda; cuda.synchronize()`` and
``import torch as th; th.cuda.synchronize()`` resolve to the same qualified name. Code under a
CUDA availability check (``if torch.cuda.is_available():``, ``if dev.type == "cuda":``, the
true branch of a conditional expression) and imports under ``try/except ImportError`` are
reported at info level: they fall back elsewhere.
"""

from __future__ import annotations

import ast
import os

from trex.audit import file_scan, rules
from trex.audit.model import Effort, Finding, Severity

_IMPORT_ERRORS = {"ImportError", "ModuleNotFoundError", "Exception", "BaseException"}


def scan_python(path: str, tree: ast.AST, lines: list[str], allow_modules: frozenset[str] = frozenset(),
                is_setup_script: bool = False) -> tuple[list[Finding], int]:
    """Findings of one parsed file, and how many were dropped because their module is allowlisted.
    A package importing its own modules is not lock-in: the top-level package the file belongs to
    (`own_package`) is allowed, so auditing liger_kernel's source does not count liger_kernel."""
    own = own_package(path)
    visitor = _Visitor(path, lines, allow_modules | ({own} if own else set()), is_setup_script)
    visitor.visit(tree)
    return visitor.findings, visitor.allowlisted


def own_package(path: str) -> str | None:
    """The top-level package of ``path``: the outermost of the unbroken chain of directories with an
    ``__init__.py`` that hold it (None for a file outside any package)."""
    directory, top = os.path.dirname(os.path.abspath(path)), None
    while os.path.isfile(os.path.join(directory, "__init__.py")):
        top = os.path.basename(directory)
        directory = os.path.dirname(directory)
    return top


def _is_int(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and type(node.value) is int


def _str(node: ast.AST) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


class _Visitor(ast.NodeVisitor):
    def __init__(self, path: str, lines: list[str], allow_modules: frozenset[str], is_setup_script: bool):
        self.path = path
        self.lines = lines
        self.allow_modules = allow_modules
        self.is_setup_script = is_setup_script
        self.aliases: dict[str, str] = {}  # local name -> qualified name
        self.findings: list[Finding] = []
        self.allowlisted = 0
        self.guard_depth = 0  # > 0 inside a branch that only runs on CUDA
        self.optional_import_depth = 0  # > 0 inside try/except ImportError
        self.no_device_strings = 0  # > 0 inside comparisons, subscripts and dict keys
        self.consumed: set[int] = set()  # ids of constants already reported by a call rule

    # ---- reporting --------------------------------------------------------------------------
    def emit(self, rule_id: str, node: ast.AST, message: str, replacement: str | None = None,
             severity: Severity | None = None, guard_note: str | None = None, effort: Effort | None = None) -> None:
        """Record a finding; inside a CUDA-only branch, or with a ``guard_note``, it is info level."""
        rule = rules.RULES[rule_id]
        line = getattr(node, "lineno", 1)
        if guard_note is None and self.guard_depth > 0:
            guard_note = " (inside a branch that only runs on CUDA and falls back otherwise)"
        guarded = guard_note is not None
        if guarded:
            severity = Severity.INFO
            message += guard_note
        snippet = self.lines[line - 1].strip()[:200] if 0 < line <= len(self.lines) else ""
        self.findings.append(Finding(
            rule=rule, path=self.path, line=line, column=getattr(node, "col_offset", 0) + 1,
            message=message, replacement=replacement or rule.replacement, snippet=snippet,
            severity=severity, guarded=guarded, effort=effort))

    # ---- name resolution --------------------------------------------------------------------
    def qualify(self, node: ast.AST) -> str | None:
        """Dotted name of a Name/Attribute chain with import aliases resolved, else None."""
        parts = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        if not isinstance(node, ast.Name):
            return None
        parts.append(self.aliases.get(node.id, node.id))
        return ".".join(reversed(parts))

    def classify(self, name: str) -> tuple[str, str, str | None] | None:
        """(rule id, message, replacement) for a qualified name that is vendor-specific."""
        parts = name.split(".")
        if name == rules.CUDA_MODULE or name.startswith(rules.CUDA_MODULE + "."):
            rest = parts[2:]
            if not rest:
                return "TRX102", f"reference to the {name} module", None
            for prefix, rule_id, replacement in rules.CUDA_SUBAREAS:
                if rest[0] == prefix:
                    return rule_id, f"{name}", replacement
            if rest[0] in rules.CUDA_ACCELERATOR_EQUIVALENTS:
                return "TRX101", f"{name} has a portable equivalent", rules.CUDA_ACCELERATOR_EQUIVALENTS[rest[0]]
            return "TRX102", f"{name} has no torch.accelerator equivalent", \
                f"torch.get_device_module(device.type).{rest[0]}"
        for module in rules.BACKEND_FLAG_MODULES:
            if name.startswith(module + "."):
                if parts[-1] in rules.SDPA_PINNING:
                    return "TRX303", f"{name} pins the attention backend", None
                return "TRX106", f"{name} is a CUDA-only backend flag", None
        if parts[-1] in rules.FORCED_SDPA_BACKENDS and "SDPBackend" in parts:
            return "TRX303", f"attention forced to {parts[-1]}", None
        if any(p in rules.NCCL_ONLY_NAMES for p in parts):
            return "TRX203", f"{name} only exists for NCCL", None
        if parts[-1].upper() == rules.NCCL.upper() and len(parts) > 1 and parts[-2] == "Backend":
            return "TRX201", f"{name} selects the NCCL backend", None
        if parts[-1] in rules.CUDA_EXTENSION_NAMES:
            return "TRX401", f"{name} builds a CUDA extension", None
        return None

    # ---- imports ----------------------------------------------------------------------------
    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.asname:
                self.aliases[alias.asname] = alias.name
            else:
                top = alias.name.split(".")[0]
                self.aliases[top] = top
            self.check_module(alias.name, node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        module = node.module or ""
        prefix = "." * node.level + module
        for alias in node.names:
            self.aliases[alias.asname or alias.name] = f"{prefix}.{alias.name}" if prefix else alias.name
        if node.level == 0 and module:
            self.check_module(module, node, imported=[a.name for a in node.names])

    def check_module(self, module: str, node: ast.AST, imported: list[str] | None = None) -> None:
        top = module.split(".")[0]
        note = " (optional import with a fallback)" if self.optional_import_depth > 0 else None
        if top in self.allow_modules or module in self.allow_modules:
            self.allowlisted += 1
            return
        if module.startswith(rules.DEEPSPEED_OP_MODULE) or (
                top == "deepspeed" and any(rules.DEEPSPEED_CUDA_BUILDER.fullmatch(n) for n in imported or [])):
            self.emit("TRX304", node, f"import of DeepSpeed op builders ({module})", guard_note=note)
        elif top == "nvtx":
            self.emit("TRX109", node, "import of the nvtx package", guard_note=note)
        elif top in rules.CUDA_LIBRARIES:
            _, effort, replacement = rules.CUDA_LIBRARIES[top]
            self.emit("TRX301", node, f"import of {top}, which needs CUDA ({effort.value} port)", replacement,
                      guard_note=note, effort=effort)

    def visit_Try(self, node: ast.Try) -> None:
        catches_import = any(h.type is None or any(
            isinstance(n, ast.Name) and n.id in _IMPORT_ERRORS
            for n in ([h.type] + (list(h.type.elts) if isinstance(h.type, ast.Tuple) else [])))
            for h in node.handlers)
        self.optional_import_depth += catches_import
        for stmt in node.body:
            self.visit(stmt)
        self.optional_import_depth -= catches_import
        for part in (node.handlers, node.orelse, node.finalbody):
            for child in part:
                self.visit(child)

    visit_TryStar = visit_Try

    # ---- guards -----------------------------------------------------------------------------
    def guard_polarity(self, test: ast.AST) -> tuple[int, bool]:
        """(+1 the true branch needs CUDA, -1 the false branch does, 0 no guard; uses torch.cuda)."""
        if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
            polarity, via_cuda = self.guard_polarity(test.operand)
            return -polarity, via_cuda
        if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And):
            results = [self.guard_polarity(v) for v in test.values]
            if any(p > 0 for p, _ in results):
                return 1, any(c for p, c in results if p > 0)
            return 0, False
        if isinstance(test, ast.Call):
            name = self.qualify(test.func) or ""
            if name in (f"{rules.CUDA_MODULE}.is_available", f"{rules.CUDA_MODULE}.device_count"):
                return 1, True
            if isinstance(test.func, ast.Attribute) and test.func.attr == "startswith" and test.args \
                    and _str(test.args[0]) == rules.GUARD_DEVICE_TYPE:
                return 1, False
        if isinstance(test, ast.Compare) and len(test.ops) == 1:
            left, right, op = test.left, test.comparators[0], test.ops[0]
            if isinstance(left, ast.Call) and self.guard_polarity(left)[1]:  # device_count() > 0
                return (1 if isinstance(op, (ast.Gt, ast.GtE, ast.NotEq)) else -1), True
            if rules.GUARD_DEVICE_TYPE in (_str(left), _str(right)):
                if isinstance(op, (ast.Eq, ast.In, ast.Is)):
                    return 1, False
                if isinstance(op, (ast.NotEq, ast.NotIn, ast.IsNot)):
                    return -1, False
        return 0, False

    def visit_guarded(self, test: ast.AST, body: list[ast.AST], orelse: list[ast.AST]) -> None:
        polarity, via_cuda = self.guard_polarity(test)
        if polarity == 0:
            self.visit(test)
        elif via_cuda:
            self.emit("TRX100", test, "CUDA availability check guards this branch",
                      "torch.accelerator.is_available() / device.type, so that other accelerators take the fast path too",
                      guard_note="")
        for branch, guarded in ((body, polarity > 0), (orelse, polarity < 0)):
            self.guard_depth += guarded
            for child in branch:
                self.visit(child)
            self.guard_depth -= guarded

    def visit_If(self, node: ast.If) -> None:
        self.visit_guarded(node.test, node.body, node.orelse)

    def visit_IfExp(self, node: ast.IfExp) -> None:
        polarity, via_cuda = self.guard_polarity(node.test)
        if via_cuda and self._is_cpu(node.orelse if polarity > 0 else node.body):  # "cuda" if ... else "cpu"
            self.emit("TRX111", node, "CUDA if torch.cuda says so, else the CPU")
        self.visit_guarded(node.test, [node.body], [node.orelse])

    def _is_cpu(self, node: ast.AST) -> bool:
        """The CPU as a device: "cpu" or torch.device("cpu")."""
        if _str(node) == "cpu":
            return True
        return (isinstance(node, ast.Call) and self.qualify(node.func) == "torch.device" and len(node.args) == 1
                and _str(node.args[0]) == "cpu")

    # ---- calls --------------------------------------------------------------------------------
    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        name = self.qualify(func)
        last = name.rsplit(".", 1)[-1] if name else (func.attr if isinstance(func, ast.Attribute) else "")
        func_reported = False
        if isinstance(func, ast.Attribute) and func.attr == "cuda" and name != rules.CUDA_MODULE:
            self.emit("TRX103", node, ".cuda() moves to a CUDA device")
            func_reported = True
            self.visit(func.value)
        elif name:
            hit = self.classify(name)
            if hit:
                rule_id, message, replacement = hit
                severity = None
                if name == f"{rules.CUDA_MODULE}.is_available":
                    message += "; outside a guard it silently selects the CPU on other accelerators"
                    severity = Severity.WARNING
                self.emit(rule_id, node, message, replacement, severity=severity)
                func_reported = True
        self.check_call_arguments(node, name, last)
        if not func_reported:
            self.visit(func)
        for arg in node.args:
            self.visit(arg)
        for kw in node.keywords:
            self.visit(kw.value)

    def check_call_arguments(self, node: ast.Call, name: str | None, last: str) -> None:
        kwargs = {kw.arg: kw.value for kw in node.keywords if kw.arg}
        first = node.args[0] if node.args else None
        # integer device ids
        candidates = [kwargs.get("device")]
        if last == "to" and isinstance(node.func, ast.Attribute) or name == "torch.device":
            candidates.append(first)
        for value in candidates:
            if value is not None and (_is_int(value) or isinstance(value, ast.Name) and value.id in rules.RANK_NAMES):
                self.emit("TRX105", value, "integer device id")
        # autocast / GradScaler bound to CUDA
        if last in rules.AMP_NAMES:
            for value in (first, kwargs.get("device_type"), kwargs.get("device")):
                text = _str(value) if value is not None else None
                if text is not None and rules.DEVICE_STRING.fullmatch(text):
                    self.consumed.add(id(value))
                    self.emit("TRX107", node, f"{last}({text!r}) is tied to CUDA")
        # dynamic imports
        if last in rules.IMPORT_FUNCS and first is not None and _str(first):
            self.check_module(_str(first), node)
        # attention implementations
        impl = _str(kwargs.get("attn_implementation")) if "attn_implementation" in kwargs else None
        if impl in rules.FLASH_ATTN_IMPLEMENTATIONS:
            self.consumed.add(id(kwargs["attn_implementation"]))
            self.emit("TRX303", node, f"attn_implementation={impl!r} needs FlashAttention")
        for flag in rules.FLASH_FLAGS & kwargs.keys():
            if isinstance(kwargs[flag], ast.Constant) and kwargs[flag].value is True:
                self.emit("TRX303", node, f"{flag}=True needs FlashAttention")
        # JIT-compiled extensions
        if name and name.startswith(rules.CPP_EXTENSION_MODULE) and last in rules.JIT_LOADERS:
            sources = [_str(n) or "" for v in kwargs.values() for n in ast.walk(v)] + \
                      [_str(n) or "" for a in node.args for n in ast.walk(a)]
            with_cuda = isinstance(kwargs.get("with_cuda"), ast.Constant) and kwargs["with_cuda"].value is True
            if "cuda_sources" in kwargs or with_cuda or any(s.endswith(rules.CUDA_SOURCE_SUFFIXES) for s in sources):
                self.emit("TRX402", node, f"{last}() compiles CUDA sources")
        # setup.py requirements
        if self.is_setup_script and last == "setup":
            for key in ("install_requires", "extras_require", "setup_requires"):
                for child in ast.walk(kwargs[key]) if key in kwargs else ():
                    text = _str(child)
                    if text:
                        self.consumed.add(id(child))
                        for rule_id, message, replacement in file_scan.requirement_hits(text):
                            self.emit(rule_id, child, message, replacement)

    # ---- attributes, names and literals ---------------------------------------------------------
    def visit_Attribute(self, node: ast.Attribute) -> None:
        name = self.qualify(node)
        if name is None:
            self.generic_visit(node)
            return
        hit = self.classify(name)
        if hit:
            self.emit(hit[0], node, hit[1], hit[2])

    def visit_Name(self, node: ast.Name) -> None:
        if node.id in rules.NCCL_ONLY_NAMES or node.id in rules.CUDA_EXTENSION_NAMES:
            hit = self.classify(self.aliases.get(node.id, node.id))
            if hit:
                self.emit(hit[0], node, hit[1], hit[2])

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        for dec in node.decorator_list:
            name = self.qualify(dec.func if isinstance(dec, ast.Call) else dec)
            if name in rules.TRITON_DECORATORS:
                self.emit("TRX302", node, f"@{name} kernel {node.name}()")
                break
        self.generic_visit(node)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Expr(self, node: ast.Expr) -> None:
        if _str(node.value) is None:  # a bare string statement is a docstring or a comment
            self.visit(node.value)

    def visit_Constant(self, node: ast.Constant) -> None:
        text = node.value
        if not isinstance(text, str) or id(node) in self.consumed or len(text) > 64:
            return
        if rules.NCCL_ENV.fullmatch(text):
            self.emit("TRX202", node, f"{text} only tunes NCCL")
        elif text == rules.VISIBLE_DEVICES:
            self.emit("TRX112", node, f"{text} selects devices on CUDA only")
        elif self.no_device_strings:
            return
        elif rules.DEVICE_STRING.fullmatch(text):
            self.emit("TRX104", node, f"device string {text!r}")
        elif text.lower() == rules.NCCL or f":{rules.NCCL}" in text.lower():
            self.emit("TRX201", node, f"backend {text!r}")

    def visit_JoinedStr(self, node: ast.JoinedStr) -> None:
        head = _str(node.values[0]) if node.values else None
        if head is not None and head.startswith(rules.DEVICE_PREFIX) and not self.no_device_strings:
            self.emit("TRX104", node, f"device string f{head!r}...")
        for value in node.values:
            if isinstance(value, ast.FormattedValue):
                self.visit(value)

    def visit_without_device_strings(self, *nodes: ast.AST | None) -> None:
        self.no_device_strings += 1
        for n in nodes:
            if n is not None:
                self.visit(n)
        self.no_device_strings -= 1

    def visit_collection(self, node: ast.Tuple | ast.List | ast.Set) -> None:
        """A literal listing several device types, ("cuda", "npu", "xpu"), is a per-device table."""
        types = {_str(e) for e in node.elts} & rules.DEVICE_TYPES
        if len(types) > 1 and rules.GUARD_DEVICE_TYPE in types:
            self.visit_without_device_strings(*node.elts)
        else:
            self.generic_visit(node)

    visit_Tuple = visit_List = visit_Set = visit_collection

    def visit_Compare(self, node: ast.Compare) -> None:
        self.visit_without_device_strings(node.left, *node.comparators)

    def visit_MatchValue(self, node: ast.MatchValue) -> None:  # case "cuda": is a comparison
        self.visit_without_device_strings(node.value)

    def visit_Subscript(self, node: ast.Subscript) -> None:
        self.visit(node.value)
        self.visit_without_device_strings(node.slice)

    def visit_Dict(self, node: ast.Dict) -> None:
        """Keys are never device strings; a dict keyed by several device types is a per-device table."""
        self.visit_without_device_strings(*node.keys)
        types = {_str(k) for k in node.keys if k is not None} & rules.DEVICE_TYPES
        if len(types) > 1 and rules.GUARD_DEVICE_TYPE in types:
            self.visit_without_device_strings(*node.values)
        else:
            for value in node.values:
                self.visit(value)
