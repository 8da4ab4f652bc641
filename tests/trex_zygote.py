"""A warm `trex` for the documented commands (tests/test_docs_commands.py).

Each `trex` process spends ~3.5 CPU seconds importing torch, dynamo, DCP and matplotlib before it does
anything; the documents run ~50 of them. The server imports trex once, then forks a child for every
command: the child takes the command's argv, environment, working directory and its three standard
streams (passed as file descriptors over a Unix socket), runs ``trex.cli.main`` and exits with its code,
so the shell line runs as written (pipes, redirections and exit codes are the child's own).

- ``serve(path)``: the server (``python tests/trex_zygote.py serve PATH``), one process, no threads; it
  exits when the process that started it has gone.
- ``client()``: what the sandbox's ``.venv/bin/trex`` runs (stdlib only, started with ``python -S``). It
  appends the child's CPU seconds to ``$TREX_ZYGOTE_CPU``: the shell's ``times`` does not see a process
  it did not start.
- A command whose first word is a ``.py`` file runs that script as ``python SCRIPT ARGS`` would (``__main__``,
  its directory first on sys.path): a test's torchrun worker (tests/trex_run.py's ``torchrun``); one that
  starts ``-m MODULE`` runs the module as ``python -m MODULE ARGS`` would: torchrun's launcher, which spares it
  ~2 CPU seconds of importing torch.
- ``write_client(DIR, python=True)``: a client that stands for the interpreter. A child whose environment names
  ``TREX_ZYGOTE_PYTHON`` (such a client) takes it as ``sys.executable``: what the command starts as ``python -m
  MODULE`` or ``python -u -m MODULE`` (trex's fidelity runs, torchrun's ranks) forks from the server too; ``python``
  with any other flag (``-c``, ``-I``: a tool's sandbox) is the real interpreter. A child
  takes the thread count a fresh interpreter would (its ``OMP_NUM_THREADS``, else one per CPU).
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import runpy
import signal
import socket
import struct
import subprocess
import sys
import tempfile

_HEADER = struct.Struct("!I")


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("the other side closed the connection")
        data += chunk
    return data


def _receive(sock: socket.socket) -> bytes:
    return _recv_exact(sock, _HEADER.unpack(_recv_exact(sock, _HEADER.size))[0])


def _send(sock: socket.socket, value) -> None:
    data = json.dumps(value).encode()
    sock.sendall(_HEADER.pack(len(data)) + data)


def client(python: bool = False) -> None:
    """``python``: the client stands for the interpreter (``python -m MODULE``, ``python -u -m MODULE`` as torchrun
    starts a rank, ``python SCRIPT.py``); with any other flag (``-c``, ``-I``: a tool's sandbox) it is the real one."""
    argv = sys.argv[1:]
    if python and argv[:1] == ["-u"]:
        argv, os.environ["PYTHONUNBUFFERED"] = argv[1:], "1"
    if python and argv[:1] and argv[0].startswith("-") and argv[0] != "-m":
        os.execv(sys.executable, [sys.executable, *argv])
    request = json.dumps({"argv": argv, "env": dict(os.environ), "cwd": os.getcwd()}).encode()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(os.environ["TREX_ZYGOTE"])
        socket.send_fds(sock, [_HEADER.pack(len(request))], [0, 1, 2])
        sock.sendall(request)
        try:
            pid = json.loads(_receive(sock))
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # a launcher's stop reaches the command
                signal.signal(sig, lambda signum, _frame: os.kill(pid, signum))
            code, cpu = json.loads(_receive(sock))
        except ConnectionError:  # the child died without answering (a signal)
            code, cpu = 1, 0.0
    if os.environ.get("TREX_ZYGOTE_CPU"):
        with open(os.environ["TREX_ZYGOTE_CPU"], "a") as f:
            f.write(f"{cpu}\n")
    sys.exit(code)


def _child(conn: socket.socket, fds: list[int], request: dict) -> None:
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the command waits for its own children
    _send(conn, os.getpid())  # the client forwards the signals it gets to this process
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    if os.environ.get("PYTHONUNBUFFERED"):
        sys.stdout.reconfigure(line_buffering=True)
    import torch  # imported by the server already

    if os.environ.get("TREX_ZYGOTE_PYTHON"):  # the processes this command starts as `python ...` fork from here too
        sys.executable = os.environ["TREX_ZYGOTE_PYTHON"]
    # the thread count a fresh interpreter takes: its OMP_NUM_THREADS, else one per CPU it may run on
    threads = int(os.environ.get("OMP_NUM_THREADS") or 0) or len(os.sched_getaffinity(0))
    if threads != torch.get_num_threads():
        torch.set_num_threads(threads)
    # what a fresh interpreter would put on sys.path from the command's PYTHONPATH (a reward plug-in's module)
    sys.path[:0] = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
    argv = request["argv"]
    try:
        if argv[:1] and argv[0].endswith(".py"):  # a test's worker script, run as `python SCRIPT ARGS` would
            sys.argv = list(argv)
            sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
            runpy.run_path(argv[0], run_name="__main__")
            code = 0
        elif argv[:1] == ["-m"]:  # a module, as `python -m MODULE ARGS` runs it (torchrun's launcher)
            sys.argv = argv[1:]  # run_module puts the module's file first
            sys.modules.pop(argv[1], None)  # imported here already: run as __main__ without runpy's warning
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
            code = 0
        else:
            sys.argv = ["trex", *argv]
            from trex.cli import main

            code = main(argv)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - as an uncaught exception ends a process: traceback, exit 1
        import traceback

        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime
    _send(conn, [code or 0, cpu])
    os._exit(0)


def serve(path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot  # noqa: F401 - imported once, here
    import torch._dynamo  # noqa: F401
    import torch.distributed.checkpoint  # noqa: F401

    import trex.cli  # noqa: F401
    import trex.fidelity.cli  # noqa: F401
    import trex.train.loop  # noqa: F401

    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children reap themselves
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.bind(path)
        server.listen(8)
        print("ready", flush=True)
        parent = os.getppid()
        server.settimeout(1.0)
        while True:
            try:
                conn, _ = server.accept()
            except TimeoutError:
                if os.getppid() != parent:  # the test process has gone (without stopping this server)
                    return
                continue
            conn.settimeout(None)
            msg, fds, _, _ = socket.recv_fds(conn, _HEADER.size, 3)
            request = json.loads(_recv_exact(conn, _HEADER.unpack(msg)[0]))
            if os.fork() == 0:
                server.close()
                _child(conn, fds, request)
            for fd in fds:
                os.close(fd)
            conn.close()


def write_client(directory: str, python: bool = False) -> str:
    """An executable ``trex`` (``python``: ``python``) in ``directory`` that is this module's client; returns its
    path."""
    path = os.path.join(directory, "python" if python else "trex")
    here = os.path.dirname(os.path.abspath(__file__))
    with open(path, "w") as f:
        f.write(f"#!{sys.executable} -S\nimport sys\nsys.path.insert(0, {here!r})\nimport trex_zygote\n"
                f"trex_zygote.client(python={python})\n")
    os.chmod(path, 0o755)
    return path


@contextlib.contextmanager
def running(env: dict):
    """A server started with ``env`` (the documents' environment: OMP_NUM_THREADS=1 before torch is
    imported); yields its socket's path, and stops it."""
    path = os.path.join(tempfile.mkdtemp(prefix="trex-zygote-"), "socket")
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "serve", path], env=env,
                            stdout=subprocess.PIPE, text=True)
    try:
        if proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the trex zygote did not start (exit {proc.wait()})")
        yield path
    finally:
        proc.kill()
        proc.wait()


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve"]:
        serve(sys.argv[2])
    else:
        client()
