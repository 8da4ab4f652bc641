"""trex: full-parameter post-training of DeepSeek-V4-class MoE models on any accelerator."""

__version__ = "0.1.0"
