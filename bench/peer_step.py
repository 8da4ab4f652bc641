"""A peer beside trex: one training step (forward + backward + AdamW) of trex's DeepSeek-V3 and torchtitan
0.3.0's own DeepSeek-V3 (torchtitan.models.deepseek_v3: its MLA, its MoE with grouped GEMMs) on the same
shape, the same weights, the same tokens and the same device, in one run.

torchtitan's model is configured from trex's V3Config (``titan_config``) and given trex's weights by a name
map (``titan_name``: every parameter and the router bias, both ways). Before any timing, both models, in fp32
on the bench's device and shape, must give the same loss on the same tokens, and again after one AdamW step
(so the gradients agree too), within ``LOSS_RTOL`` (``check``; it exits the bench non-zero otherwise). Then each (model, S) runs in a subprocess of
its own so that its peak memory is its own: the fastest of ``--steps`` steps after one warm-up step, and the
memory the step adds (trex.device: resident-set growth on the CPU, the allocator's on an accelerator).

    make setup-bench                                           # torchtitan 0.3.0, pinned (bench/requirements.txt)
    .venv/bin/python bench/peer_step.py --write                # CPU fp32, narrow V3, S = 512 ... 4096
    .venv/bin/python bench/peer_step.py --device TYPE --out peer.json  # an accelerator (trex.device): bf16,
                                                                 # a V3-shaped 4-layer stack, S = 4096
    .venv/bin/python bench/peer_step.py --report peer.json --write  # its table into docs/benchmarks.md
    .venv/bin/python bench/peer_step.py --seqs 128 --steps 2   # printed only

What differs, and how it is matched (``titan_config``): torchtitan's RMSNorms default to eps 1e-5; they are
given trex's (the config's ``rms_norm_eps`` for the blocks, 1e-6 for MLA's latent norms, as DeepSeek's code).
torchtitan's grouped experts cast their inputs and weights to bf16 whatever the model's dtype (its
``GroupedExperts.forward``): timed as shipped; the loss check runs them without the casts (``unrounded_experts``)
and the shipped loss beside, within ``SHIPPED_RTOL``. Its
language-model attention is FlexAttention, compiled, which has no backward on the CPU; there it takes its
own ``ScaledDotProductAttention`` (``is_causal``, one document per row: the same mask), elsewhere FlexAttention
(``--titan-attention``). torchtitan 0.3.0 imports Triton at module level for its multi-rank expert-parallel
kernels; a torch without Triton (the CPU build) gets a stand-in for that one module (``import_torchtitan``),
which a one-device model never calls.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import platform
import re
import subprocess
import sys
import time
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
from model_step import BENCH_V3_CONFIG, CONFIG_LINES, write_docs_section  # noqa: E402

TITAN_VERSION = "0.3.0"
CHECK_MAX_SEQ = 512  # the check holds an fp32 model, its gradients and AdamW state: 62 GiB at the v3 shape
LOSS_RTOL = 1e-5  # fp32, the same tokens, torchtitan's experts unrounded: the summation orders alone
SHIPPED_RTOL = 1e-3  # torchtitan as shipped: its expert GEMMs on bf16 casts
IMPLS = ("trex", "torchtitan")
V3_SHAPE_LINE = ("Config: DeepSeek-V3's widths (hidden 7168, 128 heads of 128 + 64 rope, value 128, q/kv latents 1536/512, "
                 "dense width 18432, expert width 2048, vocab 129,280), 4 layers (1 dense, 3 MoE), 8 experts top-6 + 1 "
                 "shared, no group limit, YaRN 40x.")
_EP_KERNELS = "torchtitan.distributed.minimal_async_ep.kernels"


def shape_config(shape: str):
    """``narrow``: bench/model_step.py's V3 config (hidden 128, 4 layers: 1 dense + 3 MoE, MLA with q/kv latents
    of 64, 8 experts in 4 groups, top-2 + 1 shared). ``v3``: DeepSeek-V3's widths (hidden 7168, 128 heads, q/kv
    latents 1536/512, expert width 2048, dense width 18432, vocabulary 129,280) with 4 layers (1 dense + 3 MoE)
    and 8 experts top-6 without group limits, so that one device holds it with AdamW state in bf16."""
    from trex.models.deepseek_v3.config import V3Config

    if shape == "narrow":
        return V3Config.from_dict(BENCH_V3_CONFIG)
    return V3Config(num_hidden_layers=4, first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=6,
                    n_group=1, topk_group=1, num_nextn_predict_layers=0)


def import_torchtitan():
    """torchtitan.models.deepseek_v3, importable under a torch without Triton: torchtitan 0.3.0's model imports
    its expert-parallel token dispatchers, whose kernels module imports ``triton`` at the top (GPU-only
    multi-rank kernels). Without Triton that one module is replaced by a stand-in whose every function raises
    if called; a one-device model never calls them. With Triton, nothing is replaced."""
    if importlib.util.find_spec("triton") is None and _EP_KERNELS not in sys.modules:
        stub = types.ModuleType(_EP_KERNELS)

        def missing(name: str):
            if name.startswith("__"):
                raise AttributeError(name)

            def unavailable(*args, **kwargs):
                raise RuntimeError(f"{_EP_KERNELS}.{name} needs Triton (expert parallelism on a GPU)")
            return unavailable

        stub.__getattr__ = missing
        sys.modules[_EP_KERNELS] = stub
    import torchtitan.models.deepseek_v3 as titan

    return titan


def titan_config(cfg, attention: str):
    """torchtitan's DeepSeekV3Model.Config for trex's V3Config (no MTP), with trex's norm epsilons and
    ``attention`` ("flex": its FlexAttention; "sdpa": its ScaledDotProductAttention, causal)."""
    from trex.models.deepseek_v3.attention import LATENT_NORM_EPS

    titan = import_torchtitan()
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention

    if cfg.num_nextn_predict_layers or cfg.q_lora_rank == 0 or cfg.sparse:
        raise ValueError("the peer bench builds V3 with a query latent, dense attention and no MTP")
    yarn = cfg.rope_scaling
    rope = ComplexRoPE.Config(dim=cfg.qk_rope_head_dim, max_seq_len=cfg.max_position_embeddings, theta=cfg.rope_theta,
                              **({} if yarn is None else dict(
                                  scaling="yarn", rope_factor=yarn.factor, beta_fast=yarn.beta_fast,
                                  beta_slow=yarn.beta_slow, original_seq_len=yarn.original_max_position_embeddings)))
    if yarn is not None and yarn.mscale != yarn.mscale_all_dim:
        raise ValueError("torchtitan scales the softmax by m(mscale)^2 and never cos/sin: mscale must equal mscale_all_dim")
    grouped = cfg.n_group > 1
    layers = titan._build_dsv3_layers(
        n_layers=cfg.num_hidden_layers, n_dense_layers=cfg.first_k_dense_replace, dim=cfg.hidden_size,
        n_heads=cfg.num_attention_heads, q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank,
        qk_nope_head_dim=cfg.qk_nope_head_dim, qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim,
        mscale=yarn.mscale_all_dim if yarn is not None else 1.0, dense_hidden_dim=cfg.intermediate_size,
        moe_hidden_dim=cfg.moe_intermediate_size, num_experts=cfg.n_routed_experts,
        num_shared_experts=cfg.n_shared_experts, router_top_k=cfg.num_experts_per_tok, router_score_func="sigmoid",
        router_num_expert_groups=cfg.n_group if grouped else None,
        router_num_limited_groups=cfg.topk_group if grouped else None, router_route_scale=cfg.routed_scaling_factor,
        router_route_norm=cfg.norm_topk_prob, attn_backend="flex", moe_comm_backend="standard",
        non_blocking_capacity_factor=None, rope=rope)
    for layer in layers:
        layer.attention_norm.eps = layer.ffn_norm.eps = cfg.rms_norm_eps
        layer.attention.q_norm.eps = layer.attention.kv_norm.eps = LATENT_NORM_EPS
        if attention == "sdpa":  # FlexAttention has no CPU backward
            layer.attention.inner_attention = ScaledDotProductAttention.Config()
    d, vocab = cfg.hidden_size, cfg.vocab_size
    return titan.DeepSeekV3Model.Config(
        vocab_size=vocab, dim=d, tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=d),
        norm=RMSNorm.Config(normalized_shape=d, eps=cfg.rms_norm_eps), lm_head=Linear.Config(in_features=d, out_features=vocab),
        layers=layers, mtp_layers=[])


_RENAMES = [  # trex's parameter and buffer names (DeepSeek's) -> torchtitan's, applied in order
    (r"^embed\.", "tok_embeddings."), (r"^head\.", "lm_head."),
    (r"\.attn_norm\.", ".attention_norm."), (r"\.attn\.", ".attention."),
    (r"\.ffn\.gate\.bias$", ".moe.expert_bias_E"), (r"\.ffn\.gate\.", ".moe.router.gate."),
    (r"\.ffn\.experts\.w1$", ".moe.routed_experts.inner_experts.w1_EFD"),
    (r"\.ffn\.experts\.w2$", ".moe.routed_experts.inner_experts.w2_EDF"),
    (r"\.ffn\.experts\.w3$", ".moe.routed_experts.inner_experts.w3_EFD"),
    (r"\.ffn\.shared_experts\.", ".moe.shared_experts."), (r"\.ffn\.(w[123])\.", r".feed_forward.\1."),
]


def titan_name(name: str) -> str:
    """trex's state-dict name -> torchtitan's (``layers.3.ffn.experts.w1`` -> ``layers.3.moe.routed_experts.
    inner_experts.w1_EFD``; both store experts as [E, out, in] and linears as [out, in])."""
    for pattern, repl in _RENAMES:
        name = re.sub(pattern, repl, name)
    return name


def titan_from_trex(model, cfg, attention: str):
    """torchtitan's model for ``cfg`` on ``model``'s device and dtype, holding ``model``'s weights (strict: every
    tensor of each side is the other's)."""
    import torch

    param = next(model.parameters())
    with torch.device(param.device):
        titan = titan_config(cfg, attention).build()
    cast_parameters(titan, param.dtype)
    titan.load_state_dict({titan_name(k): v for k, v in model.state_dict().items()}, strict=True)
    return titan


def tokens(cfg, seq: int, device):
    """The bench's tokens: [1, seq + 1] from a fixed seed (inputs are the first seq, targets the last seq)."""
    import torch

    return torch.randint(0, cfg.vocab_size, (1, seq + 1), generator=torch.Generator().manual_seed(0)).to(device)


def trex_loss(model, toks):
    """trex's training loss as its SFT objective computes it: the LM head fused with the loss, the mean NLL."""
    out = model(toks[:, :-1], targets=[toks[:, 1:]], return_logits=False)
    return out.token_nll[0].sum() / toks[:, 1:].numel()


def titan_loss(model, toks, attention: str):
    """torchtitan's training loss as its trainer computes it: the attention masks of the batch (FlexAttention's
    block mask; none for its causal SDPA), logits, its cross_entropy_loss (a sum), over the number of targets."""
    import torch
    from torchtitan.components.loss import cross_entropy_loss

    inputs, labels = toks[:, :-1], toks[:, 1:]
    positions = torch.arange(inputs.shape[1], device=inputs.device)[None]
    masks = model.get_attention_masks(positions) if attention == "flex" else None
    return cross_entropy_loss(model(inputs, attention_masks=masks), labels) / labels.numel()


def cast_parameters(model, dtype) -> None:
    """The parameters to ``dtype``, the buffers as they are (``Module.to(dtype)`` would also cast torchtitan's
    complex RoPE table to a real dtype, dropping its imaginary part, and both routers' fp32 bias)."""
    import torch

    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.to(dtype)


def build(impl: str, cfg, dev, dtype, attention: str):
    """trex's model (seed 0, fp32, its parameters then cast to ``dtype``), or torchtitan's holding the same
    weights."""
    from trex.models import build_model

    import torch

    model = build_model(cfg, device=dev.torch_device, dtype=torch.float32, seed=0)
    if impl == "torchtitan":
        model = titan_from_trex(model, cfg, attention)
    cast_parameters(model, dtype)
    return model.train()


def loss_fn(impl: str, attention: str):
    return trex_loss if impl == "trex" else lambda model, toks: titan_loss(model, toks, attention)


def _experts_unrounded(self, x, counts):
    """torchtitan's GroupedExperts.forward without its bf16 casts: each expert's SwiGLU on its rows (x sorted by
    expert, ``counts`` rows each), in x's dtype, one expert at a time."""
    import torch
    import torch.nn.functional as F

    out, start = [], 0
    for e, n in enumerate(counts.tolist()):
        rows = x[start:start + n]
        start += n
        out.append(F.linear(F.silu(F.linear(rows, self.w1_EFD[e])) * F.linear(rows, self.w3_EFD[e]), self.w2_EDF[e]))
    return torch.cat(out)


@contextlib.contextmanager
def unrounded_experts(model):
    """Within: ``model``'s torchtitan grouped experts compute in the model's dtype (``_experts_unrounded``)."""
    from torchtitan.models.common.moe import GroupedExperts

    experts = [m for m in model.modules() if isinstance(m, GroupedExperts)]
    for m in experts:
        m.forward = types.MethodType(_experts_unrounded, m)
    try:
        yield
    finally:
        for m in experts:
            del m.forward


def check(cfg, seq: int, device: str, attention: str) -> dict:
    """Both models in fp32 on ``device``, one after the other, the same weights and tokens: the loss, then the
    loss after one AdamW step of each (lr 1e-3: about lr x the gradient's sign on every weight, so a gradient
    that differs shows), within ``LOSS_RTOL``; torchtitan's experts without their bf16 casts
    (``unrounded_experts``: the check compares the architectures and the weights, not that precision choice).
    Also torchtitan's loss as shipped (``rel_shipped``), within ``SHIPPED_RTOL``. Raises AssertionError past
    either."""
    import torch
    from trex import device as device_layer

    dev = device_layer.detect(device)
    toks = tokens(cfg, seq, dev.torch_device)
    out = {"seq": seq, "attention": attention}
    for impl in IMPLS:
        model = build(impl, cfg, dev, torch.float32, attention)
        compute_loss = loss_fn(impl, attention)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)  # no [all parameters] temporaries
        with torch.no_grad():
            out[f"{impl}_shipped"] = compute_loss(model, toks).item()
        with unrounded_experts(model) if impl == "torchtitan" else contextlib.nullcontext():
            loss = compute_loss(model, toks)
            loss.backward()
            opt.step()
            with torch.no_grad():
                after = compute_loss(model, toks)
        out[impl] = [loss.item(), after.item()]
        del model, opt, loss
    for i, what in enumerate(("loss", "loss after one AdamW step")):
        a, b = out["trex"][i], out["torchtitan"][i]
        out[f"rel_{i}"] = abs(a - b) / abs(a)
        assert out[f"rel_{i}"] <= LOSS_RTOL, f"{what}: trex {a:.7f}, torchtitan {b:.7f} (relative {out[f'rel_{i}']:.1e})"
    out["rel_shipped"] = abs(out["torchtitan_shipped"] - out["trex"][0]) / abs(out["trex"][0])
    assert out["rel_shipped"] <= SHIPPED_RTOL, (f"torchtitan as shipped: loss {out['torchtitan_shipped']:.7f}, trex "
                                                f"{out['trex'][0]:.7f} (relative {out['rel_shipped']:.1e})")
    return out


def run_one(impl: str, seq: int, shape: str, device: str, dtype_name: str, steps: int, attention: str) -> dict:
    """Runs in a subprocess: build, warm up, time ``steps`` training steps (forward, backward, AdamW), and
    report the fastest step and the memory a step adds over the model and its optimizer state."""
    import torch
    from trex import device as device_layer
    from trex.models.flops import flops_per_token

    dev = device_layer.detect(device)
    dev.set_current()
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    cfg = shape_config(shape)
    model = build(impl, cfg, dev, dtype, attention)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    toks = tokens(cfg, seq, dev.torch_device)
    compute_loss = loss_fn(impl, attention)

    def step() -> float:
        loss = compute_loss(model, toks)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()  # the one host read: waits for the device

    t0 = time.perf_counter()
    step()  # warm-up: allocates the optimizer state; compiles torchtitan's FlexAttention where it runs
    warm_s = time.perf_counter() - t0
    dev.synchronize()
    dev.reset_peak_memory()
    base = dev.memory_allocated()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    best = min(times)
    return {"impl": impl, "seq": seq, "step_s": best, "tokens_per_s": seq / best,
            "model_tflops_per_s": seq / best * flops_per_token(cfg, seq, with_mtp=False).total / 1e12,
            "peak_step_bytes": dev.max_memory_allocated() - base, "held_bytes": base, "warmup_s": warm_s}


def _child(args: list[str], device: str) -> dict:
    """Run this script with ``--child ARGS`` in a fresh process; its last stdout line (JSON), or the error."""
    proc = subprocess.run([sys.executable, __file__, "--device", device, "--child", *args], capture_output=True,
                          text=True)
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines()
        return {"error": lines[-1] if lines else f"exit {proc.returncode}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def check_line(checked: dict | None, attention: str) -> str:
    """The loss check's sentence under the table (``check``'s dict, or its error)."""
    if not checked or "rel_shipped" not in checked:
        return f"The loss check did not pass: {(checked or {}).get('error', 'not run')}; nothing was timed."
    other = "" if checked.get("attention", attention) == attention else f", torchtitan's attention {checked['attention']}"
    return (f"Same loss before timing (fp32, S = {checked['seq']}, torchtitan's experts without their bf16 casts{other}): "
            f"trex {checked['trex'][0]:.6f}, torchtitan {checked['torchtitan'][0]:.6f} (relative {checked['rel_0']:.1e}); "
            f"after one AdamW step, relative {checked['rel_1']:.1e}; torchtitan as shipped (bf16 expert GEMMs) "
            f"{checked['torchtitan_shipped']:.6f} (relative {checked['rel_shipped']:.1e}).")


def table(results: dict, checked: dict | None, seqs: list[int], meta: dict) -> str:
    def mib(r: dict, key: str) -> str:
        return f"{r[key] / 2**20:.0f}" if key in r else "-"

    acc = meta["accelerator"]
    lines = [
        f"Device: {meta['device_name']}; torch {meta['torch']}, torchtitan {meta['torchtitan']}, {meta['threads']} "
        f"threads; {meta['dtype']} (parameters, gradients and AdamW state), batch 1, AdamW step included; time = the "
        f"fastest of {meta['steps']} steps after one warm-up step; step memory = what a step adds over the model and "
        f"its optimizer state ({'the allocator' if acc else 'resident-set growth'}). torchtitan's attention: "
        f"{'FlexAttention (compiled)' if meta['attention'] == 'flex' else 'its causal ScaledDotProductAttention'}.",
        CONFIG_LINES["v3"] if meta["shape"] == "narrow" else V3_SHAPE_LINE,
        check_line(checked, meta["attention"]),
        "",
        "| S | trex tok/s | torchtitan tok/s | trex / torchtitan speed | trex step MiB | torchtitan step MiB "
        "| torchtitan / trex memory | trex warm-up s | torchtitan warm-up s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for s in seqs:
        t, p = results.get(("trex", s), {}), results.get(("torchtitan", s), {})
        both = "tokens_per_s" in t and "tokens_per_s" in p
        speed = f"{t['tokens_per_s'] / p['tokens_per_s']:.2f}x" if both else "-"
        mem = f"{p['peak_step_bytes'] / max(t['peak_step_bytes'], 1):.2f}x" if both else "-"
        tok = [f"{r['tokens_per_s']:.0f}" if "tokens_per_s" in r else r.get("error", "-") for r in (t, p)]
        warm = [f"{r['warmup_s']:.1f}" if "warmup_s" in r else "-" for r in (t, p)]
        lines.append(f"| {s} | {tok[0]} | {tok[1]} | {speed} | {mib(t, 'peak_step_bytes')} | "
                     f"{mib(p, 'peak_step_bytes')} | {mem} | {warm[0]} | {warm[1]} |")
    return "\n".join(lines)


WHERE_TIME_GOES = {  # measured on the CPU: torch.profiler over one step of each at S = 4096, the narrow shape
    "cpu": (
        "Where each side spends its time (torch.profiler over one step of each at S = 4096, the same config "
        "and machine): the attention core is over half of both steps, by different kernels. MLA's values (64 "
        "wide here, 128 at V3's size) are narrower than its query/key heads (96; 192). trex's `dense_attention` "
        "op pads the values to the query width on the CPU (trex.kernels.dense_attention `sdpa_padded_values`) so "
        "that PyTorch's fused CPU flash kernel takes it: 53% of trex's step (forward 12%, backward 41%), no "
        "[H, S, S] scores kept. torchtitan's language-model attention is FlexAttention, which has no backward "
        "on the CPU; the bench gives it torchtitan's own causal `ScaledDotProductAttention`, where unequal head "
        "widths send PyTorch's SDPA down the math path: batched GEMMs over materialised [H, S, S] scores, a "
        "masked softmax and their backward, about 60% of its step. The math path is what costs the memory (the "
        "step memory ratio grows with S); it costs less time than memory, because the fused kernel's backward "
        "is itself slow on two cores (41% of trex's step). The rest: the projections are plain GEMMs on both; "
        "the same AdamW (single-tensor on the CPU) is 5-7% of a step; the expert GEMMs are 15% of trex's step "
        "(its grouped SwiGLU, fp32) and 8% of torchtitan's (`torch._grouped_mm` on bf16 casts of inputs and "
        "weights, which torchtitan makes even in an fp32 run): a lead for trex's experts on the CPU; trex fuses "
        "the LM head with the loss a chunk of rows at a time, torchtitan makes the [S, vocab] logits and an "
        "fp32 copy (small at vocabulary 1024)."),
    "accelerator": (
        "Where each side spends its time: torchtitan runs its language-model attention, FlexAttention, "
        "compiled (a generated kernel over the causal block mask; Inductor's autotuning is in its warm-up), "
        "trex PyTorch's fused scaled-dot-product attention with the document mask (trex.kernels.dense_attention "
        "`sdpa`); torchtitan's experts are `torch._grouped_mm` on bf16, trex's its grouped SwiGLU; trex fuses "
        "the LM head with the loss, torchtitan makes the [S, vocab] logits and an fp32 copy. Neither side is "
        "compiled beyond that: both eager."),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu (default) or an accelerator type (trex.device)")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), help="default: fp32 on the CPU, bf16 on an accelerator")
    parser.add_argument("--shape", choices=("narrow", "v3"), help="default: narrow on the CPU, v3 on an accelerator")
    parser.add_argument("--seqs", type=int, nargs="+", help="default: 512 1024 2048 4096 on the CPU, 4096 elsewhere")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per measurement (default: %(default)s)")
    parser.add_argument("--titan-attention", choices=("flex", "sdpa"),
                        help="torchtitan's inner attention (default: sdpa on the CPU, where FlexAttention has no "
                             "backward; flex elsewhere)")
    parser.add_argument("--check-attention", choices=("flex", "sdpa"),
                        help="torchtitan's inner attention in the fp32 loss check (default: the timed one; sdpa "
                             "spares an accelerator FlexAttention's fp32 compile and autotuning)")
    parser.add_argument("--out", help="also write the results as JSON here (after every part)")
    parser.add_argument("--write", action="store_true", help="put the table into docs/benchmarks.md (default: print)")
    parser.add_argument("--report", metavar="JSON", help="print (with --write: write) the table of a run's --out file")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    import torch
    from trex import device as device_layer

    dev = device_layer.detect(args.device)
    accelerator = dev.is_accelerator
    dtype = args.dtype or ("bf16" if accelerator else "fp32")
    shape = args.shape or ("v3" if accelerator else "narrow")
    seqs = args.seqs or ([4096] if accelerator else [512, 1024, 2048, 4096])
    attention = args.titan_attention or ("flex" if accelerator else "sdpa")
    if args.child:
        kind, *rest = args.child
        if kind == "check":
            print(json.dumps(check(shape_config(rest[0]), int(rest[1]), args.device, rest[2])))
        else:
            impl, seq, shape_, dtype_, steps, attention_ = rest
            print(json.dumps(run_one(impl, int(seq), shape_, args.device, dtype_, int(steps), attention_)))
        return
    if args.report:
        render(json.load(open(args.report)), args.write)
        return
    report = device_layer.environment_report(dev)
    meta = {"device_name": report.get("device_name", dev.type) if accelerator
            else f"CPU {platform.processor() or platform.machine()}, {os.cpu_count()} cores",
            "device_type": dev.type, "accelerator": accelerator, "torch": torch.__version__,
            "torchtitan": TITAN_VERSION, "threads": torch.get_num_threads(), "dtype": dtype, "steps": args.steps,
            "attention": attention, "seqs": seqs, "shape": shape}
    data = {"meta": meta, "check": None, "results": []}

    def save() -> None:  # after every part: a run stopped by a time limit keeps what it measured
        if args.out:
            from trex.atomic import write_text

            write_text(args.out, json.dumps(data, indent=1))

    data["check"] = checked = _child(["check", shape, str(min(*seqs, CHECK_MAX_SEQ)),
                                      args.check_attention or attention], args.device)
    save()
    print(json.dumps({"check": checked}), flush=True)
    if "error" in checked:
        sys.exit(f"peer bench: the two models disagree before timing: {checked['error']}")
    for seq in seqs:
        for impl in IMPLS:
            r = {"impl": impl, "seq": seq, **_child(["run", impl, str(seq), shape, dtype, str(args.steps), attention],
                                                     args.device)}
            data["results"].append(r)
            save()
            print(json.dumps(r), flush=True)
    render(data, args.write)


def render(data: dict, write: bool) -> None:
    """Print the table of a run (``main``'s, or one read back with ``--report``: a device's, carried home);
    with ``write`` put it into docs/benchmarks.md, the CPU's and an accelerator's sections apart."""
    meta = data["meta"]
    results = {(r["impl"], r["seq"]): r for r in data["results"]}
    text = table(results, data["check"], meta["seqs"], meta)
    print(text)
    if not write:
        return
    acc = meta["accelerator"]
    where = meta["device_name"] if acc else "CPU"
    cmd = ".venv/bin/python bench/peer_step.py" + (f" --device {meta['device_type']}" if acc else "") + " --write"
    kind = "accelerator" if acc else "cpu"
    shared = ("" if acc else " The CPU figures were measured with the machine's cores shared with other jobs "
              "whose load varied during the run: each time is the fastest of its steps; the memory figures do not "
              "depend on the load, the speed ratios do (on the 2-core machine of 2026-12-06 an earlier run, stopped "
              "before 4,096, gave 1.41x, 1.63x and 1.48x at 512, 1,024 and 2,048).")
    write_docs_section(f"<!-- peer-step-bench-{kind}:begin -->", f"<!-- peer-step-bench-{kind}:end -->",
                       f"## A peer beside it: trex vs torchtitan {meta['torchtitan']}, DeepSeek-V3 training step "
                       f"({where})\n\nCommand: `make setup-bench && {cmd}`\n\n{text}\n\n{WHERE_TIME_GOES[kind]}{shared}")


if __name__ == "__main__":
    main()
