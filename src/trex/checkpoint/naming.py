"""Tensor names of every DeepSeek-V4 layout <-> trex names.

trex names follow the official checkpoint (``layers.3.attn.wq_a.weight``, no ``model.`` prefix),
with mHC parameters as modules (``layers.3.hc_attn.fn`` for ``hc_attn_fn``) and routed experts
stacked per layer (``layers.3.ffn.experts.w1`` [E, I, d]). Three layouts are read:

- official (the released checkpoints): ``layers.3.ffn.experts.7.w1.weight`` ...;
- what ``transformers`` 5.x writes with ``save_pretrained``: the official names under a
  ``model.`` prefix, ``model.embed_tokens``, ``model.hc_head.hc_fn`` and, for the attention
  kv norm, ``attn.norm.weight``;
- transformers module names (a raw ``state_dict``): ``model.layers.3.self_attn.q_a_proj.weight``,
  fused ``mlp.experts.gate_up_proj`` [E, 2I, d] (w1 rows, then w3) and ``mlp.experts.down_proj``.

Two are written: ``official`` and ``hf`` (the transformers module names, which transformers
loads as they are; MTP tensors, which transformers ignores, keep an unprefixed ``mtp.0.``).
FP8/FP4 scales sit next to their weight: ``X.scale`` (official) or ``X.weight_scale_inv``
(HF / V3 style; ``X_scale_inv`` for a fused expert tensor ``X``).

The DeepSeek-V3 family (``arch="deepseek_v3"``) has its own tables: trex names are
DeepSeek's inference names (its ``convert.py``: ``layers.5.attn.wkv_a.weight``, ``layers.5.ffn.w1.weight``,
``layers.5.ffn.gate.bias``), routed experts stacked, and the MTP layer, released as
``model.layers.{num_hidden_layers + j}``, as ``mtp.j`` (its ``shared_head.norm`` as ``mtp.j.norm``; its
copies of ``embed_tokens`` and ``shared_head.head`` fill nothing: trex shares the main model's, and
``mtp_copy_of`` names what each duplicates, for the reader to check). Read: the released /
``save_pretrained`` names (per-expert ``mlp.experts.E.gate_proj``), transformers' module names (fused
``gate_up_proj``, 3-D ``down_proj``) and DeepSeek's own names. Written (``v3_hf_name``, layout "hf"): the
released names, the MTP layer with its copies of the embedding and head (``v3_mtp_copies``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

# transformers module names -> official names (the inverse of transformers' conversion mapping).
_FROM_HF_MODULES = [
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
]
# official names -> trex names.
_FROM_OFFICIAL = [
    (r"(^|\.)hc_head_(fn|base|scale)$", r"\1hc_head.\2"),
    (r"\.hc_(attn|ffn)_(fn|base|scale)$", r".hc_\1.\2"),
    (r"\.attn\.norm\.weight$", ".attn.kv_norm.weight"),  # transformers' save_pretrained writes this
]
# official names -> transformers module names (transformers' conversion mapping, in order).
_TO_HF_MODULES = [
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
]
# trex names -> official names.
_TO_OFFICIAL = [
    (r"(^|\.)hc_head\.(fn|base|scale)$", r"\1hc_head_\2"),
    (r"\.hc_(attn|ffn)\.(fn|base|scale)$", r".hc_\1_\2"),
]
_FROM_HF_MODULES = [(re.compile(p), r) for p, r in _FROM_HF_MODULES]
_FROM_OFFICIAL = [(re.compile(p), r) for p, r in _FROM_OFFICIAL]
_TO_HF_MODULES = [(re.compile(p), r) for p, r in _TO_HF_MODULES]
_TO_OFFICIAL = [(re.compile(p), r) for p, r in _TO_OFFICIAL]
_EXPERT = re.compile(r"^(.*\.ffn\.experts)\.(\d+)\.(w[123])\.weight$")
_GATE_UP = re.compile(r"^(.*\.ffn\.experts)\.gate_up_proj$")
_STACKED = re.compile(r"^(.*\.ffn\.experts)\.(w[123])$")

LAYOUTS = ("official", "hf")

# ---- the DeepSeek-V3 family --------------------------------------------------------------------
V3_ARCHITECTURES = ("deepseek_v3",)
# transformers / released names (``model.`` stripped, MTP already renumbered) -> DeepSeek's names; anchored
# on whole components (DeepSeek's convert.py replaces substrings)
_V3_FROM_HF = [(re.compile(p), r) for p, r in [
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
_V3_LAYER = re.compile(r"^layers\.(\d+)\.(.*)$")
# the MTP layer's copies of the embedding and head (trex shares the main model's: ``mtp_copy_of``)
_V3_COPIES = re.compile(r"^mtp\.\d+\.(embed_tokens|embed|shared_head\.head)\.weight$")
_V3_SKIP = re.compile(r"\.rotary_emb\.inv_freq$")  # Kimi-K2's stored RoPE frequencies: not loaded


# DeepSeek's names -> transformers / released names (written); the inverse of _V3_FROM_HF on trex's keys
_V3_TO_HF = [(re.compile(p), r) for p, r in [
    (r"^embed\.", "embed_tokens."),
    (r"^head\.", "lm_head."),
    (r"\.attn_norm\.", ".input_layernorm."),
    (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.attn\.", ".self_attn."),
    (r"\.ffn\.", ".mlp."),
    (r"\.wq\.", ".q_proj."),
    (r"\.wq_a\.", ".q_a_proj."),
    (r"\.q_norm\.", ".q_a_layernorm."),
    (r"\.wq_b\.", ".q_b_proj."),
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


def v3_hf_name(key: str, n_layers: int, expert: int | None = None) -> str:
    """trex name of a DeepSeek-V3 family model -> the released / ``save_pretrained`` name (what
    transformers' DeepseekV3ForCausalLM, vLLM and SGLang read): ``model.`` prefixed module names, routed
    experts one by one (``mlp.experts.7.gate_proj.weight``: a stacked key needs ``expert``), the gate bias as
    ``e_score_correction_bias``, MTP module j as ``model.layers.{n_layers + j}`` with its norm as
    ``shared_head.norm``. ``trex_targets(..., arch="deepseek_v3")`` reads every name back to ``key``."""
    m = _STACKED.match(key)
    if m:
        if expert is None:
            raise ValueError(f"{key} is a stacked expert tensor: name one expert")
        key = f"{m.group(1)}.{expert}.{m.group(2)}.weight"
    for pattern, repl in _V3_TO_HF:
        key = pattern.sub(repl, key)
    m = re.match(r"^mtp\.(\d+)\.(.*)$", key)
    if m:
        key = f"layers.{n_layers + int(m.group(1))}.{m.group(2)}"
    return key if key.startswith("lm_head.") else "model." + key


def v3_mtp_copies(n_layers: int, j: int) -> list[tuple[str, str]]:
    """(released name, trex key) of MTP module j's copies of the embedding and head, which DeepSeek's
    releases store in the MTP layer ``model.layers.{n_layers + j}`` (trex shares the main model's)."""
    layer = f"model.layers.{n_layers + j}"
    return [(f"{layer}.embed_tokens.weight", "embed.weight"), (f"{layer}.shared_head.head.weight", "head.weight")]


@dataclass(frozen=True)
class Target:
    """Where a checkpoint tensor goes: trex ``key``; ``expert`` J fills slice J of a stacked
    [E, ...] parameter; ``half`` h takes half h of dim 1 (the fused transformers gate/up)."""

    key: str
    expert: int | None = None
    half: int | None = None


def detect_layout(names: list[str]) -> str:
    """``hf`` if any name has the transformers ``model.`` / ``lm_head.`` prefix, else ``official``."""
    return "hf" if any(n.startswith(("model.", "lm_head.")) for n in names) else "official"


def trex_targets(name: str, layout: str = "auto", arch: str = "deepseek_v4", n_layers: int | None = None
                 ) -> list[Target]:
    """Where checkpoint tensor ``name`` goes (none: a tensor trex does not load). ``layout`` "official"
    applies only the official renames; "hf" and "auto" also strip ``model.`` and undo the transformers
    module names. ``arch``: the config's architecture (DeepSeek-V3's family has its own names and needs
    ``n_layers``, its num_hidden_layers, to tell the MTP layer apart)."""
    if arch in V3_ARCHITECTURES:
        return _v3_targets(name, layout, n_layers)
    key = name
    if layout != "official":
        key = name[len("model."):] if name.startswith("model.") else name
        for pattern, repl in _FROM_HF_MODULES:
            key = pattern.sub(repl, key)
    for pattern, repl in _FROM_OFFICIAL:
        key = pattern.sub(repl, key)
    return _expert_targets(key, layout)


def _expert_targets(key: str, layout: str) -> list[Target]:
    """A trex-named ``key``'s targets: transformers' fused gate_up halves (w1, w3), one routed expert's
    slice of the stacked tensor, or the key itself."""
    m = _GATE_UP.match(key)
    if m and layout != "official":
        return [Target(f"{m.group(1)}.w1", half=0), Target(f"{m.group(1)}.w3", half=1)]
    m = _EXPERT.match(key)
    if m:
        return [Target(f"{m.group(1)}.{m.group(3)}", expert=int(m.group(2)))]
    return [Target(key)]


def mtp_copy_of(name: str, layout: str = "auto", arch: str = "deepseek_v4", n_layers: int | None = None
                ) -> str | None:
    """The trex key (``embed.weight`` or ``head.weight``) that checkpoint tensor ``name`` duplicates: a
    DeepSeek-V3 family MTP layer's ``embed_tokens`` / ``shared_head.head``; None for any other tensor."""
    if arch not in V3_ARCHITECTURES:
        return None
    m = _V3_COPIES.match(_v3_key(name, layout, n_layers))
    return None if m is None else "head.weight" if m.group(1).endswith("head") else "embed.weight"


def _v3_key(name: str, layout: str, n_layers: int | None) -> str:
    """``name`` without ``model.``, the MTP layer(s) (released after the last layer) as ``mtp.j``."""
    key = name[len("model."):] if layout != "official" and name.startswith("model.") else name
    m = _V3_LAYER.match(key)
    if m and n_layers is not None and int(m.group(1)) >= n_layers:
        key = f"mtp.{int(m.group(1)) - n_layers}.{m.group(2)}"
    return re.sub(r"^(mtp\.\d+)\.mtp_block\.", r"\1.", key)  # transformers' MtpLayer keeps the block apart


def _v3_targets(name: str, layout: str, n_layers: int | None) -> list[Target]:
    key = _v3_key(name, layout, n_layers)
    if _V3_SKIP.search(key) or _V3_COPIES.match(key):
        return []
    if layout != "official":
        for pattern, repl in _V3_FROM_HF:
            key = pattern.sub(repl, key)
    return _expert_targets(key, layout)


def to_trex(name: str, tensor: torch.Tensor, layout: str = "auto", arch: str = "deepseek_v4",
            n_layers: int | None = None) -> list[tuple[str, int | None, torch.Tensor]]:
    """One checkpoint tensor -> [(trex name, expert index or None, tensor)] (none: not loaded).

    An expert index J means the tensor fills slice J of a stacked [E, ...] expert parameter.
    The fused transformers gate/up tensor yields two entries (w1 and w3, all experts).
    """
    out = []
    for t in trex_targets(name, layout, arch, n_layers):
        value = tensor
        if t.half is not None:
            inter = tensor.shape[1] // 2
            value = tensor[:, t.half * inter:(t.half + 1) * inter]
        out.append((t.key, t.expert, value))
    return out


def official_name(key: str, expert: int | None = None) -> str:
    """trex name -> official name; a stacked expert key needs the expert index."""
    m = _STACKED.match(key)
    if m:
        if expert is None:
            raise ValueError(f"{key} is a stacked expert tensor: name one expert")
        return f"{m.group(1)}.{expert}.{m.group(2)}.weight"
    for pattern, repl in _TO_OFFICIAL:
        key = pattern.sub(repl, key)
    return key


def hf_name(key: str) -> str:
    """trex name -> transformers module name. Stacked experts map to the fused tensors: w1 and w3
    both to ``gate_up_proj`` (w1 rows first), w2 to ``down_proj``."""
    m = _STACKED.match(key)
    if m:
        base, which = m.group(1), m.group(2)
        name = f"{base}.{'down_proj' if which == 'w2' else 'gate_up_proj'}"
    else:
        name = official_name(key)
    for pattern, repl in _TO_HF_MODULES:
        name = pattern.sub(repl, name)
    return name if name.startswith(("mtp.", "lm_head.")) else "model." + name


def scale_name(weight_name: str, layout: str) -> str:
    """The name of the block scale of ``weight_name`` in ``layout``."""
    if layout == "official":
        return weight_name[: -len(".weight")] + ".scale" if weight_name.endswith(".weight") else weight_name + ".scale"
    return weight_name + "_scale_inv"


def scale_candidates(weight_name: str) -> tuple[str, ...]:
    """Names under which any layout stores the block scale of ``weight_name``."""
    return tuple(dict.fromkeys((scale_name(weight_name, "official"), scale_name(weight_name, "hf"))))
