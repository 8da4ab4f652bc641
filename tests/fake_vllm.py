"""A fake of the vLLM HTTP surface trex.rollout.vllm_engine speaks (vLLM 0.32's OpenAI completions and RL
routes, and trex's worker extension's ``trex_reload`` / ``trex_model_config``), for the adapter's protocol
tests: a trex model answers completions (one prompt or several per request) and prompt log-probs, and
``trex_reload`` loads the synced safetensors and reports as the extension does. It is not vLLM: it checks
the requests' shapes and order as vLLM's handlers would, records them, and generates with trex's sampler
(one request at a time). ``fault`` makes it fail every request from then on as a server whose engine is gone
does: ``"500"`` answers vLLM's HTTP 500 of a dead engine core, ``"drop"`` closes the connection unanswered.
The real server is tested by ``make test-engine`` (tests/engine/)."""

from __future__ import annotations

import base64
import hashlib
import io
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import torch
from safetensors.torch import load_file

from trex.checkpoint.naming import to_trex
from trex.rollout.engine import score_rows
from trex.rollout.sampling import SamplingParams, sample


class FakeVLLM:
    def __init__(self, model: torch.nn.Module, return_routed_experts: bool = True, extension: bool = True):
        self.model, self.routed, self.extension = model, return_routed_experts, extension
        self.calls: list[tuple[str, dict]] = []
        self.paused, self.version = False, "default"
        self.fault: str | None = None
        self.lock = threading.Lock()  # the model answers one request at a time
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _reply(self, code: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _failed(self) -> bool:
                """Fail the request as ``fake.fault`` says (True), or not (False)."""
                if fake.fault == "500":  # vLLM 0.32's answer once its engine core process has died
                    self._reply(500, {"error": {"message": "EngineCore encountered an issue. See stack trace (above) "
                                                           "for the root cause.", "type": "InternalServerError",
                                                "param": None, "code": 500}})
                elif fake.fault == "drop":
                    self.close_connection = True
                return fake.fault is not None

            def do_GET(self):
                if self._failed():
                    return
                if self.path == "/v1/models":
                    return self._reply(200, {"data": [{"id": "trex-policy"}]})
                if self.path == "/weight_info":
                    return self._reply(200, {"weight_version": fake.version})
                self._reply(404, {"error": self.path})

            def do_POST(self):
                n = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(n) or b"{}")
                path = self.path.lstrip("/")
                if self._failed():
                    return
                fake.calls.append((path, body))
                try:
                    with fake.lock:
                        reply = fake.handle(path.split("?")[0], body)
                    self._reply(200, reply)
                except ValueError as e:
                    self._reply(422, {"detail": str(e)})

        class Server(ThreadingHTTPServer):
            request_queue_size = 128  # the adapter sends one request per row at once (uvicorn's backlog: 2048)

        self.server = Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def handle(self, path: str, body: dict) -> dict:
        if path == "v1/completions" and body["prompt"] and isinstance(body["prompt"][0], int):
            body = {**body, "prompt": [body["prompt"]]}  # one prompt: vLLM takes a list of ids as one
        if path == "v1/completions":
            if body.get("prompt_logprobs") is not None:
                return {"choices": [{"index": i, "prompt_logprobs": [None] + [{str(t): {"logprob": lp}} for t, lp in
                                                                               zip(row[1:], logps)]}
                                    for i, (row, logps) in enumerate(zip(body["prompt"], score_rows(self.model,
                                                                                                     body["prompt"])))]}
            if body.get("logprobs") != 0 or not body.get("return_token_ids"):
                raise ValueError("trex asks for logprobs=0 and return_token_ids")
            params = SamplingParams(body["temperature"], body["top_p"], body["max_tokens"],
                                    tuple(body["stop_token_ids"]))
            gen = torch.Generator().manual_seed(body["seed"] or 0)
            out = sample(self.model, body["prompt"], params, 0, generator=gen, record_routes=self.routed)
            choices = []
            for i, (c, lp, fin) in enumerate(zip(out.completion_ids, out.logprobs, out.finished)):
                choice = {"index": i, "token_ids": c, "finish_reason": "stop" if fin else "length",
                          "logprobs": {"token_logprobs": lp}}
                if self.routed:  # [tokens - 1, layers, k] uint8, as vLLM's capturer
                    r = out.routes[i]
                    arr = np.stack([r[f"layers.{j}"].numpy() for j in range(len(r))], axis=1).astype(np.uint8)
                    buf = io.BytesIO()
                    np.save(buf, arr)
                    choice["routed_experts"] = base64.b64encode(buf.getvalue()).decode()
                choices.append(choice)
            return {"choices": choices}
        if path == "pause":
            self.paused = True
            return {"status": "paused"}
        if path == "resume":
            self.paused = False
            return {"status": "resumed"}
        if path == "collective_rpc":
            if not self.extension:  # vLLM's answer to a method no worker has
                raise ValueError(f"'Worker' object has no attribute '{body.get('method')}'")
            if body.get("method") == "trex_model_config":
                return {"results": [json.dumps(self.model.cfg.to_hf_dict())]}
            if body.get("method") != "trex_reload" or not self.paused:
                raise ValueError("trex_reload only while paused")
            state, filled, digest = self.model.state_dict(), set(), hashlib.sha256()
            tensors = load_file(f"{body['kwargs']['weights_path']}/model.safetensors")
            with torch.no_grad():
                for name in sorted(tensors):
                    t = tensors[name]
                    digest.update(json.dumps([name, str(t.dtype), list(t.shape)]).encode())
                    digest.update(t.contiguous().view(torch.uint8).numpy().tobytes())
                    for key, expert, part in to_trex(name, t, layout="official"):
                        (state[key] if expert is None else state[key][expert]).copy_(part)
                        filled.add(key)
            return {"results": [{"tensors": len(tensors), "digest": digest.hexdigest(), "missing": [],
                                 "not_loaded": sorted(set(state) - filled), "repacked_moe_layers": 0}]}
        if path == "update_weight_version":
            self.version = body["new_version"]
            return {"success": True, "new_version": self.version}
        raise ValueError(f"not faked: {path}")

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
