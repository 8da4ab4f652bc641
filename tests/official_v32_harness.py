"""Runs DeepSeek's official V3.2-Exp inference code on CPU and writes its outputs as a test fixture.

The official code is not in this repository and is never committed: put ``inference/model.py`` of
https://github.com/deepseek-ai/DeepSeek-V3.2-Exp at commit 3b99a5350d260b7c2a357e82362305509e2d0724 (the
file's git blob is checked below; e.g. ``git show 3b99a53:inference/model.py > DIR/model.py`` in a clone)
into a directory, then

    .venv/bin/python tests/official_v32_harness.py --official DIR

rewrites tests/fixtures/v32/official.safetensors: numbers only (the tiny model's weights under the official
names, the input ids, the official fp32 logits at every position, those of its incremental decode and the
gradients of every parameter)
and, in its metadata, the official ``ModelArgs`` and what the harness measured. tests/test_official_v32.py
reads it. Its ``kernel.py`` (tilelang, GPU only) is replaced by torch stand-ins written from the kernels'
contracts (``act_quant``, ``fp8_gemm`` never reached with bf16/fp32 weights, ``fp8_index``).

What the harness does to the official code, and why (nothing else is changed):
- **the indexer's RoPE fix**: that commit still rotates the indexer's rope dims as interleaved pairs;
  DeepSeek fixed it later (their commit 8631a81, "rope in indexer is not interleaved", which the mirror
  this project reads lacks): ``apply_rotary_emb(x, freqs_cis, interleaved=True)`` gains the half-split
  form and the indexer's two calls pass ``False``. The harness applies exactly that change to the text
  (``ROPE_FIX``); transformers' DeepseekV32Indexer and trex follow the fixed convention.
- ``rotate_activation`` asserts bf16 input: the assert is dropped so the fp32 run can run it; the
  Hadamard transform comes from a stand-in ``fast_hadamard_transform`` (the Sylvester matrix times
  ``scale``), and ``einops.rearrange`` (not installed) from a stand-in for the one pattern the file uses.
- the fp32 run scores the indexer without FP8: ``act_quant`` returns its input with unit scales (as
  trex and transformers score, in fp32); the indexer's FP8 key cache is fp32 (``model.float()``).
  ``dist.broadcast`` (the picks' consistency check) runs on a one-process gloo group.
- ``max_seq_len`` (64) > ``original_seq_len`` (16), a ``bias`` on every ``Gate``, and the logits of every
  position by running the official ``Block``s directly: as tests/official_v3_harness.py (which this
  reuses), with V3.2's fused-residual blocks.

Two runs, fp32: the forward over every position (logits, and the gradients of the mean next-token
cross-entropy by autograd through the official modules; the indexer's picks take no gradient there
either), and the official incremental decode (``Transformer.forward(tokens, start_pos)`` unchanged: a
prefill of 10 ids, then one id a call to 24, past the original length), whose every step's indexer
scores the cached keys and keeps its top 8. The config: 3 layers (one dense,
two MoE), a query latent, 8 experts in 4 groups with 2 kept, YaRN factor 4 with mscale 0.8 over 16
positions, and the indexer (16 heads of 128) keeping 8 of up to 24 keys. The metadata records the smallest
gap between a query's 8th and 9th index score, in the forward and in the decode (far from ties: fp32
roundings cannot flip a pick).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import tempfile
import types

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import official_v3_harness as v3  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURE = os.path.join(ROOT, "tests", "fixtures", "v32", "official.safetensors")
REVISION = "3b99a5350d260b7c2a357e82362305509e2d0724"
MODEL_PY_BLOB = "9d672e5ad28c59d14456ecd4670d0b97f321c3d0"

# DeepSeek's fix of the indexer's RoPE (text replaced -> text put instead)
ROPE_FIX = [
    ('''def apply_rotary_emb(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:''',
     '''def apply_rotary_emb(x: torch.Tensor, freqs_cis: torch.Tensor, interleaved: bool = True) -> torch.Tensor:'''),
    ('''    dtype = x.dtype
    x = torch.view_as_complex(x.float().view(*x.shape[:-1], -1, 2))
    freqs_cis = freqs_cis.view(1, x.size(1), 1, x.size(-1))
    y = torch.view_as_real(x * freqs_cis).flatten(3)
    return y.to(dtype)''',
     '''    dtype = x.dtype
    shape = x.shape
    if not interleaved:
        x = x.view(*shape[:-1], 2, -1).transpose(-1, -2).contiguous()
    x = torch.view_as_complex(x.float().view(*shape[:-1], -1, 2))
    freqs_cis = freqs_cis.view(1, x.size(1), 1, x.size(-1))
    y = torch.view_as_real(x * freqs_cis).flatten(3)
    if not interleaved:
        y = torch.cat([y[..., 0::2], y[..., 1::2]], dim=-1)
    return y.to(dtype)'''),
    ("q_pe = apply_rotary_emb(q_pe, freqs_cis)\n        q = torch.cat([q_pe, q_nope], dim=-1)",
     "q_pe = apply_rotary_emb(q_pe, freqs_cis, False)\n        q = torch.cat([q_pe, q_nope], dim=-1)"),
    ("k_pe = apply_rotary_emb(k_pe.unsqueeze(2), freqs_cis).squeeze(2)",
     "k_pe = apply_rotary_emb(k_pe.unsqueeze(2), freqs_cis, False).squeeze(2)"),
]
FP32_ASSERT = ("    assert x.dtype == torch.bfloat16\n    from fast_hadamard_transform", "    from fast_hadamard_transform")

INDEX_SCORES: list[torch.Tensor] = []  # what fp8_index returned, in call order (the margin check)


# ---- kernel.py stand-ins ---------------------------------------------------------------------------
def act_quant(x: torch.Tensor, block_size: int = 128, scale_fmt: str | None = None):
    """The fp32 run scores without FP8: x itself and a unit scale per block of ``block_size``."""
    return x, x.new_ones(*x.shape[:-1], x.shape[-1] // block_size, dtype=torch.float32)


def fp8_index(q: torch.Tensor, q_s: torch.Tensor, k: torch.Tensor, k_s: torch.Tensor) -> torch.Tensor:
    """kernel.py's contract: q [B, M, H, D], q_s [B, M, H(, 1)] (the head weights), k [B, N, D], k_s [B, N(, 1)]
    -> sum_h relu(q[b, m, h] . k[b, n]) * q_s[b, m, h] * k_s[b, n], [B, M, N] fp32."""
    logits = torch.einsum("bmhd,bnd->bmhn", q.float(), k.float()).relu()
    score = torch.einsum("bmhn,bmh->bmn", logits, q_s.float().reshape(q.shape[:3])) * k_s.float().reshape(k.shape[:2])[:, None]
    INDEX_SCORES.append(score.detach().clone())
    return score


fp8_gemm = v3.fp8_gemm


def hadamard_transform(x: torch.Tensor, scale: float) -> torch.Tensor:
    """fast_hadamard_transform's contract: x times the (Sylvester) Hadamard matrix of its last dim, times scale."""
    n = x.shape[-1]
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return (x.float() @ h.to(x.device)).mul(scale).to(x.dtype)


def rearrange(x: torch.Tensor, pattern: str, **sizes) -> torch.Tensor:
    """einops.rearrange for the one pattern the file uses."""
    assert pattern == "b s (h d) -> b s h d", pattern
    return x.unflatten(-1, (-1, sizes["d"]))


# ---- loading the official code ---------------------------------------------------------------------
def load_official(directory: str):
    """The official model module (its git blob checked) with the RoPE fix and the fp32 assert dropped, imported from a temporary
    package with the stand-ins as its kernel, Hadamard transform and einops."""
    src = os.path.join(directory, "model.py")
    blob = v3.git_blob(src)
    if blob != MODEL_PY_BLOB:
        print(f"warning: {src} is git blob {blob}, not {MODEL_PY_BLOB} (the fixture's revision)", file=sys.stderr)
    text = open(src, encoding="utf-8").read()
    for old, new in [*ROPE_FIX, FP32_ASSERT]:
        assert text.count(old) == 1, f"the official file changed: {old[:60]!r}"
        text = text.replace(old, new)
    pkg_dir = tempfile.mkdtemp(prefix="official_v32_")
    with open(os.path.join(pkg_dir, "official_v32_model.py"), "w", encoding="utf-8") as f:
        f.write(text)
    sys.modules["kernel"] = sys.modules[__name__]
    sys.modules["fast_hadamard_transform"] = types.SimpleNamespace(hadamard_transform=hadamard_transform)
    sys.modules["einops"] = types.SimpleNamespace(rearrange=rearrange)
    sys.path.insert(0, pkg_dir)
    return importlib.import_module("official_v32_model")


def tiny_args(module):
    """V3's fixture args (official_v3_harness.tiny_args) plus the indexer: 16 heads of 128, top 8."""
    return v3.tiny_args(module, index_n_heads=16, index_head_dim=128, index_topk=8)


def build(module, args) -> nn.Module:
    model = module.Transformer(args).float()  # fp32, the indexer's FP8 key cache included
    for layer in model.layers:
        if isinstance(layer.ffn, module.MoE):
            assert layer.ffn.gate.bias is None  # dim != 7168: the official code made none
            layer.ffn.gate.bias = nn.Parameter(torch.empty(args.n_routed_experts, dtype=torch.float32))
    return model


def forward_all(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The official steps of ``Transformer.forward`` without ``inference_mode``, for every position."""
    S = ids.size(1)
    freqs_cis = model.freqs_cis[:S]
    mask = torch.full((S, S), float("-inf"), device=ids.device).triu_(1)
    h, residual = model.embed(ids), None
    for layer in model.layers:
        h, residual = layer(h, residual, 0, freqs_cis, mask)
    h, _ = model.norm(h, residual)
    return model.head(h.float())


def pick_margin(k: int) -> float:
    """The smallest gap between a query's k-th and (k+1)-th index score over every indexer call since the
    last ``INDEX_SCORES.clear()``, among the queries that see more than k keys (a prefill's [B, S, S]
    scores are causal; a decode step's [B, 1, N] see every slot)."""
    gaps = []
    for score in INDEX_SCORES:
        M, N = score.shape[-2:]
        seen = torch.ones(M, N, dtype=torch.bool).tril(N - M)
        if not bool((seen.sum(-1) > k).any()):
            continue
        top = score.masked_fill(~seen, float("-inf")).topk(k + 1, dim=-1).values
        gaps.append((top[..., k - 1] - top[..., k])[:, seen.sum(-1) > k].min())
    return min(g.item() for g in gaps)


def decode(module, args, weights: dict[str, torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
    """The official incremental decode in fp32, ``Transformer.forward`` unchanged: ``model(ids[:, :P], 0)``,
    then ``model(ids[:, t:t+1], t)`` for each later position t -> the logits of positions P - 1 .. S - 1,
    [B, S - P + 1, V]. Each step's indexer scores every cached key and keeps its top min(k, t + 1)."""
    model = build(module, args)
    model.load_state_dict(weights, strict=True)
    P = v3.DECODE_PREFILL
    steps = [model(ids[:, :P], 0)] + [model(ids[:, t:t + 1], t) for t in range(P, ids.size(1))]
    return torch.stack(steps, dim=1).clone()


def main(argv: list[str] | None = None) -> int:
    from safetensors.torch import save_file

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--official", required=True, help="directory holding the official inference/model.py")
    parser.add_argument("--out", default=FIXTURE)
    opts = parser.parse_args(argv)
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29533", rank=0, world_size=1)
    module = load_official(opts.official)
    args = tiny_args(module)
    torch.set_default_dtype(torch.float32)
    torch.manual_seed(0)
    model = build(module, args)
    weights = v3.random_weights(model, seed=0)
    ids = torch.randint(0, args.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    model.load_state_dict(weights, strict=True)
    logits = forward_all(model, ids)
    loss = nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    margin = pick_margin(args.index_topk)
    INDEX_SCORES.clear()
    decoded = decode(module, args, weights, ids)
    decode_margin = pick_margin(args.index_topk)
    INDEX_SCORES.clear()
    with torch.no_grad():
        gate_margin = v3.routing_margin(module, model, ids, forward=forward_all)
    tensors = {f"weight.{k}": v.bfloat16() for k, v in weights.items()}  # exact: drawn bf16-representable
    tensors["input_ids"] = ids
    tensors["logits.fp32"] = logits.detach().contiguous()
    tensors["logits.decode_fp32"] = decoded.contiguous()
    tensors.update({f"grad.{k}": v.contiguous() for k, v in grads.items()})
    meta = {"args": json.dumps(vars(args)), "revision": REVISION, "model_py_blob": MODEL_PY_BLOB,
            "rope_fix": "indexer RoPE half-split (DeepSeek's 8631a81), applied to the text by the harness",
            "index_pick_margin": f"{margin:.3e}", "routing_margin": f"{gate_margin:.3e}",
            "decode_prefill": str(v3.DECODE_PREFILL), "decode_index_pick_margin": f"{decode_margin:.3e}",
            "decode_vs_forward_logits": f"{v3._rel(decoded, logits.detach()[:, v3.DECODE_PREFILL - 1:]):.3e}"}
    os.makedirs(os.path.dirname(opts.out), exist_ok=True)
    save_file(tensors, opts.out, metadata=meta)
    size = os.path.getsize(opts.out)
    print(f"wrote {opts.out}: {len(tensors)} tensors, {size / 1024:.0f} KiB; {json.dumps(meta, indent=1)}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
