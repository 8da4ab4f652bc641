"""The rollout engine boundary: what samples the completions RL trains on, and how its weights follow.

An engine ``generate``s completions of prompts (token ids) and returns them with their untempered
log-probs (``Samples``; with ``record_routes``, each fed token's experts in every MoE layer, hash layers
included, for routing replay) at its weight ``version``; ``sync(model, version)`` brings the trainer's
weights to it; ``score(rows)`` gives its log-probs of given tokens, the parity probe's measure.

- :class:`InProcessEngine`: trex's sampler on the live training model (the reference and the CPU
  default): nothing to transfer, its version is the trainer's.
- :class:`ServerEngine`: the same sampler in a process of its own (``trex.rollout.server``), on devices
  of its own, reached over loopback: the stand-in for an inference engine, which tests the
  out-of-process path (transfer, versions, digests, the parity gate). If its process dies (the
  out-of-memory killer, a crash), the request that meets the closed connection raises
  :class:`EngineDied`: the engine, its pid, how the process ended and what it was doing, in one line.

A sync streams the model's tensors under their official checkpoint names (``gate.bias``, ``tid2eid``,
the fp32 mHC and sink tensors included, routed experts one per expert), optionally re-quantised to the
served FP8/FP4 by the export's codec, one parameter gathered from its FSDP2/EP shards at a time, in
buckets of ``bucket_bytes``. Both sides fold every tensor (name,
dtype, shape, bytes) into a sha256 digest, and the engine lists the tensors of its model that the sync
did not bring: a mismatch or a gap is a :class:`SyncError`. A bucket travels as a safetensors file in
shared memory where the machine has ``/dev/shm`` (the engine maps it), else over the connection. The digest proves what was sent arrived,
not that the engine serves it; :func:`parity_gate` (a probe batch scored by both sides) does that.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from multiprocessing.connection import Connection, Listener

import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors
from safetensors.torch import save_file

from trex.checkpoint.layouts import TrexTensor, plan_outputs
from trex.checkpoint.naming import checkpoint_names
from trex.models import evaluating
from trex.rollout.sampling import Samples, SamplingParams, left_pad, sample, whole_rows


class SyncError(ValueError):
    """A weight sync or the parity probe after it failed: one line naming the version and the measure."""


class EngineDied(RuntimeError):
    """The rollout engine's process ended while the trainer needed it (killed by the out-of-memory killer,
    crashed): one line naming the engine, how its process ended, what it was doing and, once the training
    loop sets ``step``, the step."""

    def __init__(self, kind: str, pid: int, how: str, doing: str, step: int | None = None):
        super().__init__(kind, pid, how, doing)
        self.kind, self.pid, self.how, self.doing, self.step = kind, pid, how, doing, step

    def __str__(self) -> str:
        at = f" at step {self.step}" if self.step else ""
        return f"rollout engine ({self.kind}, pid {self.pid}) died: {self.how} during {self.doing}{at}"


def exit_status(code: int) -> str:
    """How a process ended, from its return code (negative: the signal that killed it)."""
    if code >= 0:
        return f"exited with code {code}"
    try:
        return f"killed by signal {-code} ({signal.Signals(-code).name})"
    except ValueError:
        return f"killed by signal {-code}"


_DOING = {"hello": "start-up", "generate": "sampling", "begin": "a weight sync", "bucket": "a weight sync",
          "finish": "a weight sync", "score": "the parity probe", "close": "shut-down"}


class Digest:
    """sha256 over (name, dtype, shape, bytes) of each tensor, in the order given."""

    def __init__(self):
        self._h = hashlib.sha256()
        self.tensors = 0
        self.bytes = 0

    def add(self, name: str, t: torch.Tensor) -> None:
        data = t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""
        self._h.update(json.dumps([name, str(t.dtype), list(t.shape)]).encode())
        self._h.update(data)
        self.tensors += 1
        self.bytes += len(data)

    def hexdigest(self) -> str:
        return self._h.hexdigest()


def stream_weights(model: torch.nn.Module, quantize: str | None = None) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Every parameter and persistent buffer of ``model`` as its released checkpoint layout writes it
    (:func:`engine_layout`; the export's codec, ``trex.checkpoint.layouts.plan_outputs``): groups of (name, CPU
    tensor), a
    weight with its scale when ``quantize`` ("fp8", "fp8+fp4experts") quantises it, routed experts one per
    expert. Each tensor is gathered from its shards when its turn comes, one at a time
    (``DTensor.full_tensor``: every rank of the model must iterate alongside). Unquantised tensors keep the
    model's dtype (bf16 beside quantised ones, as exported)."""
    from torch.distributed.tensor import DTensor

    state = model.state_dict()
    last: dict[str, torch.Tensor] = {}

    def full(key: str) -> torch.Tensor:  # the tensor being sent, gathered once for all its experts
        if key not in last:
            last.clear()
            t = state[key]
            last[key] = (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu()
        return last[key]

    tensors = [TrexTensor(k, tuple(t.shape), t.dtype, lambda e, k=k: full(k) if e is None else full(k)[e])
               for k, t in state.items()]
    dtype = torch.bfloat16 if quantize else next(t for t in state.values() if t.is_floating_point()).dtype
    arch = model.cfg.architecture
    for group in plan_outputs(tensors, engine_layout(arch), dtype, quantize, arch,
                              n_layers=model.cfg.num_hidden_layers):
        yield [(p.name, p.produce()) for p in group]


def engine_layout(architecture: str) -> str:
    """The checkpoint layout an inference engine reads for ``architecture``: the released names, which are
    DeepSeek's own ("official") for V4 and V4.1 and the Hugging Face ones ("hf") for the V3 family
    (``CheckpointNames.released_layout``)."""
    return checkpoint_names(architecture).released_layout


@torch.no_grad()
def score_rows(model: torch.nn.Module, rows: list[list[int]]) -> list[list[float]]:
    """Per row (token ids), log p(row[t + 1] | row[..t]) under the untempered model, fp32: the parity probe."""
    device = model.embed.weight.device
    ids, docs = left_pad(rows, 0, device)
    with evaluating(model), whole_rows(model):
        logits = model(ids, doc_ids=docs).logits.float()
    logp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    width = ids.shape[1]
    return [logp[i, width - len(r):].tolist() for i, r in enumerate(rows)]


class InProcessEngine:
    """trex's sampler on the training model itself."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.version = 0

    def generate(self, prompts: list[list[int]], params: SamplingParams, uniforms: torch.Tensor | None,
                 batch_size: int, record_routes: bool = False) -> Samples:
        out = sample(self.model, prompts, params, 0, batch_size=batch_size, uniforms=uniforms,
                     record_routes=record_routes)
        out.version = self.version
        return out

    def sync(self, model: torch.nn.Module, version: int) -> None:
        self.version = version  # the sampler reads the live weights

    def score(self, rows: list[list[int]]) -> list[list[float]]:
        return score_rows(self.model, rows)

    def close(self) -> None:
        pass


class ServerEngine:
    """trex's sampler in a child process (``python -m trex.rollout.server``) on ``device``, holding a model of
    ``config`` (a ``to_hf_dict``) in ``dtype``; messages are JSON, tensors safetensors bytes, over a loopback
    connection authenticated with a random key. Its weights come only through :meth:`sync`. Thread-safe: each
    call holds the engine's lock, so a sync from the trainer's thread lands between two ``generate`` calls of
    a rollout in another (asynchronous multi-turn rollouts: the rounds after it sample under the new weights)."""

    def __init__(self, config: dict, dtype: str = "float32", device: str = "cpu", bucket_bytes: int = 64 << 20,
                 engram_token_map: tuple[list[int], int] | None = None, env: dict | None = None,
                 quantize: str | None = None):
        self.bucket_bytes, self.quantize = bucket_bytes, quantize
        self.version = -1  # no weights yet
        self._lock = threading.RLock()
        self._pending: tuple | None = None  # a submitted generation not yet collected
        self._shm = tempfile.mkdtemp(prefix="trex-engine-", dir="/dev/shm") if os.path.isdir("/dev/shm") else None
        key = secrets.token_bytes(32)
        self._listener = Listener(("127.0.0.1", 0), authkey=key)
        host, port = self._listener.address
        child_env = {**os.environ, **(env or {}), "TREX_ENGINE_ADDRESS": f"{host}:{port}",
                     "TREX_ENGINE_KEY": key.hex()}
        self._proc = subprocess.Popen([sys.executable, "-m", "trex.rollout.server"], env=child_env)
        self._conn: Connection = self._listener.accept()
        self._ask({"op": "hello", "config": config, "dtype": dtype, "device": device,
                   "engram_token_map": engram_token_map})

    # ---- the wire ------------------------------------------------------------------------------------
    def _send(self, header: dict, tensors: dict[str, torch.Tensor] | None = None) -> None:
        e8m0 = [] if tensors is None else [n for n, t in tensors.items() if t.dtype == torch.float8_e8m0fnu]
        if tensors is not None:
            header = {**header, "e8m0": e8m0}
        try:
            self._conn.send_bytes(json.dumps({**header, "payload": tensors is not None}).encode())
            if tensors is not None:  # ue8m0 scales travel as their bytes (safetensors' loader has no such dtype)
                self._conn.send_bytes(save_tensors({n: t.view(torch.uint8) if n in e8m0 else t
                                                    for n, t in tensors.items()}))
        except OSError as e:  # a broken pipe or reset connection: the process is gone
            raise self._died(header["op"], e) from None

    def _ask(self, header: dict, tensors: dict[str, torch.Tensor] | None = None) -> dict:
        """Send a request and wait for its reply."""
        if self._pending is not None:
            raise RuntimeError(f"rollout engine: {header['op']} while a generation is in flight (collect it first)")
        self._send(header, tensors)
        return self._receive(header["op"])

    def _receive(self, op: str) -> dict:
        """The next reply (JSON), with its tensors under "arrays" when it has some."""
        try:
            reply = json.loads(self._conn.recv_bytes())
            if reply.get("payload"):
                reply["arrays"] = load_tensors(self._conn.recv_bytes())
        except (EOFError, OSError) as e:  # the connection closed under the reply: the process is gone
            raise self._died(op, e) from None
        if "error" in reply:
            raise SyncError(f"rollout engine ({op}): {reply['error']}")
        return reply

    def _died(self, op: str, error: BaseException) -> EngineDied:
        """The error for a connection that broke during ``op``: how the process ended (a process still
        running behind a broken connection is stopped)."""
        try:
            how = exit_status(self._proc.wait(timeout=10))
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
            how = f"its connection broke ({type(error).__name__}) while the process still ran (stopped)"
        return EngineDied("server", self._proc.pid, how, _DOING.get(op, op))

    # ---- the engine ----------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams, uniforms: torch.Tensor | None,
                 batch_size: int, record_routes: bool = False) -> Samples:
        with self._lock:
            self.submit(prompts, params, uniforms, batch_size, record_routes)
            return self.collect()

    def submit(self, prompts: list[list[int]], params: SamplingParams, uniforms: torch.Tensor | None,
               batch_size: int, record_routes: bool = False) -> None:
        """Start generating (the engine process works while the trainer goes on); :meth:`collect` takes the
        result. The next request waits for it: a sync after a submit reaches the engine once it is done."""
        if self._pending is not None:
            raise RuntimeError("rollout engine: a generation is already in flight")
        self._send({"op": "generate", "prompts": prompts, "batch_size": batch_size, "record_routes": record_routes,
                    "params": {"temperature": params.temperature, "top_p": params.top_p,
                               "max_new_tokens": params.max_new_tokens, "stop_ids": list(params.stop_ids)}},
                   None if uniforms is None else {"uniforms": uniforms.detach().cpu().contiguous()})
        self._pending = (prompts, record_routes, self.version)

    def collect(self) -> Samples:
        """The completions of the generation in flight, sampled with the weights of ``Samples.version``."""
        prompts, record_routes, version = self._pending
        self._pending = None
        reply = self._receive("generate")
        if reply["version"] != version:
            raise SyncError(f"rollout engine sampled with weights v{reply['version']}, expected v{version}")
        routes = None
        if record_routes:  # each layer's rows, concatenated, split back by their lengths
            sizes = [len(p) + len(c) - 1 for p, c in zip(prompts, reply["completion_ids"])]
            split = {k: v.split(sizes) for k, v in reply["arrays"].items()}
            routes = [{k: parts[i] for k, parts in split.items()} for i in range(len(prompts))]
        return Samples(prompts, reply["completion_ids"], reply["logprobs"], reply["finished"], routes, version)

    def sync(self, model: torch.nn.Module, version: int) -> None:
        """Stream ``model``'s weights as version ``version``; SyncError if the engine's digest differs from
        what was sent or its model lacks a tensor the sync should have brought."""
        with self._lock:
            self._sync(model, version)

    def _sync(self, model: torch.nn.Module, version: int) -> None:
        self._ask({"op": "begin", "version": version})
        digest = Digest()
        bucket, size = {}, 0
        for group in self.weights(model):  # a weight and its scale travel in one bucket
            for name, t in group:
                digest.add(name, t)
                bucket[name] = t.contiguous()
                size += t.numel() * t.element_size()
            if size >= self.bucket_bytes:
                self._send_bucket(bucket)
                bucket, size = {}, 0
        if bucket:
            self._send_bucket(bucket)
        reply = self._ask({"op": "finish", "version": version})
        if reply["missing"]:
            raise SyncError(f"weight sync v{version}: the rollout engine's model got no {len(reply['missing'])} "
                            f"tensor(s): {', '.join(reply['missing'][:3])}")
        if reply["digest"] != digest.hexdigest() or reply["tensors"] != digest.tensors:
            raise SyncError(f"weight sync v{version}: the engine received {reply['tensors']} tensors with digest "
                            f"{reply['digest'][:12]}, the trainer sent {digest.tensors} with {digest.hexdigest()[:12]}")
        self.version = version

    def _send_bucket(self, bucket: dict[str, torch.Tensor]) -> None:
        """One bucket: as a safetensors file in shared memory (``/dev/shm``; the engine maps it and removes
        it) where the machine has one, else over the connection."""
        names = list(bucket)
        if self._shm is None:
            self._ask({"op": "bucket", "names": names}, bucket)
            return
        e8m0 = [n for n, t in bucket.items() if t.dtype == torch.float8_e8m0fnu]  # stored as their bytes
        path = os.path.join(self._shm, "bucket.safetensors")
        save_file({n: t.view(torch.uint8) if n in e8m0 else t for n, t in bucket.items()}, path)
        self._ask({"op": "bucket", "names": names, "file": path, "e8m0": e8m0})

    def weights(self, model: torch.nn.Module) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """What a sync sends (:func:`stream_weights`)."""
        return stream_weights(model, self.quantize)

    def score(self, rows: list[list[int]]) -> list[list[float]]:
        with self._lock:
            return self._ask({"op": "score", "rows": rows})["logprobs"]

    def close(self) -> None:
        if self._proc.poll() is None:
            try:
                self._send({"op": "close"})
            except EngineDied:
                pass
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
        self._conn.close()
        self._listener.close()
        if self._shm is not None:
            shutil.rmtree(self._shm, ignore_errors=True)


def parity_probe(engine, model: torch.nn.Module, rows: list[list[int]]) -> torch.Tensor:
    """Score ``rows`` with the engine and the trainer's ``model`` -> fp64 [3], each larger when worse (so that
    a MAX over ranks is the worst rank): the mean k3 KL between them over the probe's tokens, the largest
    |delta log p|, and 1 - the Pearson correlation of the two sides' token probabilities (0 when they agree
    exactly; 1 when either side's do not vary and they differ). Every rank of a sharded model must call it."""
    ours = score_rows(model, rows)
    theirs = engine.score(rows)
    a = torch.tensor([v for row in ours for v in row], dtype=torch.float64)
    b = torch.tensor([v for row in theirs for v in row], dtype=torch.float64)
    d = a - b
    pa, pb = a.exp() - a.exp().mean(), b.exp() - b.exp().mean()
    norm = (pa.square().sum() * pb.square().sum()).sqrt()
    pearson = (pa * pb).sum() / norm if norm > 0 else torch.tensor(1.0 if torch.equal(a, b) else 0.0,
                                                                    dtype=torch.float64)
    # k3: KL(engine || trainer), >= 0
    return torch.stack([(torch.expm1(d) - d).mean(), d.abs().max(), (1 - pearson).clamp(min=0)])


def check_parity(measures: list[float], bound: float, step: int, version: int) -> dict[str, float]:
    """The gate on :func:`parity_probe`'s measures (k3, max |delta log p|, 1 - pearson): SyncError naming the
    step, the weight version and the measures when k3 exceeds ``bound``; else the measures as metrics."""
    k3, worst, gap = measures
    if not k3 <= bound:
        raise SyncError(f"step {step}: rollout engine log-prob parity after weight sync v{version}: k3 {k3:.3g} > "
                        f"bound {bound:g} (max |delta log p| {worst:.3g}, pearson {1 - gap:.6g}): the engine does "
                        "not serve the trainer's weights")
    return {"engine/parity_k3": k3, "engine/parity_max_abs": worst, "engine/parity_pearson": 1 - gap}
