"""Name the model's parts in a profile: each module a class cares about runs inside a
``torch.profiler.record_function("trex/<scope>")`` range, so the ops under it (and, through autograd's
sequence numbers, their backward) can be classed.

The model is not changed: forward pre-/post-hooks open and close the ranges, and ``label_model``
returns a handle that removes them. Inside a compiled region the hooks do nothing (they would break
the graph); a compiled block's fused kernels are classed by their own names (trex.profile.classes).

Scopes (the part of the model a module is). A family's module names its own with a ``profile_scope`` attribute
(a string; a property where it depends on the layer); the shared parts are known by class:

    attention/<kind>   an attention layer, with its compressor and indexer: sliding, csa, hca (V4,
                       V4.1), mla (V3), dsa (V3.2's indexer + sparse MLA), dspark (the drafter)
    linear             a dense projection (nn.Linear, trex's QuantLinear)
    ffn                a dense SwiGLU (a dense layer's MLP, a shared expert): its activation
    moe/route          the router (scores, bias, top-k)
    moe/experts        the routed experts: sort by expert, grouped GEMMs, combine
    moe/dispatch       the MoE layer around them (weights, the shared expert's sum)
    norm_mhc           RMSNorm, LayerNorm and the mHC hyper-connections (V4, V4.1)
    embedding          the token embedding
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from trex.models.common.moe import Experts, Gate, MoE, SharedExpert
from trex.models.common.norm import LayerNorm, RMSNorm

PREFIX = "trex/"


def scope_of(module: nn.Module) -> str | None:
    """The scope ``module`` opens, or None for a module that is only a container. A family's own modules name
    theirs (``profile_scope``: its attention layers, V4's hyper-connections); the shared parts by class."""
    own = getattr(module, "profile_scope", None)
    if own is not None:
        return own
    if isinstance(module, nn.Linear):
        return "linear"
    if isinstance(module, SharedExpert):
        return "ffn"
    if isinstance(module, Gate):
        return "moe/route"
    if isinstance(module, Experts):
        return "moe/experts"
    if isinstance(module, MoE):
        return "moe/dispatch"
    if isinstance(module, (RMSNorm, LayerNorm)):
        return "norm_mhc"
    if isinstance(module, nn.Embedding):
        return "embedding"
    return None


class Labels:
    """The hooks ``label_model`` installed; ``remove()`` takes them all off."""

    def __init__(self, handles: list):
        self.handles = handles

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()

    def __enter__(self) -> Labels:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def label_model(model: nn.Module) -> Labels:
    """Open a ``trex/<scope>`` profiler range around the forward of every module with a scope.

    Ranges nest like the modules; a forward that raises closes its range too."""
    handles = []
    for module in model.modules():
        scope = scope_of(module)
        if scope is None:
            continue
        opened: list = []
        handles.append(module.register_forward_pre_hook(_opener(PREFIX + scope, opened)))
        handles.append(module.register_forward_hook(_closer(opened), always_call=True))
    return Labels(handles)


def _opener(name: str, opened: list) -> Callable:
    def pre_hook(module, args):
        if torch.compiler.is_compiling():
            return
        rf = torch.profiler.record_function(name)
        rf.__enter__()
        opened.append(rf)
    return pre_hook


def _closer(opened: list) -> Callable:
    def post_hook(module, args, output):
        if torch.compiler.is_compiling() or not opened:
            return
        opened.pop().__exit__(None, None, None)
    return post_hook
