"""`trex ARGS` from a test, as a user runs it, at the least CPU.

- One process without a device plugin runs in the test's own process: ``trex.cli.main(args)`` in ``cwd``,
  with ``env`` set around the call and one compute thread (what OMP_NUM_THREADS=1 gives a process of its own,
  so the reduction order, and every number, is the one a separate process computes; ``PYTHONPATH`` in
  ``env`` goes on sys.path for the call, where a reward plug-in is imported from). A process start
  (importing torch, dynamo and DCP: ~4 CPU seconds) costs more than most test runs' steps. What the command
  starts as ``sys.executable -m ...`` (the fidelity tools' `trex train` runs, torchrun and its ranks) is a child
  forked from the warm process below (``sys.executable`` is its client for the call).
- ``procs`` > 1 runs under torchrun (``python -m torch.distributed.run --standalone``), the launcher and each
  rank a child forked from a process that has imported trex (tests/trex_zygote.py, started on first use, one per
  test process): torchrun starts the zygote's client as the rank's program (``--no-python``), with the rank's
  environment, and the client forwards torchrun's signals to its child.
- ``torchrun(script, args)``: a test's worker script under torchrun, its ranks forked from the same zygote.
- ``python(code)``: ``python -c CODE`` as a child forked from the same zygote.
- ``env`` naming ``TREX_DEVICE_PLUGINS`` runs in a process of its own: a plugin registers its device type
  for the life of the process, which would leak into the tests after it. One rank is a child forked from the
  zygote (which never imports a plugin); ranks under torchrun are fresh interpreters, as users start them.
  ``trex_sequence(commands, env=...)`` runs several such commands in one process of their own.

The result is a ``subprocess.CompletedProcess`` either way (returncode, stdout, stderr).
"""

from __future__ import annotations

import atexit
import contextlib
import io
import json
import os
import subprocess
import sys
import tempfile
from unittest import mock

import torch
import trex_zygote

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def trex(args: list[str], *, procs: int = 1, env: dict | None = None, cwd: str = ROOT,
         timeout: float = 600) -> subprocess.CompletedProcess:
    env = env or {}
    if procs == 1 and "TREX_DEVICE_PLUGINS" not in env:
        return _in_process(args, env, cwd)
    env = {**os.environ, "OMP_NUM_THREADS": "1", **env}
    if procs == 1:  # a child forked from the warm process: the plugin registers there, not in this process
        socket_path, client = _zygote()
        env["TREX_ZYGOTE"] = socket_path
        command = [client, *args]
    elif "TREX_DEVICE_PLUGINS" in env:
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(procs), "--standalone",
                   "-m", "trex", *args]
    else:
        socket_path, client = _zygote()
        env["TREX_ZYGOTE"] = socket_path
        command = [client, "-m", "torch.distributed.run", "--nproc-per-node", str(procs), "--standalone",
                   "--no-python", client, *args]
    return subprocess.run(command, capture_output=True, text=True, cwd=cwd, timeout=timeout, env=env)


def torchrun(script: str, args: list[str], *, nproc: int = 2, env: dict | None = None,
             timeout: float = 300) -> subprocess.CompletedProcess:
    """``torchrun --nproc-per-node NPROC SCRIPT ARGS`` of a test's worker script, on the CPU with one thread a
    rank: the launcher and each rank a child forked from the warm process of ``trex`` above (tests/trex_zygote.py
    runs ``-m MODULE`` as python does, and a ``.py`` command as ``python SCRIPT ARGS``), which spares each rank
    ~3.5 CPU seconds of imports and the launcher ~2."""
    socket_path, client = _zygote()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TREX_DEVICE": "cpu", **(env or {}), "TREX_ZYGOTE": socket_path}
    command = [client, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--standalone",
               "--no-python", client, os.path.abspath(script), *args]
    return subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=timeout, env=env)


def python(code: str, args: list[str] = (), *, env: dict | None = None, cwd: str = ROOT,
           timeout: float = 300) -> subprocess.CompletedProcess:
    """``python -c CODE ARGS`` in a child forked from the warm process of ``trex`` above (tests/trex_zygote.py), with
    ``env`` over this process's environment and one compute thread: a process of its own (what it registers
    or imports stays there) without ~3 CPU seconds of interpreter start and imports."""
    socket_path, client = _zygote()
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {}), "TREX_ZYGOTE": socket_path}
    with tempfile.TemporaryDirectory(prefix="trex-child-") as d:  # the script's directory goes on its sys.path
        script = os.path.join(d, "child.py")
        with open(script, "w") as f:
            f.write(code)
        return subprocess.run([client, script, *args], capture_output=True, text=True, cwd=cwd, timeout=timeout, env=env)


def trex_sequence(commands: list[list[str]], *, env: dict, cwd: str = ROOT,
                  timeout: float = 900) -> list[subprocess.CompletedProcess]:
    """Several ``trex ARGS`` one after the other in one process of their own (a child forked from the warm
    process, ``python`` above), each as ``trex`` above runs one in the test's process (one compute thread, its
    output captured): for commands that need a process apart (``env`` naming ``TREX_DEVICE_PLUGINS``: the
    plugin's device stays registered for the life of the process). Every command runs, whatever the one
    before returned."""
    script = ("import json, sys\nsys.path.insert(0, sys.argv[1])\nfrom trex_run import _in_process\n"
              "done = [_in_process(args, {}, sys.argv[2]) for args in json.loads(sys.argv[3])]\n"
              "print(_SEQUENCE + json.dumps([[p.returncode, p.stdout, p.stderr] for p in done]))\n")
    proc = python(script.replace("_SEQUENCE", repr(_SEQUENCE)), [os.path.dirname(os.path.abspath(__file__)), cwd,
                                                                  json.dumps(commands)], env=env, cwd=cwd, timeout=timeout)
    marked = [line for line in proc.stdout.splitlines() if line.startswith(_SEQUENCE)]
    assert proc.returncode == 0 and marked, f"the commands' process failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}"
    return [subprocess.CompletedProcess(["trex", *args], code, out, err)
            for args, (code, out, err) in zip(commands, json.loads(marked[-1][len(_SEQUENCE):]))]


_SEQUENCE = "@@trex_sequence@@"
_ZYGOTE: tuple[str, str] | None = None  # (its socket, its client) once started


def zygote_socket() -> str:
    """The socket of the warm process above (started on first use, one per test process), for a test that puts its
    own client where a command finds ``trex`` (tests/test_docs_commands.py's sandboxes, tests/trex_zygote.py's
    ``write_client``)."""
    return _zygote()[0]


def warm_python(monkeypatch) -> None:
    """For one test (pytest's ``monkeypatch``): ``sys.executable`` is the warm process's client, so what the code
    under test starts as ``python -m MODULE`` (an engine process, `trex train`) is a child forked from it, as ``trex``
    above starts its commands' processes."""
    socket_path, client = _warm_python()
    monkeypatch.setenv("TREX_ZYGOTE", socket_path)
    monkeypatch.setenv("TREX_ZYGOTE_PYTHON", client)
    monkeypatch.setattr(sys, "executable", client)


def _zygote() -> tuple[str, str]:
    global _ZYGOTE
    if _ZYGOTE is None:
        server = trex_zygote.running({**os.environ, "OMP_NUM_THREADS": "1"})
        socket_path = server.__enter__()
        atexit.register(server.__exit__, None, None, None)
        _ZYGOTE = socket_path, trex_zygote.write_client(os.path.dirname(socket_path))
        trex_zygote.write_client(os.path.dirname(socket_path), python=True)
    return _ZYGOTE


def _warm_python() -> tuple[str, str]:
    """(the warm process's socket, its client that stands for ``python``)."""
    socket_path, client = _zygote()
    return socket_path, os.path.join(os.path.dirname(client), "python")


def _in_process(args: list[str], env: dict, cwd: str) -> subprocess.CompletedProcess:
    from trex.cli import main

    out, err, threads = io.StringIO(), io.StringIO(), torch.get_num_threads()
    path = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    python = sys.executable
    if "TREX_DEVICE_PLUGINS" not in {**os.environ, **env}:  # what it starts as `python -m ...` forks from the warm process
        socket_path, python = _warm_python()
        env = {"TREX_ZYGOTE": socket_path, "TREX_ZYGOTE_PYTHON": python, "OMP_NUM_THREADS": "1", **env}
    torch.set_num_threads(1)
    try:
        with mock.patch.dict(os.environ, env), mock.patch.object(sys, "path", [*path, *sys.path]), \
                mock.patch.object(sys, "executable", python), \
                contextlib.chdir(cwd), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(args)
            except SystemExit as e:  # argparse's exit 2, --help's 0
                code = e.code if isinstance(e.code, int) else 1
    finally:
        torch.set_num_threads(threads)
    return subprocess.CompletedProcess(["trex", *args], code, out.getvalue(), err.getvalue())
