"""Runs DeepSeek's official V3 inference code on CPU and writes its outputs as a test fixture.

The official code is not in this repository and is never committed: put ``inference/model.py`` of
https://github.com/deepseek-ai/DeepSeek-V3 at commit 9b4e9788e4a3a731f7567338ed15d3ec549ce03b (the file's
git blob 886849975d3b146bfb84f8ea5fdff265c210fcec; e.g. ``git show 9b4e978:inference/model.py > DIR/model.py``
in a clone) into a directory, then

    .venv/bin/python tests/official_v3_harness.py --official DIR

rewrites tests/fixtures/v3/official.safetensors: numbers only (the tiny model's weights under the official
names, the input ids, the official logits at every position, the logits of its incremental decode and the
gradients of every parameter) and, in
its metadata, the official ``ModelArgs`` and what the harness measured. tests/test_official_v3.py reads it.
Its ``kernel.py`` (triton, GPU only) is replaced by the torch stand-ins below, written from the kernels'
contracts; they are never reached, as the harness runs ``gemm_impl = "bf16"`` with bf16 or fp32 weights.

What the harness does to the official code, and why (nothing else is changed):
- ``max_seq_len`` (64) > ``original_seq_len`` (16): the official code applies YaRN (the frequency blend and
  the softmax's mscale) only then; trex applies it at every length. The ids (24 positions) run past 16.
- every ``Gate`` gets a ``bias`` (an fp32 parameter, drawn like the rest): the official code creates it only
  when ``dim == 7168``, and without one it scores groups by their best expert rather than their top two.
- the logits of every position: ``Transformer.forward`` is ``inference_mode`` and returns the last
  position only, so the harness runs its own steps (``embed`` -> each ``Block`` with ``start_pos`` 0 and
  the causal mask -> ``norm`` -> ``head``) with autograd on.
- both ``attn_impl`` ("naive": per-head K and V; "absorb": ``wkv_b`` folded into the query and the
  output over the cached latent): the fixture holds both runs' logits; the absorb run (the default) gives
  the gradients; their largest differences go to the metadata.

- the incremental decode runs the official ``Transformer.forward(tokens, start_pos)`` itself, unchanged: a
  prefill of the first ``DECODE_PREFILL`` ids (its last position's logits), then one id per call at
  ``start_pos`` = its position, through the module's own KV cache (absorb: the normed latent and k_pe;
  naive: per-head K and V), past the original length.

Three runs: ``fp32`` absorb (logits, and the gradients of the mean next-token cross-entropy, by autograd
through the official modules), ``fp32`` naive (logits, gradients for the comparison only) and ``bf16``
absorb (the model as served in bf16: the module's own dtypes, the gate bias fp32, its own rounding points;
logits only); then the fp32 incremental decode with each ``attn_impl`` (the absorb one's logits in the
fixture). Weights are drawn bf16-representable, so every run (and trex) holds the same values. The
official code takes one sequence per batch row (no document packing): the ids are a plain batch of two.

The config: 3 layers (one dense, two MoE), a query latent, 8 experts in 4 groups with 2 kept, 2 active
and one shared, sigmoid scores with route scale 2.5, YaRN factor 4 with mscale 0.8 over 16 positions.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import math
import os
import shutil
import sys
import tempfile

import torch
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURE = os.path.join(ROOT, "tests", "fixtures", "v3", "official.safetensors")
REVISION = "9b4e9788e4a3a731f7567338ed15d3ec549ce03b"
MODEL_PY_BLOB = "886849975d3b146bfb84f8ea5fdff265c210fcec"
DECODE_PREFILL = 10  # the decode's prompt: its steps run past original_seq_len (16) to the ids' end (24)
SCALE = 0.5  # matrices N(0, SCALE^2 / fan_in): every part matters, and bf16 stays comparable


# ---- kernel.py stand-ins (never reached with gemm_impl "bf16" and bf16/fp32 weights) ----------------
def act_quant(x: torch.Tensor, block_size: int = 128, scale_fmt: str | None = None):
    """x -> (e4m3 x / s, s) with s = amax / 448 per block of ``block_size`` (ue8m0: rounded up to 2^k)."""
    b = x.float().unflatten(-1, (-1, block_size))
    s = b.abs().amax(-1, keepdim=True).clamp(min=1e-4) / 448.0
    if scale_fmt is not None:
        s = torch.exp2(torch.ceil(torch.log2(s)))
    return (b / s).to(torch.float8_e4m3fn).flatten(-2), s.squeeze(-1)


def weight_dequant(x: torch.Tensor, s: torch.Tensor, block_size: int = 128) -> torch.Tensor:
    """x [M, N] (FP8) times its [ceil(M/b), ceil(N/b)] block scales, in the default dtype."""
    M, N = x.shape
    full = s.repeat_interleave(block_size, 0)[:M].repeat_interleave(block_size, 1)[:, :N]
    return (x.float() * full).to(torch.get_default_dtype())


def fp8_gemm(*args, **kwargs):
    raise NotImplementedError("the harness runs gemm_impl 'bf16' (no FP8 GEMM)")


# ---- loading the official code ---------------------------------------------------------------------
def git_blob(path: str) -> str:
    with open(path, "rb") as f:
        data = f.read()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def load_official(directory: str):
    """The official model module, imported from a temporary package with the stand-ins as its kernel."""
    src = os.path.join(directory, "model.py")
    blob = git_blob(src)
    if blob != MODEL_PY_BLOB:
        print(f"warning: {src} is git blob {blob}, not {MODEL_PY_BLOB} (the fixture's revision)", file=sys.stderr)
    pkg_dir = tempfile.mkdtemp(prefix="official_v3_")
    shutil.copy(src, os.path.join(pkg_dir, "official_v3_model.py"))
    sys.modules["kernel"] = sys.modules[__name__]
    sys.path.insert(0, pkg_dir)
    return importlib.import_module("official_v3_model")


def tiny_args(module, **extra):
    """The fixture's tiny ModelArgs; ``extra`` adds fields (V3.2's indexer: tests/official_v32_harness.py)."""
    return module.ModelArgs(
        **extra, max_batch_size=2, max_seq_len=64, dtype="bf16", vocab_size=64, dim=32, inter_dim=48, moe_inter_dim=16,
        n_layers=3, n_dense_layers=1, n_heads=2, n_routed_experts=8, n_shared_experts=1, n_activated_experts=2,
        n_expert_groups=4, n_limited_groups=2, score_func="sigmoid", route_scale=2.5, q_lora_rank=16,
        kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, original_seq_len=16,
        rope_theta=10000.0, rope_factor=4.0, beta_fast=32, beta_slow=1, mscale=0.8)


def build(module, args, impl: str, bf16: bool) -> nn.Module:
    """The official Transformer (``attn_impl`` = impl) with a gate bias on every MoE layer, in bf16 (the
    module's own dtypes, under default dtype bf16) or fp32; the caller sets the default dtype."""
    module.attn_impl = impl
    model = module.Transformer(args)
    if not bf16:
        model.float()
    for layer in model.layers:
        if isinstance(layer.ffn, module.MoE):
            assert layer.ffn.gate.bias is None  # dim != 7168: the official code made none
            layer.ffn.gate.bias = nn.Parameter(torch.empty(args.n_routed_experts, dtype=torch.float32))
    return model


def random_weights(model: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """bf16-representable values for every parameter: matrices N(0, SCALE^2 / fan_in), norms around 1,
    the routers' bias spread (0.1) like the sigmoid scores it is added to."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, p in model.state_dict().items():
        if name.endswith("gate.bias"):
            value = 0.1 * torch.randn(p.shape, generator=gen)
        elif p.dim() == 1:
            value = 1 + 0.1 * torch.randn(p.shape, generator=gen)
        else:
            value = torch.randn(p.shape, generator=gen) * SCALE * p.shape[-1] ** -0.5
        out[name] = value.bfloat16().float()
    return out


def routing_margin(module, model: nn.Module, ids: torch.Tensor, forward=None) -> float:
    """The smallest gap, over MoE layers and tokens, between the k-th and (k+1)-th biased score after the
    group limit, and between the kept and dropped groups' scores: how far the fixture is from a tie that
    an fp32 rounding could flip. ``forward(model, ids)``: ``forward_all`` by default (V3.2's harness
    passes its own)."""
    gaps = []

    def hook(gate, inputs, output):
        x = inputs[0]
        s = torch.sigmoid(x.float() @ gate.weight.float().t()) + gate.bias
        g = s.view(x.size(0), gate.n_groups, -1).topk(2, dim=-1)[0].sum(-1).sort(-1, descending=True)[0]
        gaps.append((g[:, gate.topk_groups - 1] - g[:, gate.topk_groups]).min())
        mask = torch.ones_like(g, dtype=torch.bool)
        grouped = s.view(x.size(0), gate.n_groups, -1)
        best = grouped.topk(2, dim=-1)[0].sum(-1).topk(gate.topk_groups, dim=-1)[1]
        mask.scatter_(1, best, False)
        top = grouped.masked_fill(mask[..., None], -math.inf).flatten(1).sort(-1, descending=True)[0]
        gaps.append((top[:, gate.topk - 1] - top[:, gate.topk]).min())

    gates = [layer.ffn.gate for layer in model.layers if isinstance(layer.ffn, module.MoE)]
    handles = [gate.register_forward_hook(hook) for gate in gates]
    try:
        with torch.no_grad():
            (forward or forward_all)(model, ids)
    finally:
        for h in handles:
            h.remove()
    return min(g.item() for g in gaps)


def forward_all(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The official steps of ``Transformer.forward`` without its ``inference_mode`` and for every position:
    [B, S, V] logits."""
    S = ids.size(1)
    h = model.embed(ids)
    freqs_cis = model.freqs_cis[:S]
    mask = torch.full((S, S), float("-inf"), device=ids.device).triu_(1)
    for layer in model.layers:
        h = layer(h, 0, freqs_cis, mask)
    return model.head(model.norm(h))


def run(module, args, weights: dict[str, torch.Tensor], ids: torch.Tensor, impl: str, bf16: bool):
    """(logits [B, S, V] fp32, {official name: gradient} or None) of one official run."""
    torch.set_default_dtype(torch.bfloat16 if bf16 else torch.float32)
    try:
        model = build(module, args, impl, bf16)
        state = model.state_dict()
        model.load_state_dict({k: weights[k].to(v.dtype) for k, v in state.items()}, strict=True)
        logits = forward_all(model, ids)
        if bf16:
            return logits.detach().float(), None
        loss = nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
        loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        return logits.detach().float(), grads
    finally:
        torch.set_default_dtype(torch.float32)


def decode(module, args, weights: dict[str, torch.Tensor], ids: torch.Tensor, impl: str) -> torch.Tensor:
    """The official incremental decode in fp32: ``model(ids[:, :P], 0)``, then ``model(ids[:, t:t+1], t)``
    for each later position t -> the logits of positions P - 1 .. S - 1, [B, S - P + 1, V]."""
    torch.set_default_dtype(torch.float32)
    model = build(module, args, impl, bf16=False)
    model.load_state_dict({k: weights[k] for k in model.state_dict()}, strict=True)
    P = DECODE_PREFILL
    steps = [model(ids[:, :P], 0)] + [model(ids[:, t:t + 1], t) for t in range(P, ids.size(1))]
    return torch.stack(steps, dim=1).clone()


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a - ref).abs().max() / ref.abs().max()).item()


def main(argv: list[str] | None = None) -> int:
    from safetensors.torch import save_file

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--official", required=True, help="directory holding the official inference/model.py")
    parser.add_argument("--out", default=FIXTURE)
    opts = parser.parse_args(argv)
    module = load_official(opts.official)
    args = tiny_args(module)
    torch.manual_seed(0)
    weights = random_weights(build(module, args, "absorb", bf16=False), seed=0)
    ids = torch.randint(0, args.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))

    logits, grads = run(module, args, weights, ids, "absorb", bf16=False)
    naive, naive_grads = run(module, args, weights, ids, "naive", bf16=False)
    bf16, _ = run(module, args, weights, ids, "absorb", bf16=True)
    assert set(grads) == set(naive_grads)
    decoded = decode(module, args, weights, ids, "absorb")
    decoded_naive = decode(module, args, weights, ids, "naive")
    torch.set_default_dtype(torch.float32)
    model = build(module, args, "absorb", bf16=False)
    model.load_state_dict(weights)
    margin = routing_margin(module, model, ids)

    tensors = {f"weight.{k}": v.bfloat16() for k, v in weights.items()}  # exact: drawn bf16-representable
    tensors["input_ids"] = ids
    tensors["logits.fp32"] = logits.contiguous()
    tensors["logits.fp32_naive"] = naive.contiguous()
    tensors["logits.bf16"] = bf16.contiguous()
    tensors["logits.decode_fp32"] = decoded.contiguous()
    tensors.update({f"grad.{k}": v.contiguous() for k, v in grads.items()})
    meta = {"args": json.dumps(vars(args)), "revision": REVISION, "model_py_blob": MODEL_PY_BLOB,
            "naive_vs_absorb_logits": f"{_rel(naive, logits):.3e}",
            "naive_vs_absorb_grads": f"{max(_rel(naive_grads[k], grads[k]) for k in grads):.3e}",
            "bf16_vs_fp32_logits": f"{_rel(bf16, logits):.3e}",
            "decode_prefill": str(DECODE_PREFILL),
            "decode_naive_vs_absorb_logits": f"{_rel(decoded_naive, decoded):.3e}",
            "decode_vs_forward_logits": f"{_rel(decoded, logits[:, DECODE_PREFILL - 1:]):.3e}",
            "routing_margin": f"{margin:.3e}"}
    os.makedirs(os.path.dirname(opts.out), exist_ok=True)
    save_file(tensors, opts.out, metadata=meta)
    size = os.path.getsize(opts.out)
    print(f"wrote {opts.out}: {len(tensors)} tensors, {size / 1024:.0f} KiB; {json.dumps(meta, indent=1)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
