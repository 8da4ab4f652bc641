"""Runs DeepSeek's official V4.1 inference code on CPU and writes its outputs as test fixtures.

The official code is not in this repository and is never committed: fetch ``inference/model.py`` and
``inference/engram.py`` of https://huggingface.co/deepseek-ai/DeepSeek-V4.1-Flash at revision
dba1be0a40aa45a94ad051997016db3960a90277 into a directory, then

    .venv/bin/python tests/official_v41_harness.py --official DIR

rewrites tests/fixtures/v41/tiny.safetensors (numbers only: the tiny model's weights under the official
names, the inputs, the official token map and n-gram hashes, the official logits and gradients) and
tests/fixtures/v41/released/ (the same model as a checkpoint in the released layout, its names, shapes
and FP8/FP4 formats those of the official module built with FP8 linears and FP4 experts), and
tests/fixtures/v41/dspark.safetensors and dspark_released/ (the same for a model with two DSpark stages,
and the official greedy loop's drafts: see ``run_dspark`` and its one fix, ``publish_index_keys``). Its
``kernel.py`` (tilelang, GPU only) is replaced by the torch stand-ins below, written for this harness
from the kernels' contracts; the vision tower is not built (``vision_n_layers = 0``).

Two runs per config:
- ``fp32``: the model in fp32 with every fake quantisation off (the stand-ins' quantisers are the
  identity; attention is an exact fp32 softmax) -- the architecture alone. The forward runs without its
  ``inference_mode`` and the mean next-token cross-entropy is backpropagated through it: the fixture
  keeps every parameter's gradient (an Engram table's as d loss / d dequantised value);
- ``bf16``: the model as served in bf16 (linears in bf16, experts in bf16), with the official rounding
  points on: window KV through FP8 (e4m3, ue8m0 scales, blocks of 32), compressed KV through FP4 with
  e4m3 scales (blocks of 16), the indexer's queries and keys through FP4 (ue8m0, blocks of 32), and
  attention as a 64-slot online softmax that rounds its unnormalised probabilities to bf16.
Weights are drawn bf16-representable, so both runs (and trex) hold exactly the same values; Engram
tables are stored FP8 with 1x32 ue8m0 scales, as released, and the fixture holds their dequantised
values (exact in fp32 and bf16).

One deviation in the fp32 run: Engram's lookup returns bf16 (it dequantises to bf16 by design); the
harness casts it to fp32 before ``wkv``, which changes no value (e4m3 times a power of two is exact in
bf16).
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import shutil
import sys
import tempfile
import types

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(ROOT, "tests", "fixtures", "v41")

# ---- kernel.py stand-ins --------------------------------------------------------------------------
MODE = {"quantise": False}  # set per run
SCALE = 0.5  # matrices N(0, SCALE^2 / fan_in): every part matters, and bf16 stays comparable


def _pow2_scale(amax: torch.Tensor, qmax: float, floor: float) -> torch.Tensor:
    """ue8m0: amax (floored) / qmax rounded up to a power of two (exactly, from frexp's mantissa)."""
    mantissa, exponent = torch.frexp(amax.float().clamp(min=floor) * (1.0 / qmax))  # r = mantissa * 2^exponent
    return torch.ldexp(torch.ones_like(mantissa), torch.where(mantissa == 0.5, exponent - 1, exponent))


def _e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest e2m1 value, ties to the even code (x already within +-6)."""
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    mag = x.abs()
    dist = (mag.unsqueeze(-1) - grid).abs()
    best = dist.min(dim=-1, keepdim=True).values
    tied = dist == best
    code = torch.where(tied.sum(-1) > 1, (tied * torch.arange(8)).masked_fill(~tied | (torch.arange(8) % 2 == 1), 99)
                       .min(-1).values, dist.argmin(-1))
    return torch.copysign(grid[code], x)


def act_quant(x, block_size=128, scale_fmt=None, scale_dtype=torch.float32, inplace=False):
    if not inplace:
        raise NotImplementedError("the harness runs bf16 weights only (no FP8 GEMM)")
    if MODE["quantise"]:
        b = x.float().unflatten(-1, (-1, block_size))
        s = _pow2_scale(b.abs().amax(-1, keepdim=True), 448.0, 1e-4)
        x.copy_(((b / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s).flatten(-2))
    return x


def fp4_act_quant(x, block_size=32, inplace=False, scale_dtype=torch.float8_e8m0fnu):
    if not inplace:
        raise NotImplementedError("the harness runs bf16 weights only (no FP4 GEMM)")
    if MODE["quantise"]:
        b = x.float().unflatten(-1, (-1, block_size))
        amax = b.abs().amax(-1, keepdim=True)
        if scale_dtype == torch.float8_e4m3fn:
            s = (amax.clamp(min=6 * 2.0**-9) / 6).to(torch.float8_e4m3fn).float()
        else:
            s = _pow2_scale(amax, 6.0, 6 * 2.0**-126)
        x.copy_((_e2m1((b / s).clamp(-6, 6)) * s).flatten(-2))
    return x


def fp8_gemm(*args, **kwargs):
    raise NotImplementedError("the harness runs bf16 weights only")


fp4_gemm = fp8_gemm


def hc_split_sinkhorn(mixes, hc_scale, hc_base, hc_mult=4, sinkhorn_iters=20, eps=1e-6):
    n = hc_mult
    pre = torch.sigmoid(mixes[..., :n] * hc_scale[0] + hc_base[:n]) + eps
    post = 2 * torch.sigmoid(mixes[..., n:2 * n] * hc_scale[1] + hc_base[n:2 * n])
    comb = (mixes[..., 2 * n:] * hc_scale[2] + hc_base[2 * n:]).unflatten(-1, (n, n)).softmax(-1) + eps
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    return pre, post, comb


def sparse_attn(q, kv, attn_sink, topk_idxs, softmax_scale):
    """q [b, s, h, d], kv [b, n, d] (K = V), topk_idxs [b, s, k] (-1: none) -> [b, s, h, d]: one softmax
    over the picked rows and the per-head sink. Quantising: 64-slot online softmax, unnormalised
    probabilities rounded to bf16 before the value product."""
    idx = topk_idxs.long()
    valid = idx >= 0
    rows = torch.stack([kv[i, idx[i].clamp(min=0)] for i in range(kv.shape[0])]).float()  # [b, s, k, d]
    scores = torch.einsum("bshd,bskd->bshk", q.float(), rows) * softmax_scale
    scores = scores.masked_fill(~valid[:, :, None, :], -math.inf)
    sink = attn_sink.float()[None, None, :]
    if not MODE["quantise"]:
        m = torch.maximum(scores.amax(-1), sink)
        p = torch.exp(scores - m[..., None])
        den = p.sum(-1) + torch.exp(sink - m)
        return (torch.einsum("bshk,bskd->bshd", p, rows) / den[..., None]).to(q.dtype)
    m = torch.full(scores.shape[:3], -1e30)
    den = torch.zeros(scores.shape[:3])
    num = torch.zeros(*scores.shape[:3], rows.shape[-1])
    for k0 in range(0, scores.shape[-1], 64):
        part = scores[..., k0:k0 + 64]
        m_new = torch.maximum(m, part.amax(-1))
        corr = torch.exp(m - m_new)
        p = torch.exp(part - m_new[..., None])
        den = den * corr + p.sum(-1)
        num = num * corr[..., None] + torch.einsum("bshk,bskd->bshd", p.bfloat16().float(), rows[:, :, k0:k0 + 64])
        m = m_new
    den = den + torch.exp(sink - m)
    return (num / den[..., None]).to(q.dtype)


# ---- loading the official code ---------------------------------------------------------------------
def load_official(directory: str):
    """The official model module, imported from a temporary package with the stand-ins as its kernel."""
    pkg_dir = tempfile.mkdtemp(prefix="official_v41_")
    pkg = os.path.join(pkg_dir, "official_v41")
    os.makedirs(pkg)
    for name in ("model.py", "engram.py"):
        shutil.copy(os.path.join(directory, name), os.path.join(pkg, name))
    with open(os.path.join(pkg, "__init__.py"), "w"):
        pass
    me = sys.modules[__name__]
    for name in ("kernel", "kernel_cpu"):
        sys.modules[f"official_v41.{name}"] = me
        sys.modules[name] = me
    processor = types.ModuleType("image_processor")
    processor.TEXT, processor.IMAGE_START, processor.IMAGE, processor.IMAGE_NEW_LINE, processor.IMAGE_END = -1, 0, 1, 2, 3
    vision = types.ModuleType("vision")
    vision.ViT = vision.Aligner = None  # vision_n_layers = 0: never built
    for name, module in (("image_processor", processor), ("vision", vision)):
        sys.modules[f"official_v41.{name}"] = module
        sys.modules[name] = module
    sys.path.insert(0, pkg_dir)
    sys.path.insert(0, pkg)  # upstream imports its siblings by absolute name
    engram = importlib.import_module("official_v41.engram")
    sys.modules.setdefault("engram", engram)
    return importlib.import_module("official_v41.model")


# ---- the fixtures' inputs --------------------------------------------------------------------------
def tokenizer_for(vocab: int):
    """A word-level tokenizer of ``vocab`` tokens with case, accent, width and whitespace variants (so
    Engram's token map merges some ids), and a partial-UTF-8 token; wrapped as the official code reads
    a Hugging Face tokenizer (``len`` and ``backend_tokenizer``)."""
    from tokenizers import Tokenizer, models

    words = ["<s>", "</s>", "<pad>", "the", "The", " the", "THE", "café", "cafe", "Café", "ｃａｆｅ", " ", "  ", "\n",
             "\t ", "�", "naïve", "naive", "x", "X", "Ｘ"]
    words += [f"w{i}" for i in range(vocab - len(words))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<pad>"))

    class Wrapped:
        backend_tokenizer = tok

        def __len__(self):
            return tok.get_vocab_size(with_added_tokens=True)

    return Wrapped(), tok


def tiny_args(module, compressed_vocab: int):
    """ModelArgs for a model with every V4.1 layer kind: two window-only layers around a ratio-2 run with
    two KV sources, a ratio-1 run whose first layer is a KV, index and candidate source and whose last
    layer indexes inside the pool; Engram before layers 0 and 3."""
    return module.ModelArgs(
        max_batch_size=2, max_seq_len=64, dtype="bf16", expert_dtype=None, vocab_size=64, dim=64, moe_inter_dim=32,
        n_layers=7, n_mtp_layers=0, n_heads=4, n_routed_experts=8, n_shared_experts=1, n_activated_experts=2,
        score_func="sqrtsoftplus", route_scale=1.5, swiglu_limit=10.0, q_lora_rank=32, head_dim=64, rope_head_dim=16,
        norm_eps=1e-20, o_groups=2, o_lora_rank=16, window_size=8, compress_ratios=(0, 2, 2, 2, 1, 1, 1),
        kv_source_layers=(1, 3, 4), index_source_layers=(1, 3, 4, 6), compress_rope_theta=160000.0,
        original_seq_len=64, rope_theta=10000.0, rope_factor=4, beta_fast=32, beta_slow=1, index_n_heads=8,
        index_head_dim=32, index_topk=6, candidate_source_layer=4, candidate_topk_blocks=3, candidate_block_size=4,
        hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, engram_layer_ids=(0, 3), engram_num_embeddings=(0, 0),
        engram_max_ngram_size=3, engram_vocab_size=37, engram_n_heads=2, engram_head_dim=32, engram_pad_id=2,
        engram_compressed_vocab_size=compressed_vocab, vision_n_layers=0, dspark_block_size=0,
    )


def dspark_args(module, compressed_vocab: int, rows: tuple[int, ...]):
    """``tiny_args`` with two DSpark stages (``mtp.0`` projects the target layers, ``mtp.1`` holds the
    heads) drafting blocks of 3 from layers 4 and 5, 4 experts top-3, and greedy sampling."""
    args = tiny_args(module, compressed_vocab)
    return module.ModelArgs(**{**vars(args), "n_mtp_layers": 2, "compress_ratios": (*args.compress_ratios, 0, 0),
                               "engram_num_embeddings": rows, "dspark_block_size": 3, "dspark_noise_token_id": 63,
                               "dspark_target_layer_ids": (4, 5), "dspark_markov_rank": 16,
                               "dspark_n_routed_experts": 4, "dspark_n_activated_experts": 3, "temperature": 0.0})


def random_weights(model, seed: int) -> dict[str, torch.Tensor]:
    """A value for every parameter, bf16-representable, at scales that make every part matter: matrices
    N(0, 1/fan_in), norms and mHC scales around 1, sinks and router biases spread, Engram tables FP8."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, p in model.state_dict().items():
        leaf = name.rsplit(".", 1)[-1]
        if name.endswith("engram.embed.scale"):
            continue
        if name.endswith("engram.embed.weight"):
            rows, dim = p.shape
            value = torch.randn(rows, dim, generator=gen)
            blocks = value.unflatten(-1, (-1, 32))
            scale = _pow2_scale(blocks.abs().amax(-1, keepdim=True), 448.0, 1e-4)
            q = (blocks / scale).to(torch.float8_e4m3fn)
            out[name] = (q.float() * scale).flatten(-2)  # dequantised: exact
            out[name + "@fp8"], out[name[: -len("weight")] + "scale"] = q.flatten(-2), scale.squeeze(-1)
            continue
        if p.dim() == 1 and (leaf == "weight" or leaf.endswith("scale")):
            value = 1 + 0.1 * torch.randn(p.shape, generator=gen)
        elif leaf in ("attn_sink", "bias") or leaf.endswith("_base"):
            value = 0.5 * torch.randn(p.shape, generator=gen)
        elif leaf in ("q_weight", "k_weight"):
            value = 1 + 0.2 * torch.randn(p.shape, generator=gen)
        else:
            value = torch.randn(p.shape, generator=gen) * SCALE * p.shape[-1] ** -0.5
        out[name] = value.bfloat16().float()
    return out


def official_model(module, args, weights: dict[str, torch.Tensor], tokenizer, bf16: bool):
    """The official Transformer holding ``weights`` (Engram tables as their FP8 codes; a DSpark stage's embed
    and head are the main model's), in bf16 or fp32 (under the default dtype the caller set)."""
    model = module.Transformer(args, tokenizer)
    state = {}
    for name, p in model.state_dict().items():
        key = _shared_name(name)
        state[name] = weights[key + "@fp8"] if key.endswith("engram.embed.weight") else \
            weights[key].to(p.dtype if bf16 else torch.float32)
    if not bf16:
        model.float()
        for layer in model.layers:  # the lookup's bf16 cast is exact; fp32 for the fp32 wkv
            if layer.engram is not None:
                layer.engram.embed.register_forward_hook(lambda mod, inp, out: out.float())
    model.load_state_dict(state, strict=True)
    return model


def run(module, args, weights: dict[str, torch.Tensor], ids: torch.Tensor, tokenizer, bf16: bool):
    """The official forward's logits [B, S, V] (fp32) for ids, and its Engram hashes."""
    MODE["quantise"] = bf16
    torch.set_default_dtype(torch.bfloat16 if bf16 else torch.float32)
    try:
        model = official_model(module, args, weights, tokenizer, bf16)
        head = model.head.forward
        model.head.forward = lambda x, full_logits=False: head(x, full_logits=True)
        if bf16:
            _, logits, _ = model(ids)
            grads = None
        else:  # the forward without its inference_mode: autograd through the official code
            _, logits, _ = type(model).forward.__wrapped__(model, ids)
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
            loss.backward()
            grads = {}
            for name, p in model.named_parameters():
                if p.grad is None:
                    continue
                grads[name] = p.grad.detach().clone()
                if name.endswith("engram.embed.weight"):  # d loss / d(dequantised row) = d / d(fp8 value) / scale
                    scale = dict(model.named_parameters())[name[: -len("weight")] + "scale"].detach()
                    grads[name] = (p.grad.unflatten(-1, (-1, 32)) / scale.unsqueeze(-1)).flatten(-2)
            grads = {k: v for k, v in grads.items() if not k.endswith("engram.embed.scale")}
        hashes = model.engram_hash(ids, 0) if model.engram_hash is not None else None
        return logits.detach().float(), hashes, grads
    finally:
        torch.set_default_dtype(torch.float32)


def publish_index_keys(module) -> None:
    """Fix a decode bug of the official code: an index-key owner publishes its key cache
    (``shared_attn.index_k``) only in a step that completes one of its groups, so in the other decode steps
    of a ratio-2 KV source its layers score against the keys the previous step's last owner left there (in
    the released config the ratio-1 source's, layer 20). Its decode then departs from its own prefill over
    the same tokens (measured: 10-20% on the target layers' hidden, greedy tokens changed). Publishing in
    every step, as the compressed entries already are, makes decode equal its prefill."""
    forward = module.Indexer.forward

    def publishing(self, x, qr, latent, start_pos, offset):
        if self.owns_k:
            module.shared_attn.index_k = self.k_cache
        return forward(self, x, qr, latent, start_pos, offset)

    module.Indexer.forward = publishing


def run_dspark(module, args, weights: dict[str, torch.Tensor], ids: torch.Tensor, prefill: int, tokenizer,
               bf16: bool) -> dict[str, torch.Tensor]:
    """The official greedy loop with the drafter (its ``__main__``, with ``publish_index_keys``): the prefill
    over ids[:, :prefill] seeds the drafter's windows, then each decode step i feeds ids[:, i] and drafts
    from its greedy token and the target layers' hidden. Per step: the main token [B], the target hidden
    [B, k d], the draft ids [B, block + 1], logits [B, block, V] and confidence [B, block], stacked over the
    steps; ``prefill_hidden`` [B, prefill, k d]; and ``decode_error``: the hidden's largest relative departure
    from a prefill of the same tokens."""
    MODE["quantise"] = bf16
    torch.set_default_dtype(torch.bfloat16 if bf16 else torch.float32)
    try:
        model = official_model(module, args, weights, tokenizer, bf16)
        out = {k: [] for k in ("token", "hidden", "draft", "draft_logits", "confidence")}
        tokens, _, hidden = model(ids[:, :prefill])
        model.forward_spec(tokens, hidden, 0)
        seed = hidden.float()
        for i in range(prefill, ids.shape[1]):
            tokens, _, hidden = model(ids[:, i:i + 1], i)
            draft, logits, confidence = model.forward_spec(tokens, hidden, i)
            for key, value in zip(out, (tokens, hidden[:, 0], draft, logits, confidence)):
                out[key].append(value.float() if value.is_floating_point() else value)
        out = {k: torch.stack(v, dim=1).contiguous() for k, v in out.items()}
        _, _, whole = model(ids)
        out["prefill_hidden"] = seed
        out["decode_error"] = ((out["hidden"] - whole[:, prefill:].float()).abs().amax() / whole.float().abs().amax())
        return out
    finally:
        torch.set_default_dtype(torch.float32)


def _shared_name(name: str) -> str:
    """The official module also lists the main embedding and head under each DSpark stage (``mtp.N.embed``,
    ``mtp.N.head``: the same tensors); they are the main model's."""
    parts = name.split(".")
    return ".".join(parts[2:]) if parts[0] == "mtp" and parts[2] in ("embed", "head") else name


def _fp8_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [R, C] -> (e4m3 [R, C], ue8m0 scales [R/br, C/bc], dequantised fp32), the official rule: each
    block's amax / 448 rounded up to a power of two."""
    br, bc = block
    rows, cols = w.shape
    b = w.float().reshape(rows // br, br, cols // bc, bc)
    s = _pow2_scale(b.abs().amax(dim=(1, 3), keepdim=True), 448.0, 1e-4)
    q = (b / s).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q.reshape(rows, cols), s[:, 0, :, 0].to(torch.float8_e8m0fnu), (q.float() * s).reshape(rows, cols)


def _fp4_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [R, C] -> (int8 [R, C/2]: the e2m1 code of column 2j in the low nibble, 2j+1 in the high one,
    ue8m0 scales [R, C/32], dequantised fp32)."""
    rows, cols = w.shape
    b = w.float().reshape(rows, cols // 32, 32)
    s = _pow2_scale(b.abs().amax(-1, keepdim=True), 6.0, 6 * 2.0**-126)
    v = _e2m1((b / s).clamp(-6, 6))
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    code = (v.abs().unsqueeze(-1) == grid).float().argmax(-1) + 8 * torch.signbit(v).long()
    code = code.reshape(rows, cols)
    packed = (code[:, 0::2] | (code[:, 1::2] << 4)).to(torch.uint8).view(torch.int8)
    return packed, s.squeeze(-1).to(torch.float8_e8m0fnu), (v * s).reshape(rows, cols)


# as released, unlike the inference module's own dtypes: wo_a FP8 (convert.py dequantises it), the LM head
# and the compressors bf16 (the module promotes them to fp32)
_RELEASED_FP8 = (".attn.wo_a.weight",)
_RELEASED_BF16 = ("head.weight", ".compressor.wkv.weight", ".compressor.wgate.weight", ".confidence_head.proj.weight")


def official_checkpoint(module, args, weights: dict[str, torch.Tensor], wrapped, tok, out: str) -> dict:
    """A tiny checkpoint in the released V4.1 layout, named and typed by the official module built with
    FP8 linears and FP4 experts: FP8 e4m3 with 32x32 ue8m0 scales, FP4 routed experts with 1x32 scales,
    Engram tables FP8 with a scale per row and 32 columns; returns each quantised tensor's intended value."""
    from safetensors.torch import save_file

    fp8 = module.ModelArgs(**{**vars(args), "dtype": "fp8", "expert_dtype": "fp4"})
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = module.Transformer(fp8, wrapped)
    finally:
        torch.set_default_dtype(torch.float32)
    state = model.state_dict()
    tensors, intended = {}, {}
    for name, p in state.items():
        if name.endswith(".scale") or _shared_name(name) != name:
            continue  # written with its weight; a DSpark stage's embed and head are the main model's
        scale = name[: -len("weight")] + "scale"
        if name.endswith("engram.embed.weight"):
            tensors[name], tensors[scale] = weights[name + "@fp8"], weights[scale].to(torch.float8_e8m0fnu)
            intended[name] = weights[name]
        elif p.dtype == torch.float8_e4m3fn or name.endswith(_RELEASED_FP8):
            tensors[name], tensors[scale], intended[name] = _fp8_blocks(weights[name], (32, 32))
        elif p.dtype == torch.float4_e2m1fn_x2:
            tensors[name], tensors[scale], intended[name] = _fp4_rows(weights[name])
        else:  # stored as it is: the test reads its value from the checkpoint
            tensors[name] = weights[name].to(torch.bfloat16 if name.endswith(_RELEASED_BF16) else p.dtype)
        if scale in tensors and scale in state:  # the module's own FP8 scale grid: the one written
            assert tuple(tensors[scale].shape) == tuple(state[scale].shape), (scale, tensors[scale].shape)
    os.makedirs(out, exist_ok=True)
    save_file(tensors, os.path.join(out, "model.safetensors"))
    config = {k: list(v) if isinstance(v, tuple) else v for k, v in vars(fp8).items()}
    config["model_type"] = "deepseek_v41"
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    tok.save(os.path.join(out, "tokenizer.json"))
    return intended


def main(argv: list[str] | None = None) -> int:
    from safetensors.torch import save_file

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--official", required=True, help="directory holding the official model.py and engram.py")
    parser.add_argument("--out", default=FIXTURES)
    opts = parser.parse_args(argv)
    module = load_official(opts.official)
    wrapped, tok = tokenizer_for(64)
    token_map, compressed = sys.modules["official_v41.engram"].build_compressed_token_map(wrapped)
    args = tiny_args(module, compressed)
    layout = sys.modules["official_v41.engram"].EngramLayout.from_args(
        types.SimpleNamespace(**{**vars(args), "engram_num_embeddings": ()}))
    rows = tuple(sum(sum(per_ngram) for per_ngram in layer) for layer in layout.primes)
    args.engram_num_embeddings = rows
    torch.manual_seed(0)
    shell = module.Transformer(args, wrapped)
    weights = random_weights(shell, seed=0)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (2, 48), generator=gen)
    ids[0, 5:9] = torch.tensor([3, 4, 5, 6])  # n-grams of variants that hash alike
    # bf16 holds every weight exactly (they are drawn bf16-representable; tables are FP8 times powers of two)
    tensors = {f"weight.{k}": v.bfloat16() for k, v in weights.items() if "@" not in k and not k.endswith("embed.scale")}
    tensors["input_ids"] = ids
    tensors["token_map"] = torch.tensor(token_map)
    for mode in ("fp32", "bf16"):
        logits, hashes, grads = run(module, args, weights, ids, wrapped, bf16=mode == "bf16")
        tensors[f"logits.{mode}"] = logits.contiguous()
        tensors["engram_hashes"] = hashes.contiguous()
        tensors.update({f"grad.{k}": v.contiguous() for k, v in (grads or {}).items()})
    meta = {k: json.dumps(list(v) if isinstance(v, tuple) else v) for k, v in vars(args).items()}
    meta["revision"] = "dba1be0a40aa45a94ad051997016db3960a90277"
    meta["tokenizer"] = tok.to_str()
    os.makedirs(opts.out, exist_ok=True)
    intended = official_checkpoint(module, args, weights, wrapped, tok, os.path.join(opts.out, "released"))
    tensors.update({f"released.{k}": v.bfloat16() for k, v in intended.items()})  # FP8/FP4 values: exact in bf16
    save_file(tensors, os.path.join(opts.out, "tiny.safetensors"), metadata=meta)
    write_dspark(module, wrapped, tok, compressed, rows, opts.out)
    print(f"wrote {os.path.join(opts.out, 'tiny.safetensors')}: {len(tensors)} tensors, "
          f"{sum(t.numel() * t.element_size() for t in tensors.values()) / 2**20:.2f} MiB")
    return 0



def write_dspark(module, wrapped, tok, compressed: int, rows: tuple[int, ...], out: str) -> None:
    """tests/fixtures/v41/dspark.safetensors (the drafter's weights, inputs and, per run, the official
    loop's outputs) and dspark_released/ (the model with its drafter in the released layout)."""
    from safetensors.torch import save_file

    args = dspark_args(module, compressed, rows)
    publish_index_keys(module)
    torch.manual_seed(0)
    weights = random_weights(module.Transformer(args, wrapped), seed=2)
    weights = {k: v for k, v in weights.items() if _shared_name(k) == k}
    ids = torch.randint(0, 64, (2, 26), generator=torch.Generator().manual_seed(3))
    tensors = {f"weight.{k}": v.bfloat16() for k, v in weights.items() if "@" not in k and not k.endswith("embed.scale")}
    tensors["input_ids"] = ids
    for mode in ("fp32", "bf16"):
        tensors.update({f"{k}.{mode}": v for k, v in run_dspark(module, args, weights, ids, 14, wrapped,
                                                                bf16=mode == "bf16").items()})
    meta = {k: json.dumps(list(v) if isinstance(v, tuple) else v) for k, v in vars(args).items()}
    meta["revision"] = "dba1be0a40aa45a94ad051997016db3960a90277"
    meta["prefill"] = "14"
    meta["tokenizer"] = tok.to_str()
    intended = official_checkpoint(module, args, weights, wrapped, tok, os.path.join(out, "dspark_released"))
    tensors.update({f"released.{k}": v.bfloat16() for k, v in intended.items()})
    save_file(tensors, os.path.join(out, "dspark.safetensors"), metadata=meta)
    print(f"wrote {os.path.join(out, 'dspark.safetensors')}: {len(tensors)} tensors")


if __name__ == "__main__":
    sys.exit(main())
