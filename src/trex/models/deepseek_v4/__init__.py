"""DeepSeek-V4 (Flash / Pro) and DeepSeek-V4.1 (Flash), built over the shared parts (``trex.models.common``)
and nothing of another family's. A file is one concern; V4.1's variant of a concern is ``<concern>_v41``,
built on V4's.

    spec.py           the V4 and V4.1 Architectures (trex.models.common.architecture): what code outside reads
    config.py         ModelConfig, the presets, config.json reading (and the official one), the context-parallel split rule
                      (shard_halo, check_shardable) (no torch)
    config_v41.py     V41Config: V4.1's additions (CSA2 ratios, KV/index sources, Engram, DSpark stages) (no torch)
    context.py        SeqContext: the compressed-window layouts (WindowLayout) and halos of one forward
    compressor.py     V4's compressor (CSA's overlapping windows, HCA) and lightning indexer
    attention.py      V4's attention (sliding, CSA, HCA), the sparse attention core, the shared projections
    attention_v41.py  V4.1's attention (CSA2): its compressor, indexer and candidate pool, Shared
    mhc.py            the hyper-connections (HyperConnection, HyperHead); V4 runs them in two passes per
                      sublayer, V4.1 in one (model_v41.Block)
    model.py          Block, MTPBlock, DeepseekV4
    model_v41.py      Block (Engram, single-pass mHC), Taps, DeepseekV41
    decode.py         DecodeCache: V4's incremental generation
    decode_v41.py     V41DecodeCache
    engram.py         Engram (V4.1's n-gram memory), NgramHasher, the tokenizer's compressed token map
    engram_layout.py  EngramLayout: the tables' bucket layout (no torch)
    dspark.py         DSparkDrafter: V4.1's speculative-decoding stages
    flops.py          FLOPs per token (V4, V4.1)
    params_v41.py     V4.1's parameter-count correction (Engram rows read, the DSpark stages) (no torch)
    plan_terms.py     the planner's memory and time terms (V4, V4.1) (no torch)
    checkpoint_names.py  V4's and V4.1's checkpoint tensor names in each layout and on-disk precision (no torch)

The names load on first use (trex.lazy): the configs' arithmetic does not import torch.
"""

from trex.lazy import lazy_exports

__all__ = ["DecodeCache", "DeepseekV4", "DeepseekV41", "ModelConfig", "PRESETS", "V41Config", "V41DecodeCache",
           "V41_PRESETS"]
__getattr__ = lazy_exports(__name__, {
    "ModelConfig": "config", "PRESETS": "config", "V41Config": "config_v41", "V41_PRESETS": "config_v41",
    "DeepseekV4": "model", "DeepseekV41": "model_v41", "DecodeCache": "decode", "V41DecodeCache": "decode_v41"})
