"""The checkpoints of DeepSeek-V4 and V4.1: tensor names and on-disk precision (the interface:
trex.models.common.checkpoint_names; trex.checkpoint reads and writes through it). No torch.

trex names follow the official checkpoint (``layers.3.attn.wq_a.weight``, no ``model.`` prefix), with mHC
parameters as modules (``layers.3.hc_attn.fn`` for ``hc_attn_fn``) and routed experts stacked per layer
(``layers.3.ffn.experts.w1`` [E, I, d]). Three layouts are read:

- official (the released checkpoints): ``layers.3.ffn.experts.7.w1.weight`` ...;
- what ``transformers`` 5.x writes with ``save_pretrained``: the official names under a ``model.`` prefix,
  ``model.embed_tokens``, ``model.hc_head.hc_fn`` and, for the attention kv norm, ``attn.norm.weight``;
- transformers module names (a raw ``state_dict``): ``model.layers.3.self_attn.q_a_proj.weight``, fused
  ``mlp.experts.gate_up_proj`` [E, 2I, d] (w1 rows, then w3) and ``mlp.experts.down_proj``.

V4 is written in both: ``official`` and ``hf`` (the transformers module names, which transformers loads as
they are; MTP tensors, which transformers ignores, keep an unprefixed ``mtp.0.``). V4.1 only in the official
layout, which its Hugging Face repository holds.

Precision on disk follows the released checkpoints (reference §4.2/§4.3): with ``quantize``, V4's attention,
indexer-query, shared-expert and MTP projections are FP8 with 128x128 ue8m0 scales; routed experts are FP8
(``"fp8"``) or packed FP4 with 1x32 scales (``"fp8+fp4experts"``). Norms, router, compressor and
indexer-compressor projections, ``weights_proj``, embedding, head, mHC, sinks, ``ape`` and the gate bias are
never quantised. mHC, ``ape``, sinks and the gate bias stay float32 even in a bf16 save.

V4.1 as released: the same linears (``wo_a`` included) and Engram's ``wkv`` in FP8 with 32x32 blocks, routed
experts in FP4, Engram's tables in FP8 with one scale per row and 32 columns; the compressor, the indexer's
``wk`` and ``weights_proj`` stay unquantised.
"""

from __future__ import annotations

import re

from trex.models.common.checkpoint_names import (STACKED, CheckpointNames, Target, expert_targets, strip_model,
                                                 unstacked)

# transformers module names -> official names (the inverse of transformers' conversion mapping).
_FROM_HF_MODULES = [(re.compile(p), r) for p, r in [
    (r"^embed_tokens\.", "embed."),
    (r"^lm_head\.", "head."),
    (r"(^|\.)hc_head\.hc_(fn|base|scale)$", r"\1hc_head_\2"),
    (r"\.input_layernorm\.", ".attn_norm."),
    (r"\.post_attention_layernorm\.", ".ffn_norm."),
    (r"\.(attn|ffn)_hc\.(fn|base|scale)$", r".hc_\1_\2"),
    (r"\.self_attn\.compressor\.indexer\.scorer\.weights_proj\.", ".attn.indexer.weights_proj."),
    (r"\.self_attn\.compressor\.indexer\.q_b_proj\.", ".attn.indexer.wq_b."),
    (r"\.self_attn\.compressor\.indexer\.", ".attn.indexer.compressor."),
    (r"\.self_attn\.", ".attn."),
    (r"\.mlp\.", ".ffn."),
    (r"\.kv_proj\.", ".wkv."),
    (r"\.gate_proj\.", ".wgate."),
    (r"\.position_bias$", ".ape"),
    (r"\.compressor\.kv_norm\.", ".compressor.norm."),
    (r"\.q_a_proj\.", ".wq_a."),
    (r"\.q_a_norm\.", ".q_norm."),
    (r"\.attn\.q_b_proj\.", ".attn.wq_b."),
    (r"\.o_a_proj\.", ".wo_a."),
    (r"\.o_b_proj\.", ".wo_b."),
    (r"\.sinks$", ".attn_sink"),
    (r"\.gate\.e_score_correction_bias$", ".gate.bias"),
    (r"\.shared_experts\.wgate\.", ".shared_experts.w1."),
    (r"\.shared_experts\.up_proj\.", ".shared_experts.w3."),
    (r"\.shared_experts\.down_proj\.", ".shared_experts.w2."),
    (r"\.experts\.down_proj$", ".experts.w2"),
]]
# official names -> trex names.
_FROM_OFFICIAL = [(re.compile(p), r) for p, r in [
    (r"(^|\.)hc_head_(fn|base|scale)$", r"\1hc_head.\2"),
    (r"\.hc_(attn|ffn)_(fn|base|scale)$", r".hc_\1.\2"),
    (r"\.attn\.norm\.weight$", ".attn.kv_norm.weight"),  # transformers' save_pretrained writes this
]]
# official names -> transformers module names (transformers' conversion mapping, in order).
_TO_HF_MODULES = [(re.compile(p), r) for p, r in [
    (r"^embed\.", "embed_tokens."),
    (r"^head\.", "lm_head."),
    (r"(^|\.)hc_head_(fn|base|scale)$", r"\1hc_head.hc_\2"),
    (r"\.attn_norm\.", ".input_layernorm."),
    (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.hc_(attn|ffn)_(fn|base|scale)$", r".\1_hc.\2"),
    (r"\.attn\.indexer\.weights_proj\.", ".self_attn.compressor.indexer.scorer.weights_proj."),
    (r"\.attn\.indexer\.wq_b\.", ".self_attn.compressor.indexer.q_b_proj."),
    (r"\.attn\.indexer\.compressor\.", ".self_attn.compressor.indexer."),
    (r"\.attn\.", ".self_attn."),
    (r"\.ffn\.", ".mlp."),
    (r"\.compressor(\.indexer)?\.norm\.", r".compressor\1.kv_norm."),
    (r"\.ape$", ".position_bias"),
    (r"\.wkv\.", ".kv_proj."),
    (r"\.wgate\.", ".gate_proj."),
    (r"\.wq_a\.", ".q_a_proj."),
    (r"\.q_norm\.", ".q_a_norm."),
    (r"\.self_attn\.wq_b\.", ".self_attn.q_b_proj."),
    (r"\.wo_a\.", ".o_a_proj."),
    (r"\.wo_b\.", ".o_b_proj."),
    (r"\.attn_sink$", ".sinks"),
    (r"\.gate\.bias$", ".gate.e_score_correction_bias"),
    (r"\.shared_experts\.w1\.", ".shared_experts.gate_proj."),
    (r"\.shared_experts\.w3\.", ".shared_experts.up_proj."),
    (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."),
]]
# trex names -> official names.
_TO_OFFICIAL = [(re.compile(p), r) for p, r in [
    (r"(^|\.)hc_head\.(fn|base|scale)$", r"\1hc_head_\2"),
    (r"\.hc_(attn|ffn)\.(fn|base|scale)$", r".hc_\1_\2"),
]]

_FP8_LINEARS = re.compile(r"(\.attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|\.attn\.indexer\.wq_b|\.shared_experts\.w[123]"
                          r"|^mtp\.\d+\.(e_proj|h_proj))\.weight$")
_V41_FP8_LINEARS = re.compile(r"(\.attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|\.attn\.indexer\.wq_b|\.shared_experts\.w[123]"
                              r"|\.engram\.wkv|^mtp\.\d+\.main_proj)\.weight$")
_V41_TABLES = re.compile(r"\.engram\.embed\.weight$")
_KEEP_FP32 = re.compile(r"((^|\.)hc_(attn|ffn|head)\.(fn|base|scale)|\.ape|\.attn_sink|\.gate\.bias)$")


def _sub(rules, name: str) -> str:
    for pattern, repl in rules:
        name = pattern.sub(repl, name)
    return name


def official_name(key: str, expert: int | None = None) -> str:
    """trex name -> official name; a stacked expert key needs the expert index."""
    return unstacked(key, expert) or _sub(_TO_OFFICIAL, key)


def hf_name(key: str) -> str:
    """trex name -> transformers module name. Stacked experts map to the fused tensors: w1 and w3
    both to ``gate_up_proj`` (w1 rows first), w2 to ``down_proj``."""
    m = STACKED.match(key)
    if m:
        name = f"{m.group(1)}.{'down_proj' if m.group(2) == 'w2' else 'gate_up_proj'}"
    else:
        name = official_name(key)
    name = _sub(_TO_HF_MODULES, name)
    return name if name.startswith(("mtp.", "lm_head.")) else "model." + name


def _quantization_config(quantize: str, block: int | None) -> dict:
    """config.json's ``quantization_config``: FP8 with ue8m0 scales per ``block`` x ``block`` (None: 128), FP4
    experts under "fp8+fp4experts"."""
    from trex.kernels import quantize as quant  # torch: only to write a quantised checkpoint

    block = block or quant.FP8_BLOCK
    cfg = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0", "activation_scheme": "dynamic",
           "weight_block_size": [block, block]}
    if quantize == "fp8+fp4experts":
        cfg["expert_dtype"] = "fp4"
        cfg["expert_fmt"] = "e2m1"
        cfg["expert_block_size"] = [1, quant.FP4_BLOCK]
    return cfg


class V4Names(CheckpointNames):
    """DeepSeek-V4's checkpoints (this module's docstring)."""

    def trex_targets(self, name: str, layout: str, n_layers: int | None) -> list[Target]:
        key = strip_model(name, layout)
        if layout != "official":
            key = _sub(_FROM_HF_MODULES, key)
        return expert_targets(_sub(_FROM_OFFICIAL, key), layout)

    def written_name(self, key: str, layout: str, n_layers: int | None, expert: int | None = None) -> str:
        return official_name(key, expert) if layout == "official" else hf_name(key)

    def fused_experts(self, layout: str) -> bool:
        return layout == "hf"

    def codec(self, key: str, quantize: str, scale_fmt: str | None) -> str:
        if STACKED.match(key):
            return "fp4" if quantize == "fp8+fp4experts" else "fp8"
        return "fp8" if _FP8_LINEARS.search(key) else "plain"

    def keeps_fp32(self, key: str) -> bool:
        return _KEEP_FP32.search(key) is not None

    def quantization_config(self, quantize: str) -> dict:
        return _quantization_config(quantize, None)


class V41Names(V4Names):
    """DeepSeek-V4.1's checkpoints: V4's names, the official layout only, V4.1's precision."""

    def layout_refused(self, layout: str) -> str | None:
        if layout != "official":
            return ("DeepSeek-V4.1 is written in the official layout, which is what its Hugging Face repository "
                    "holds: transformers has no V4.1 module names to write")
        return None

    def codec(self, key: str, quantize: str, scale_fmt: str | None) -> str:
        if STACKED.match(key):
            return "fp4" if quantize == "fp8+fp4experts" else "fp8/32"
        return "fp8/32" if _V41_FP8_LINEARS.search(key) else "fp8/1x32" if _V41_TABLES.search(key) else "plain"

    def quantization_config(self, quantize: str) -> dict:
        return _quantization_config(quantize, 32)


V4_NAMES = V4Names()
V41_NAMES = V41Names()
