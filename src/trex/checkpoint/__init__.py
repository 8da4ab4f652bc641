"""Checkpoints on disk: HF and official safetensors layouts with FP8/FP4, streaming convert,
inspect and load (``load_pretrained``, ``save_pretrained``), and the training state (DCP shards,
manifest, verify, resume, export: ``trex.checkpoint.training``)."""

from trex.checkpoint.errors import CheckpointError
from trex.checkpoint.load import load_pretrained
from trex.checkpoint.save import save_pretrained

__all__ = ["CheckpointError", "load_pretrained", "save_pretrained"]
