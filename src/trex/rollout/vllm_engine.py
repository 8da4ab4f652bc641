"""A vLLM server as the rollout engine (``[sampling] engine = "vllm"``), over its HTTP API.

vLLM runs in an environment and process of its own (its pins conflict with trex's; docs/post_training.md
says how to start it): ``vllm serve CHECKPOINT --enable-return-routed-experts`` (and, for the broadcast
transport, vLLM's ``--weight-transfer-config`` naming its collective backend) with
``VLLM_SERVER_DEV_MODE=1``, which enables the RL routes. The
checkpoint is the trainer's initial model in the official layout (``trex ckpt convert --layout official``).
What this adapter uses, as vLLM 0.32's ``entrypoints/rl/online/api_router.py`` and
``openai/completion`` define them:

- generation: ``POST /v1/completions`` with token-id prompts, ``logprobs: 0`` (the sampled token's
  log-prob; the server's default ``--logprobs-mode raw_logprobs`` is the untempered distribution, as
  trex's), ``return_token_ids``; ``routed_experts`` (base64 ``.npy`` [tokens - 1, layers, k]) when the
  server returns them;
- the parity probe: ``prompt_logprobs: 0`` of the probe rows;
- weight sync, one of two transports (``[sampling] vllm_transport``):

  * ``broadcast``: vLLM's four-phase weight-transfer API (its collective backend).
    ``/init_weight_transfer_engine`` once with a unique id (the trainer is rank 0, the engine's workers
    ranks 1 ...), then per sync ``/start_weight_update``, ``/update_weights`` with the tensors' names,
    dtypes and shapes while rank 0 broadcasts each tensor in that order (the device layer's
    ``engine_broadcast``), ``/finish_weight_update`` with the version; CUDA only;
  * ``disk``: the synced weights written as an official-layout checkpoint under ``vllm_sync_dir`` (a path
    both machines see), then ``/pause``, ``/collective_rpc`` ``reload_weights(weights_path)``,
    ``/update_weight_version``, ``/resume`` (prime-rl's filesystem broadcast).

Verified here only against a fake of this HTTP surface (tests/test_rollout_engine.py), not against a
real vLLM: vLLM cannot generate DeepSeek-V4 on this CPU (its V4 metadata kernels need Triton's CPU
backend). The digest check is the sender's own; the parity gate after each sync is what proves the
engine serves the weights.
"""

from __future__ import annotations

import base64
import io
import json
import os
import urllib.error
import urllib.request

import numpy as np
import torch

from trex import device as device_layer
from trex.rollout.engine import Digest, SyncError, stream_weights
from trex.rollout.sampling import Samples, SamplingParams

TRANSPORTS = ("broadcast", "disk")


class VLLMEngine:
    """A running vLLM server at ``url`` serving the trainer's model."""

    def __init__(self, url: str, transport: str = "disk", sync_dir: str = "", quantize: str | None = None,
                 timeout: float = 600.0, engine_world_size: int = 1):
        if transport not in TRANSPORTS:
            raise ValueError(f"sampling.vllm_transport = {transport!r}; expected one of {', '.join(TRANSPORTS)}")
        if transport == "disk" and not sync_dir:
            raise ValueError('sampling.vllm_transport = "disk" needs sampling.vllm_sync_dir (a directory the '
                             "vLLM server also sees)")
        self.url, self.transport, self.sync_dir = url.rstrip("/"), transport, sync_dir
        self.quantize, self.timeout, self.engine_world_size = quantize, timeout, engine_world_size
        self.version = -1  # the server starts at its checkpoint's weights (vLLM's version "default")
        self._comm = None

    # ---- HTTP ------------------------------------------------------------------------------------------
    def _request(self, method: str, path: str, body: dict | None = None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(f"{self.url}/{path}", data=data, method=method,
                                     headers={"Content-Type": "application/json"} if data else {})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as r:
                return json.loads(r.read() or b"{}")
        except urllib.error.HTTPError as e:
            raise SyncError(f"vLLM {method} /{path}: HTTP {e.code}: {e.read()[:200].decode(errors='replace')}") from None
        except urllib.error.URLError as e:
            raise SyncError(f"vLLM at {self.url} is not reachable ({e.reason}); is it running with "
                            "VLLM_SERVER_DEV_MODE=1?") from None

    def _get(self, path: str) -> dict:
        return self._request("GET", path)

    def _post(self, path: str, body: dict | None = None) -> dict:
        return self._request("POST", path, body)

    # ---- the engine ------------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams, uniforms: torch.Tensor | None,
                 batch_size: int, record_routes: bool = False) -> Samples:
        """Completions from vLLM (its own random draws: ``uniforms`` only seed them)."""
        seed = None if uniforms is None else int(uniforms.flatten()[0].item() * 2**31)
        reply = self._post("v1/completions", {
            "model": self._model(), "prompt": prompts, "max_tokens": params.max_new_tokens,
            "temperature": params.temperature, "top_p": params.top_p, "logprobs": 0, "return_token_ids": True,
            "stop_token_ids": list(params.stop_ids), "seed": seed, "skip_special_tokens": False})
        choices = sorted(reply["choices"], key=lambda c: c["index"])
        if len(choices) != len(prompts):
            raise SyncError(f"vLLM returned {len(choices)} completions for {len(prompts)} prompts")
        routes = [] if record_routes else None
        out = Samples(prompts, [], [], [], routes, self.version)
        for prompt, c in zip(prompts, choices):
            out.completion_ids.append(list(c["token_ids"]))
            out.logprobs.append([float(v) for v in c["logprobs"]["token_logprobs"]])
            out.finished.append(c.get("finish_reason") == "stop")
            if record_routes:
                if c.get("routed_experts") is None:
                    raise SyncError("grpo.routing = \"replay\": vLLM returned no routed_experts (start it with "
                                    "--enable-return-routed-experts)")
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
        reply = self._post("v1/completions", {"model": self._model(), "prompt": rows, "max_tokens": 1,
                                              "temperature": 0.0, "prompt_logprobs": 0})
        out = []
        for row, c in zip(rows, sorted(reply["choices"], key=lambda c: c["index"])):
            entries = c["prompt_logprobs"][1:]  # the first prompt token has none
            out.append([float(e[str(t)]["logprob"]) for t, e in zip(row[1:], entries)])
        return out

    def sync(self, model: torch.nn.Module, version: int) -> None:
        """The trainer's weights to vLLM as ``version`` (every rank of a sharded model iterates; rank 0 sends)."""
        rank0 = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
        if self.transport == "disk":
            self._sync_disk(model, version, rank0)
        else:
            self._sync_broadcast(model, version, rank0)
        self.version = version

    def _sync_disk(self, model: torch.nn.Module, version: int, rank0: bool) -> None:
        from safetensors.torch import save_file

        path = os.path.join(self.sync_dir, f"v{version}")
        tensors, digest = {}, Digest()
        for group in stream_weights(model, self.quantize):
            for name, t in group:
                digest.add(name, t)
                tensors[name] = t.contiguous()
        if not rank0:
            return
        os.makedirs(path, exist_ok=True)
        tmp = os.path.join(path, "model.safetensors.tmp")
        save_file(tensors, tmp, metadata={"format": "pt", "trex_digest": digest.hexdigest()})
        os.replace(tmp, os.path.join(path, "model.safetensors"))
        self._post("pause?mode=wait")
        try:
            self._post("collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": path}})
            self._post("update_weight_version", {"new_version": str(version)})
        finally:
            self._post("resume")

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
        import threading

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
