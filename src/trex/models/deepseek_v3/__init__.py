"""The DeepSeek-V3 family (V3 / R1 / V3.1, V3.2's config, Kimi-K2, Moonlight), built over the shared parts
(``trex.models.common``) and nothing of another family's.

    spec.py       the V3 Architecture (trex.models.common.architecture): what code outside reads
    config.py     V3Config, YarnMScale, the presets, config.json detection (no torch)
    attention.py  MLA in its MHA form for training
    model.py      Block (dense or MoE), MTPLayer, DeepseekV3
    decode.py     V3DecodeCache: the MLA latents per token, the absorbed decode step
    flops.py      FLOPs per token
    plan_terms.py the planner's memory and time terms (no torch)
    checkpoint_names.py  the checkpoint tensor names (released, transformers', DeepSeek's) and on-disk
                  precision (no torch)

The names load on first use (trex.lazy): the config's arithmetic does not import torch.
"""

from trex.lazy import lazy_exports

__all__ = ["DeepseekV3", "MLA", "V3Config", "V3DecodeCache", "V3_PRESETS", "YarnMScale", "is_v3"]
__getattr__ = lazy_exports(__name__, {
    "V3Config": "config", "V3_PRESETS": "config", "YarnMScale": "config", "is_v3": "config", "MLA": "attention",
    "DeepseekV3": "model", "V3DecodeCache": "decode"})
