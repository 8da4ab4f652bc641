"""Checkpoints on disk: HF and official safetensors layouts with FP8/FP4, streaming convert,
inspect and load (``load_pretrained``, ``save_pretrained``), and the training state (DCP shards,
manifest, verify, resume, export: ``trex.checkpoint.training``).

The names load on first use (trex.lazy): ``trex ckpt --help`` does not import torch.
"""

from trex.lazy import lazy_exports

__all__ = ["CheckpointError", "load_pretrained", "save_pretrained"]
__getattr__ = lazy_exports(__name__, {"CheckpointError": "errors", "load_pretrained": "load",
                                      "save_pretrained": "save"})
