"""The checkpoints of the DeepSeek-V3 family: tensor names and on-disk precision (the interface:
trex.models.common.checkpoint_names; trex.checkpoint reads and writes through it). No torch.

trex names are DeepSeek's inference names (its ``convert.py``: ``layers.5.attn.wkv_a.weight``,
``layers.5.ffn.w1.weight``, ``layers.5.ffn.gate.bias``), routed experts stacked, and the MTP layer, released as
``model.layers.{num_hidden_layers + j}``, as ``mtp.j`` (its ``shared_head.norm`` as ``mtp.j.norm``; its copies of
``embed_tokens`` and ``shared_head.head`` fill nothing: trex shares the main model's, and ``mtp_copy_of`` names
what each duplicates, for the reader to check). Read: the released / ``save_pretrained`` names (per-expert
``mlp.experts.E.gate_proj``), transformers' module names (fused ``gate_up_proj``, 3-D ``down_proj``) and
DeepSeek's own names ("official"). Written: the released names only (layout "hf", ``v3_hf_name``), the MTP layer
with its copies of the embedding and head (``mtp_copies``).

Precision on disk as released (reference §3): ``quantize="fp8"`` stores every attention projection (V3.2's
indexer ``wq_b`` and ``wk`` too), the dense MLPs, shared and routed experts, in the main layers and the MTP layer,
as e4m3 with one fp32 ``weight_scale_inv`` per 128x128 block (amax / 448); the embedding, head, norms, router
``gate.weight``, ``eh_proj``, ``weights_proj`` stay in the save's dtype and ``e_score_correction_bias`` in fp32. A
checkpoint whose config says ``scale_fmt: "ue8m0"`` (DeepSeek-V3.1, V3.2) keeps fp32 scales that are powers of
two, rounded up (codec "fp8/fp32-ue8m0"), so that an engine which trusts the field reads the weights that were
written.
"""

from __future__ import annotations

import re

from trex.models.common.checkpoint_names import (STACKED, CheckpointNames, Target, expert_targets, strip_model,
                                                 unstacked)

# transformers / released names (``model.`` stripped, MTP already renumbered) -> DeepSeek's names; anchored
# on whole components (DeepSeek's convert.py replaces substrings)
_FROM_HF = [(re.compile(p), r) for p, r in [
    (r"^embed_tokens\.", "embed."),
    (r"^lm_head\.", "head."),
    (r"\.input_layernorm\.", ".attn_norm."),
    (r"\.post_attention_layernorm\.", ".ffn_norm."),
    (r"\.self_attn\.", ".attn."),
    (r"\.mlp\.", ".ffn."),
    (r"\.q_proj\.", ".wq."),
    (r"\.q_a_proj\.", ".wq_a."),
    (r"\.q_a_layernorm\.", ".q_norm."),
    (r"\.q_b_proj\.", ".wq_b."),
    (r"\.kv_a_proj_with_mqa\.", ".wkv_a."),
    (r"\.kv_a_layernorm\.", ".kv_norm."),
    (r"\.kv_b_proj\.", ".wkv_b."),
    (r"\.o_proj\.", ".wo."),
    (r"\.gate_proj\.", ".w1."),
    (r"\.up_proj\.", ".w3."),
    (r"\.down_proj\.", ".w2."),
    (r"\.experts\.down_proj$", ".experts.w2"),
    (r"\.gate\.e_score_correction_bias$", ".gate.bias"),
    (r"^(mtp\.\d+)\.shared_head\.norm\.", r"\1.norm."),
    (r"^(mtp\.\d+)\.post_norm\.", r"\1.norm."),  # transformers' MtpLayer module name
]]
# DeepSeek's names -> transformers / released names (written); the inverse of _FROM_HF on trex's keys
_TO_HF = [(re.compile(p), r) for p, r in [
    (r"^embed\.", "embed_tokens."),
    (r"^head\.", "lm_head."),
    (r"\.attn_norm\.", ".input_layernorm."),
    (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.attn\.", ".self_attn."),
    (r"\.ffn\.", ".mlp."),
    (r"\.wq\.", ".q_proj."),
    (r"\.wq_a\.", ".q_a_proj."),
    (r"\.q_norm\.", ".q_a_layernorm."),
    (r"(?<!\.indexer)\.wq_b\.", ".q_b_proj."),  # the V3.2 indexer's wq_b keeps its name
    (r"\.wkv_a\.", ".kv_a_proj_with_mqa."),
    (r"\.kv_norm\.", ".kv_a_layernorm."),
    (r"\.wkv_b\.", ".kv_b_proj."),
    (r"\.wo\.", ".o_proj."),
    (r"\.w1\.", ".gate_proj."),
    (r"\.w3\.", ".up_proj."),
    (r"\.w2\.", ".down_proj."),
    (r"\.gate\.bias$", ".gate.e_score_correction_bias"),
    (r"^(mtp\.\d+)\.norm\.", r"\1.shared_head.norm."),
]]
_LAYER = re.compile(r"^layers\.(\d+)\.(.*)$")
_MTP = re.compile(r"^mtp\.(\d+)\.(.*)$")
# the MTP layer's copies of the embedding and head (trex shares the main model's: ``mtp_copy_of``)
_COPIES = re.compile(r"^mtp\.\d+\.(embed_tokens|embed|shared_head\.head)\.weight$")
_SKIP = re.compile(r"\.rotary_emb\.inv_freq$")  # Kimi-K2's stored RoPE frequencies: not loaded
_FP8_LINEARS = re.compile(r"^(layers|mtp)\.\d+\.(attn\.(wq|wq_a|wq_b|wkv_a|wkv_b|wo|indexer\.wq_b|indexer\.wk)"
                          r"|ffn\.(shared_experts\.)?w[123])\.weight$")


def v3_hf_name(key: str, n_layers: int, expert: int | None = None) -> str:
    """trex name of a DeepSeek-V3 family model -> the released / ``save_pretrained`` name (what
    transformers' DeepseekV3ForCausalLM, vLLM and SGLang read): ``model.`` prefixed module names, routed
    experts one by one (``mlp.experts.7.gate_proj.weight``: a stacked key needs ``expert``), the gate bias as
    ``e_score_correction_bias``, MTP module j as ``model.layers.{n_layers + j}`` with its norm as
    ``shared_head.norm``. ``V3Names.trex_targets`` reads every name back to ``key``."""
    key = unstacked(key, expert) or key
    for pattern, repl in _TO_HF:
        key = pattern.sub(repl, key)
    m = _MTP.match(key)
    if m:
        key = f"layers.{n_layers + int(m.group(1))}.{m.group(2)}"
    return key if key.startswith("lm_head.") else "model." + key


def _key(name: str, layout: str, n_layers: int | None) -> str:
    """``name`` without ``model.``, the MTP layer(s) (released after the last layer) as ``mtp.j``."""
    key = strip_model(name, layout)
    m = _LAYER.match(key)
    if m and n_layers is not None and int(m.group(1)) >= n_layers:
        key = f"mtp.{int(m.group(1)) - n_layers}.{m.group(2)}"
    return re.sub(r"^(mtp\.\d+)\.mtp_block\.", r"\1.", key)  # transformers' MtpLayer keeps the block apart


class V3Names(CheckpointNames):
    """The DeepSeek-V3 family's checkpoints (this module's docstring); ``n_layers`` (num_hidden_layers) tells
    the MTP layer apart."""

    released_layout = "hf"

    def layout_refused(self, layout: str) -> str | None:
        if layout != "hf":
            return (f"DeepSeek-V3 family checkpoints are written in the hf layout (the released names), "
                    f"not {layout!r}")
        return None

    def trex_targets(self, name: str, layout: str, n_layers: int | None) -> list[Target]:
        key = _key(name, layout, n_layers)
        if _SKIP.search(key) or _COPIES.match(key):
            return []
        if layout != "official":
            for pattern, repl in _FROM_HF:
                key = pattern.sub(repl, key)
        return expert_targets(key, layout)

    def mtp_copy_of(self, name: str, layout: str, n_layers: int | None) -> str | None:
        m = _COPIES.match(_key(name, layout, n_layers))
        return None if m is None else "head.weight" if m.group(1).endswith("head") else "embed.weight"

    def written_name(self, key: str, layout: str, n_layers: int | None, expert: int | None = None) -> str:
        if layout == "official":
            return unstacked(key, expert) or key
        if n_layers is None:
            raise ValueError("a DeepSeek-V3 family model's names need n_layers (its num_hidden_layers)")
        return v3_hf_name(key, n_layers, expert)

    def mtp_copies(self, n_layers: int, j: int) -> list[tuple[str, str]]:
        """(released name, trex key) of MTP module j's copies of the embedding and head, which DeepSeek's
        releases store in the MTP layer ``model.layers.{n_layers + j}``."""
        layer = f"model.layers.{n_layers + j}"
        return [(f"{layer}.embed_tokens.weight", "embed.weight"),
                (f"{layer}.shared_head.head.weight", "head.weight")]

    def codec(self, key: str, quantize: str, scale_fmt: str | None) -> str:
        if quantize != "fp8":
            raise ValueError(f"the DeepSeek-V3 family is released as FP8 (quantize 'fp8'), not {quantize!r}")
        fp8 = "fp8/fp32-ue8m0" if scale_fmt == "ue8m0" else "fp8/fp32"
        return fp8 if STACKED.match(key) or _FP8_LINEARS.search(key) else "plain"

    def keeps_fp32(self, key: str) -> bool:
        return key.endswith(".gate.bias")

    def quantization_config(self, quantize: str) -> dict:
        """As DeepSeek-V3 / R1 and Kimi-K2 release it: fp32 scales, no scale_fmt."""
        from trex.kernels.quantize import FP8_BLOCK  # torch: only to write a quantised checkpoint

        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}


V3_NAMES = V3Names()
