"""Built-in tools of tool-using rollouts: a Python executor in a sandboxed subprocess and a calculator.

A tool takes the parsed arguments of one call (trex.data.tool_calls) and returns a :class:`ToolResult`
whose ``content`` is the tool message the model reads next. A tool never raises: a call that is
malformed, names no known tool, fails, hangs or floods its output ends as a message saying so, within
the tool's limits.

Nothing a tool runs executes in the trainer's process. ``python`` runs the program in a fresh
interpreter (``python -I -S``: isolated, the standard library only, no site-packages and none of
their ``.pth`` code; exec'd, no ``preexec_fn``) in a new session, with a fresh temporary
directory as its working directory and home, a scrubbed environment, and these limits set by the child
itself before the program starts (``resource.setrlimit``):

* CPU seconds (``RLIMIT_CPU``), address space (``RLIMIT_AS``), file size (``RLIMIT_FSIZE``), no core;
* no network: a network namespace of its own where the kernel allows it (``unshare(CLONE_NEWNET)``,
  only a down loopback inside), and always an audit hook that refuses sockets, subprocesses, exec,
  fork and ctypes;
* output (stdout and stderr together) read up to ``output_bytes``: past it the process group is
  killed and the message says the output was truncated;
* wall-clock ``wall_s``: past it the process group is killed.

``calculator`` evaluates arithmetic (``+ - * / // % **``, parentheses, int and float literals) by
walking the ``ast`` of the expression (no ``eval``), with results bounded in size; it runs no code
from the call and needs no subprocess.
"""

from __future__ import annotations

import ast
import math
import operator
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from trex.data.tool_calls import ToolCall


@dataclass(frozen=True)
class ToolResult:
    """The tool message (``content``), whether the tool succeeded, and its wall seconds."""
    content: str
    ok: bool
    seconds: float


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one ``python`` call."""
    wall_s: float = 10.0
    cpu_s: int = 10
    memory_bytes: int = 1 << 30
    file_bytes: int = 16 << 20
    output_bytes: int = 16 << 10


def _function(name: str, description: str, param: str, about: str) -> dict:
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": {param: {"type": "string", "description": about}},
                       "required": [param]}}}


# ---- python ---------------------------------------------------------------------------------------
# Runs in the child interpreter: limits first, then the network namespace, then the audit hook, then
# the program (main.py in the working directory).
_BOOTSTRAP = r"""
import resource, sys
cpu, mem, fsize = (int(a) for a in sys.argv[1:4])
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))  # SIGXCPU at the soft limit
for kind, n in ((resource.RLIMIT_AS, mem), (resource.RLIMIT_FSIZE, fsize), (resource.RLIMIT_CORE, 0)):
    resource.setrlimit(kind, (n, n))
try:
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(0x40000000) != 0:
        libc.unshare(0x10000000 | 0x40000000)
    del ctypes, libc
except Exception:
    pass
BLOCKED = ("socket.", "subprocess.", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork",
           "os.forkpty", "pty.", "ctypes.", "_posixsubprocess.")
def _hook(event, args):
    if event.startswith(BLOCKED):
        raise PermissionError(f"{event} is not allowed in the sandbox (no network, no subprocesses)")
sys.addaudithook(_hook)
del _hook
sys.argv = ["main.py"]
with open("main.py", encoding="utf-8") as f:
    _code = compile(f.read(), "main.py", "exec")
exec(_code, {"__name__": "__main__", "__builtins__": __builtins__})
"""


def run_python(code: str, limits: SandboxLimits = SandboxLimits()) -> ToolResult:
    """Run ``code`` in the sandbox; the message is its output (stdout and stderr interleaved), with a
    bracketed note when it timed out, was truncated, ran out of CPU time, or exited non-zero."""
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="trex-tool-") as tmp:
        with open(os.path.join(tmp, "main.py"), "w", encoding="utf-8") as f:
            f.write(code)
        env = {"PATH": "/usr/bin:/bin", "HOME": tmp, "TMPDIR": tmp, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _BOOTSTRAP, str(limits.cpu_s), str(limits.memory_bytes),
             str(limits.file_bytes)],
            cwd=tmp, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            start_new_session=True, close_fds=True)
        try:
            out, note = _collect(proc, start + limits.wall_s, limits)
        finally:
            _kill_group(proc)
            proc.stdout.close()
            proc.wait()
    text = out.decode("utf-8", errors="replace")
    if note is None and proc.returncode:
        if proc.returncode == -signal.SIGXCPU:
            note = f"killed: CPU time limit of {limits.cpu_s} s"
        elif proc.returncode < 0:
            note = f"killed by signal {signal.Signals(-proc.returncode).name}"
        else:
            note = f"exit status {proc.returncode}"
    if note:
        text += ("" if not text or text.endswith("\n") else "\n") + f"[{note}]"
    return ToolResult(text, note is None, time.monotonic() - start)


def _collect(proc: subprocess.Popen, deadline: float, limits: SandboxLimits) -> tuple[bytes, str | None]:
    """Read the child's output until EOF, the deadline or the output limit (then kill its group)."""
    buf = bytearray()
    fd = proc.stdout.fileno()
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                _kill_group(proc)
                return bytes(buf), f"timed out after {limits.wall_s:g} s; process killed"
            if not sel.select(timeout=left):
                continue
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                break
            buf += chunk
            if len(buf) > limits.output_bytes:
                _kill_group(proc)
                return bytes(buf[:limits.output_bytes]), (f"output truncated at {limits.output_bytes} bytes; "
                                                          "process killed")
    while not _exited(proc):  # not reaped yet, so its process group id stays its own until the kill
        if time.monotonic() >= deadline:  # closed its output but kept running
            _kill_group(proc)
            return bytes(buf), f"timed out after {limits.wall_s:g} s; process killed"
        time.sleep(0.002)
    return bytes(buf), None


def _exited(proc: subprocess.Popen) -> bool:
    """Whether the child has exited, without reaping it."""
    return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT | os.WNOHANG) is not None


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the child's process group; called only before the child is reaped (run_python's wait)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


class PythonTool:
    """``python``: {"code": str} -> what the program prints (run_python)."""

    name = "python"
    schema = _function("python", "Run a Python 3 program in a sandbox (no network; limited time, memory and "
                       "output) and return what it prints.", "code", "the program")

    def __init__(self, limits: SandboxLimits = SandboxLimits()):
        self.limits = limits

    def __call__(self, arguments: dict) -> ToolResult:
        code = arguments.get("code")
        if not isinstance(code, str) or set(arguments) != {"code"}:
            return ToolResult('Error: python takes {"code": string}', False, 0.0)
        return run_python(code, self.limits)


# ---- calculator -----------------------------------------------------------------------------------
class CalculatorError(ValueError):
    pass


_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def calculate(expression: str, *, max_bits: int = 10_000, max_chars: int = 2_000) -> int | float:
    """The value of an arithmetic ``expression``. CalculatorError (with the reason) for anything else:
    names, calls, other operators, non-numeric literals, results over ``max_bits`` bits, division by
    zero, float overflow."""
    if not isinstance(expression, str) or not expression.strip():
        raise CalculatorError("expected a non-empty arithmetic expression")
    if len(expression) > max_chars:
        raise CalculatorError(f"expression longer than {max_chars} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, RecursionError, MemoryError, ValueError) as err:
        raise CalculatorError(f"not an arithmetic expression: {getattr(err, 'msg', None) or err}") from None

    def ev(node):
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](ev(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            a, b = ev(node.left), ev(node.right)
            _check_size(type(node.op), a, b, max_bits)
            return _BINARY[type(node.op)](a, b)
        raise CalculatorError(f"{ast.unparse(node)!r} is not allowed (numbers, + - * / // % ** and parentheses only)")
    try:
        value = ev(tree.body)
    except ZeroDivisionError:
        raise CalculatorError("division by zero") from None
    except OverflowError:
        raise CalculatorError("result too large for a float") from None
    except RecursionError:
        raise CalculatorError("expression too deeply nested") from None
    if isinstance(value, int) and value.bit_length() > max_bits:
        raise CalculatorError(f"result larger than {max_bits} bits")
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculatorError("result is not a finite number")
    return value


def _check_size(op, a, b, max_bits: int) -> None:
    """Refuse integer operations whose result would exceed ``max_bits`` before computing them."""
    if not (isinstance(a, int) and isinstance(b, int)):
        return
    if op is ast.Mult and a.bit_length() + b.bit_length() > max_bits + 1:
        raise CalculatorError(f"result larger than {max_bits} bits")
    if op is ast.Pow and b > 0 and abs(a) > 1 and (abs(a).bit_length() - 1) * b > max_bits:
        raise CalculatorError(f"result larger than {max_bits} bits")


class Calculator:
    """``calculator``: {"expression": str} -> its value (calculate)."""

    name = "calculator"
    schema = _function("calculator", "Evaluate an arithmetic expression exactly (integers of any size up to a "
                       "limit, floats; + - * / // % ** and parentheses).", "expression", "e.g. 123456789 * 987654321")

    def __call__(self, arguments: dict) -> ToolResult:
        start = time.monotonic()
        expression = arguments.get("expression")
        if not isinstance(expression, str) or set(arguments) != {"expression"}:
            return ToolResult('Error: calculator takes {"expression": string}', False, 0.0)
        try:
            return ToolResult(repr(calculate(expression)), True, time.monotonic() - start)
        except CalculatorError as err:
            return ToolResult(f"Error: {err}", False, time.monotonic() - start)


BUILTIN_TOOLS = {"python": PythonTool, "calculator": Calculator}


def answer(calls: Sequence[ToolCall], tools: Mapping[str, object]) -> list[ToolResult]:
    """One result per call, in call order: the tool's, or an error message for a malformed call, an
    unknown tool, or a tool that raised (a tool should not; its exception becomes the message)."""
    results = []
    for call in calls:
        start = time.monotonic()
        if call.error is not None:
            results.append(ToolResult(f"Error: malformed tool call{f' to {call.name}' if call.name else ''}: "
                                      f"{call.error}", False, 0.0))
        elif call.name not in tools:
            results.append(ToolResult(f"Error: unknown tool {call.name!r}; available: {', '.join(sorted(tools))}",
                                      False, 0.0))
        else:
            try:
                results.append(tools[call.name](call.arguments))
            except Exception as err:  # noqa: BLE001 - a tool's failure is the model's tool message
                results.append(ToolResult(f"Error: tool {call.name} failed: {type(err).__name__}: {err}", False,
                                          time.monotonic() - start))
    return results
