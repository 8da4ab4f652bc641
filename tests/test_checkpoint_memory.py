"""Peak host memory of loading and converting stays near one tensor (+ the model), not the checkpoint.

Runs in a fresh process so the peak (VmHWM) belongs to the load alone.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

MB = 2**20

SCRIPT = textwrap.dedent(
    """
    import json, sys, torch
    from trex import device
    from trex.checkpoint import load_pretrained, save_pretrained
    from trex.checkpoint.save import convert
    from trex.models import build_model
    from trex.models.deepseek_v4.config import tiny

    tmp = sys.argv[1]
    # 8 layers + MTP of 32 experts x 3 x 512 x 512: ~900 MB in fp32, the largest tensor 32 MB.
    cfg = tiny(hidden_size=512, moe_intermediate_size=512, n_routed_experts=32, vocab_size=4096,
               num_hidden_layers=8, layer_types=tiny().layer_types * 2, mlp_layer_types=tiny().mlp_layer_types * 2)
    model = build_model(cfg, device="meta")
    shapes = {k: v.shape for k, v in model.named_parameters()}
    model = None
    src = build_model(cfg, seed=0, dtype=torch.bfloat16)
    save_pretrained(src, f"{tmp}/fp32", layout="official", dtype="fp32", max_shard_size="50MB")
    del src
    cpu = device.Device("cpu")
    out = {"largest": max(v.numel() for v in shapes.values()) * 4,
           "model_bf16": sum(v.numel() for v in shapes.values()) * 2}

    cpu.reset_peak_memory(); base = cpu.memory_allocated()
    convert(f"{tmp}/fp32", f"{tmp}/hf", layout="hf", dtype="bf16", max_shard_size="50MB")
    out["convert"] = cpu.max_memory_allocated() - base

    cpu.reset_peak_memory(); base = cpu.memory_allocated()
    m = load_pretrained(f"{tmp}/fp32", dtype=torch.bfloat16, device="cpu")
    out["load"] = cpu.max_memory_allocated() - base
    import os
    out["checkpoint"] = sum(os.path.getsize(f"{tmp}/fp32/{f}") for f in os.listdir(f"{tmp}/fp32"))
    print(json.dumps(out))
    """
)


# DeepSeek-V3 as released: fp32 -> FP8 with fp32 block scales, per-expert tensors, the MTP layer with its copies of
# the embedding and head (compared with the main ones in pieces); 6 layers + MTP of 32 experts x 3 x 512 x 512
SCRIPT_V3 = textwrap.dedent(
    """
    import json, os, sys, torch
    from trex import device
    from trex.checkpoint import save_pretrained
    from trex.checkpoint.save import convert
    from trex.models import build_model
    from trex.models.deepseek_v3.config import tiny_v3

    tmp = sys.argv[1]
    cfg = tiny_v3(hidden_size=512, moe_intermediate_size=512, intermediate_size=1024, n_routed_experts=32,
                  vocab_size=4096, num_hidden_layers=6, q_lora_rank=256, kv_lora_rank=256)
    shapes = [v.shape for v in build_model(cfg, device="meta").parameters()]
    save_pretrained(build_model(cfg, seed=0, dtype=torch.bfloat16), f"{tmp}/fp32", dtype="fp32", max_shard_size="50MB")
    cpu = device.Device("cpu")
    cpu.reset_peak_memory(); base = cpu.memory_allocated()
    convert(f"{tmp}/fp32", f"{tmp}/fp8", quantize="fp8", max_shard_size="50MB")
    print(json.dumps({"convert": cpu.max_memory_allocated() - base, "largest": max(s.numel() for s in shapes) * 4,
                      "checkpoint": sum(os.path.getsize(f"{tmp}/fp32/{f}") for f in os.listdir(f"{tmp}/fp32"))}))
    """
)


def _measure(script: str, tmp_path) -> dict:
    run = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    m = json.loads(run.stdout.strip().splitlines()[-1])
    print({k: f"{v / MB:.1f} MB" for k, v in m.items()})
    return m


@pytest.mark.slow
def test_peak_memory_is_bounded_by_one_tensor_plus_model(tmp_path):
    m = _measure(SCRIPT, tmp_path)
    # convert holds no model: w1 and w3 read in fp32, the fused gate_up being assembled (2x),
    # its bf16 copy, and allocator slack. The checkpoint is several times that bound.
    convert_bound = 5 * m["largest"] + 16 * MB
    assert m["checkpoint"] > 4 * convert_bound
    assert m["convert"] < convert_bound, m
    # load: the bf16 model being filled plus one fp32 tensor read and slack.
    assert m["load"] < m["model_bf16"] + 3 * m["largest"] + 16 * MB, m


@pytest.mark.slow
def test_v3_fp8_convert_is_bounded_by_one_tensor(tmp_path):
    """Converting DeepSeek-V3 to its released FP8 holds one source tensor (an expert slice, the embedding) and
    its quantised copy at a time, never a shard or the checkpoint."""
    m = _measure(SCRIPT_V3, tmp_path)
    bound = 2 * m["largest"] + 16 * MB  # the largest stacked expert tensor's size, twice: far above one slice
    assert m["checkpoint"] > 6 * bound and m["convert"] < bound, m
