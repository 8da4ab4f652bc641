"""The models trex trains: ``common/`` (the parts the families share), one package per family
(``deepseek_v4/``: DeepSeek-V4 and V4.1; ``deepseek_v3/``: the V3 family), and what dispatches over every
family: ``registry`` (presets, config.json dispatch, each architecture's model class and decode cache),
``build`` (a fresh model of any config), ``params``, ``flops``, ``modes``. Checkpoints on disk:
trex.checkpoint.

The names load on first use (trex.lazy): what needs only configurations does not import torch.
"""

from trex.lazy import lazy_exports

__all__ = ["ConfigError", "Model", "ModelOutput", "build_model", "count_parameters", "evaluating", "get_preset"]
__getattr__ = lazy_exports(__name__, {
    "ConfigError": "common.config", "Model": "common.heads", "ModelOutput": "common.heads", "get_preset": "registry",
    "build_model": "build", "evaluating": "modes", "count_parameters": "params"})
