"""The rollout engine process of :class:`trex.rollout.engine.ServerEngine` (``python -m trex.rollout.server``).

Connects back to the trainer at ``TREX_ENGINE_ADDRESS`` with the key ``TREX_ENGINE_KEY``, builds the model
the hello message describes (weights uninitialised until the first sync) and answers, in order:

- ``generate``: prompts, sampling params, optional uniforms -> completions, untempered log-probs, version;
- ``begin`` / ``bucket`` / ``finish``: a weight sync; tensors arrive under their released names, are mapped to
  the model's (``trex.checkpoint.naming``) and copied in; ``finish`` returns the digest of what arrived
  and the model tensors no bucket filled;
- ``score``: the log-probs of given rows (the parity probe);
- ``close``.

A request that fails is answered with its error (one line) and the process keeps serving.
"""

from __future__ import annotations

import json
import os
import sys
from multiprocessing.connection import Client

import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import load_file
from safetensors.torch import save as save_tensors

from trex.checkpoint.naming import scale_name, to_trex
from trex.kernels import quantize
from trex.models import build_model
from trex.models.registry import config_from_dict
from trex.rollout.engine import Digest, engine_layout, score_rows
from trex.rollout.sampling import SamplingParams, sample


class Server:
    def __init__(self, hello: dict):
        cfg = config_from_dict(hello["config"], source="the trainer's model config")
        self.device = torch.device(hello["device"])
        self.model = build_model(cfg, device=self.device, dtype=getattr(torch, hello["dtype"])).eval()
        if hello.get("engram_token_map"):
            self.model.set_engram_token_map(*hello["engram_token_map"])
        self.state = self.model.state_dict()
        arch = cfg.architecture  # the names a sync sends: the released layout (trex.rollout.engine.engine_layout)
        self.naming = {"layout": engine_layout(arch), "arch": arch, "n_layers": cfg.num_hidden_layers}
        self.version = -1
        self._pending: tuple[int, Digest, set[str]] | None = None

    def generate(self, msg: dict, tensors: dict) -> dict:
        params = SamplingParams(**{**msg["params"], "stop_ids": tuple(msg["params"]["stop_ids"])})
        out = sample(self.model, msg["prompts"], params, 0, batch_size=msg["batch_size"],
                     uniforms=tensors.get("uniforms"), record_routes=msg.get("record_routes", False))
        reply = {"completion_ids": out.completion_ids, "logprobs": out.logprobs, "finished": out.finished,
                 "version": self.version}
        if out.routes is not None:  # per MoE layer, every prompt's rows one after another
            reply["arrays"] = {k: torch.cat([r[k] for r in out.routes]).contiguous() for k in out.routes[0]}
        return reply

    def begin(self, msg: dict, tensors: dict) -> dict:
        self._pending = (msg["version"], Digest(), set())
        return {}

    @torch.no_grad()
    def bucket(self, msg: dict, tensors: dict) -> dict:
        if self._pending is None:
            raise ValueError("a bucket outside a sync (no begin)")
        _, digest, filled = self._pending
        if sorted(msg["names"]) != sorted(tensors):
            raise ValueError("a bucket whose tensors are not the ones its header names")
        for name in msg["names"]:  # the sender's order (safetensors stores its own)
            t = tensors[name]
            digest.add(name, t)
            if name.endswith(".scale"):
                continue  # taken with its weight
            for key, expert, part in to_trex(name, self._dequantized(name, t, tensors), **self.naming):
                if key not in self.state:
                    raise ValueError(f"{name}: the engine's model has no {key}")
                target = self.state[key] if expert is None else self.state[key][expert]
                target.copy_(part)
                filled.add(key if expert is None else f"{key}[{expert}]")
        return {}

    def _dequantized(self, name: str, t: torch.Tensor, bucket: dict) -> torch.Tensor:
        """A re-quantised weight (FP8, or FP4 packed in int8) back to fp32 with its scale from the same bucket."""
        if t.dtype not in (torch.float8_e4m3fn, torch.int8):
            return t
        scale = bucket.get(scale_name(name, "official"))
        if scale is None:
            raise ValueError(f"{name}: a {t.dtype} weight without its scale in the same bucket")
        if t.dtype == torch.float8_e4m3fn:
            return quantize.dequantize_fp8(t, scale, torch.float32)
        return quantize.dequantize_fp4(t, scale, cols=2 * t.shape[-1], dtype=torch.float32)

    def finish(self, msg: dict, tensors: dict) -> dict:
        if self._pending is None or self._pending[0] != msg["version"]:
            raise ValueError(f"finish of a sync v{msg['version']} that did not begin")
        version, digest, filled = self._pending
        self._pending = None
        missing = []
        for key, t in self.state.items():
            if key.endswith((".experts.w1", ".experts.w2", ".experts.w3")):
                missing += [f"{key}[{j}]" for j in range(t.shape[0]) if f"{key}[{j}]" not in filled]
            elif key not in filled:
                missing.append(key)
        if not missing:
            self.version = version
        return {"digest": digest.hexdigest(), "tensors": digest.tensors, "missing": missing}

    def score(self, msg: dict, tensors: dict) -> dict:
        return {"logprobs": score_rows(self.model, msg["rows"])}


OPS = ("generate", "begin", "bucket", "finish", "score")


def main() -> int:
    host, port = os.environ["TREX_ENGINE_ADDRESS"].rsplit(":", 1)
    conn = Client((host, int(port)), authkey=bytes.fromhex(os.environ["TREX_ENGINE_KEY"]))
    server = None
    while True:
        try:
            msg = json.loads(conn.recv_bytes())
            tensors = load_tensors(conn.recv_bytes()) if msg.get("payload") else {}
            if msg.get("file"):  # a bucket in shared memory: mapped, copied in, removed
                tensors = load_file(msg["file"])
                os.remove(msg["file"])
            for name in msg.get("e8m0", ()):  # ue8m0 scales arrive as their bytes
                tensors[name] = tensors[name].view(torch.float8_e8m0fnu)
        except EOFError:
            return 0
        op = msg["op"]
        if op == "close":
            return 0
        try:
            if op == "hello":
                server = Server(msg)
                reply = {"tensors": len(server.state)}
            elif op in OPS and server is not None:
                reply = getattr(server, op)(msg, tensors)
            else:
                reply = {"error": f"unknown request {op!r}" if op not in OPS else "no hello yet"}
        except Exception as e:  # answered to the trainer, which stops with it; this process keeps serving
            reply = {"error": f"{type(e).__name__}: {e}"}
        payload = reply.pop("arrays", None)
        conn.send_bytes(json.dumps({**reply, "payload": payload is not None}).encode())
        if payload is not None:
            conn.send_bytes(save_tensors(payload))


if __name__ == "__main__":
    sys.exit(main())
