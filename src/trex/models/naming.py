"""Tensor names of every DeepSeek-V4 layout -> trex names.

trex names follow the official checkpoint (``layers.3.attn.wq_a.weight``, no ``model.`` prefix),
with mHC parameters as modules (``layers.3.hc_attn.fn`` for ``hc_attn_fn``) and routed experts
stacked per layer (``layers.3.ffn.experts.w1`` [E, I, d]). Three layouts are read:

- official (the released checkpoints): ``layers.3.ffn.experts.7.w1.weight`` ...;
- what ``transformers`` 5.x writes with ``save_pretrained``: the official names under a
  ``model.`` prefix, ``model.embed_tokens``, ``model.hc_head.hc_fn`` and, for the attention
  kv norm, ``attn.norm.weight``;
- transformers module names (a raw ``state_dict``): ``model.layers.3.self_attn.q_a_proj.weight``,
  fused ``mlp.experts.gate_up_proj`` [E, 2I, d] (w1 rows, then w3) and ``mlp.experts.down_proj``.
"""

from __future__ import annotations

import re

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
_FROM_HF_MODULES = [(re.compile(p), r) for p, r in _FROM_HF_MODULES]
_FROM_OFFICIAL = [(re.compile(p), r) for p, r in _FROM_OFFICIAL]
_EXPERT = re.compile(r"^(.*\.ffn\.experts)\.(\d+)\.(w[123])\.weight$")
_GATE_UP = re.compile(r"^(.*\.ffn\.experts)\.gate_up_proj$")


def to_trex(name: str, tensor: torch.Tensor) -> list[tuple[str, int | None, torch.Tensor]]:
    """One checkpoint tensor -> [(trex name, expert index or None, tensor)].

    An expert index J means the tensor fills slice J of a stacked [E, ...] expert parameter.
    The fused transformers gate/up tensor yields two entries (w1 and w3, all experts).
    """
    key = name[len("model."):] if name.startswith("model.") else name
    for pattern, repl in _FROM_HF_MODULES:
        key = pattern.sub(repl, key)
    for pattern, repl in _FROM_OFFICIAL:
        key = pattern.sub(repl, key)
    m = _GATE_UP.match(key)
    if m:
        inter = tensor.shape[1] // 2
        return [(f"{m.group(1)}.w1", None, tensor[:, :inter]), (f"{m.group(1)}.w3", None, tensor[:, inter:])]
    m = _EXPERT.match(key)
    if m:
        return [(f"{m.group(1)}.{m.group(3)}", int(m.group(2)), tensor)]
    return [(key, None, tensor)]
