"""Built-in tools: a tool that fails, hangs or floods ends as a tool message within its limits."""

import json
import os
import time

import pytest

from trex.data.tool_calls import ToolCall
from trex.rollout.tools import Calculator, CalculatorError, PythonTool, SandboxLimits, answer, calculate, run_python

FAST = SandboxLimits(wall_s=1.0, cpu_s=5, memory_bytes=512 << 20, file_bytes=1 << 20, output_bytes=4096)


def test_python_runs_in_a_fresh_directory_with_a_scrubbed_environment():
    os.environ["TREX_SECRET_FOR_TEST"] = "x"
    try:
        r = run_python("import json, os, sys\nprint(json.dumps([os.getcwd(), sorted(os.environ), os.getpid(), "
                       "sys.flags.isolated, sys.flags.no_site]))", FAST)
    finally:
        del os.environ["TREX_SECRET_FOR_TEST"]
    cwd, env, pid, isolated, no_site = json.loads(r.content)
    assert r.ok and os.path.basename(cwd).startswith("trex-tool-") and not os.path.exists(cwd)  # removed after
    assert "TREX_SECRET_FOR_TEST" not in env and pid != os.getpid() and isolated == no_site == 1


def test_hang_times_out_within_its_limit():
    start = time.monotonic()
    r = run_python("import time\nprint('started', flush=True)\ntime.sleep(60)", FAST)
    assert time.monotonic() - start < FAST.wall_s + 1.5
    assert not r.ok and r.content.startswith("started\n") and "timed out after 1 s" in r.content


def test_busy_loop_is_stopped_by_the_cpu_limit():
    r = run_python("while True:\n    pass", SandboxLimits(wall_s=5.0, cpu_s=1))
    assert not r.ok and "CPU time limit of 1 s" in r.content  # before the 5 s wall limit


def test_fork_is_refused():
    # the audit hook refuses os.fork: no process escapes the group that a timeout kills
    r = run_python("import os\nos.fork()", FAST)
    assert not r.ok and "os.fork is not allowed" in r.content


def test_crash_is_a_message():
    r = run_python("def f():\n    raise RuntimeError('boom')\nf()", FAST)
    assert not r.ok and "RuntimeError: boom" in r.content and "[exit status 1]" in r.content
    r = run_python("import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)", FAST)
    assert not r.ok and "killed by signal SIGSEGV" in r.content


def test_100mb_print_is_truncated_quickly():
    start = time.monotonic()
    r = run_python("import sys\nsys.stdout.write('x' * 100_000_000)", FAST)
    assert time.monotonic() - start < 3
    assert not r.ok and f"output truncated at {FAST.output_bytes} bytes" in r.content
    assert len(r.content.encode()) < FAST.output_bytes + 200


def test_memory_and_file_size_limits():
    r = run_python("x = bytearray(1 << 30)", FAST)
    assert not r.ok and "MemoryError" in r.content
    r = run_python("open('big', 'wb').write(b'0' * (2 << 20))", FAST)
    assert not r.ok and "File too large" in r.content


def test_network_and_subprocesses_are_refused():
    r = run_python("import socket\nsocket.create_connection(('127.0.0.1', 9), timeout=0.5)", FAST)
    assert not r.ok and "not allowed in the sandbox" in r.content
    r = run_python("import urllib.request\nurllib.request.urlopen('http://example.com', timeout=0.5)", FAST)
    assert not r.ok and "not allowed in the sandbox" in r.content
    r = run_python("import subprocess\nsubprocess.run(['curl', 'http://example.com'])", FAST)
    assert not r.ok and "subprocess.Popen is not allowed" in r.content


def test_calculator_big_integers_and_floats():
    assert calculate("2 ** 200") == 2 ** 200
    assert calculate("123456789123456789 * 987654321987654321 - 1") == 123456789123456789 * 987654321987654321 - 1
    assert calculate("-(7 // 2) % 5 + 10 / 4") == -(7 // 2) % 5 + 10 / 4
    assert Calculator()({"expression": "99999999999999999999 + 1"}).content == "100000000000000000000"


@pytest.mark.parametrize("expression,reason", [
    ("2 ** 10 ** 10", "larger than"), ("2 ** 9000 * 2 ** 9000", "larger than"), ("1 / 0", "division by zero"),
    ("2.0 ** 5000", "too large for a float"), ("__import__('os').system('ls')", "not allowed"),
    ("a + 1", "not allowed"), ("(1", "not an arithmetic expression"), ("1 << 3", "not allowed"),
    ("True + 1", "not allowed"), ("", "non-empty"), ("(" * 300 + "1" + ")" * 300, "not an arithmetic expression"),
])
def test_calculator_refuses_with_a_reason(expression, reason):
    with pytest.raises(CalculatorError, match=reason):
        calculate(expression)
    r = Calculator()({"expression": expression})
    assert not r.ok and r.content.startswith("Error: ") and reason in r.content


def test_answer_turns_every_call_into_a_message():
    tools = {"calculator": Calculator(), "python": PythonTool(FAST)}

    class Raising:
        def __call__(self, arguments):
            raise RuntimeError("bug")
    tools["broken"] = Raising()
    calls = [ToolCall("calculator", {"expression": "6*7"}), ToolCall("weather", {"city": "Paris"}),
             ToolCall("calculator", None, "arguments are not valid JSON"), ToolCall("broken", {}),
             ToolCall("python", {"source": "print(1)"}), ToolCall("python", {"code": "print(6*7)"})]
    out = answer(calls, tools)
    assert [r.ok for r in out] == [True, False, False, False, False, True]
    assert out[0].content == "42" and out[5].content == "42\n"
    assert "unknown tool 'weather'; available: broken, calculator, python" in out[1].content
    assert "malformed tool call to calculator: arguments are not valid JSON" in out[2].content
    assert "tool broken failed: RuntimeError: bug" in out[3].content
    assert 'python takes {"code": string}' in out[4].content
