"""What code outside a family may know of one architecture: the interface each family fills.

A family package (``trex.models.deepseek_v4``, ``trex.models.deepseek_v3``) declares one
:class:`Architecture` per config ``architecture`` it defines, in its ``spec`` module; ``trex.models.registry``
collects them. Everything else in trex (checkpoints, parallelism, the planner, the profiler, the loop) reaches a
family only through its Architecture: never by importing the family's modules. So a new family adds its package
and one line in the registry.

Implementations are named as ``"module:attribute"`` (or ``"module"``) strings and imported on use
(:meth:`Architecture.load`), so that reading the registry needs no torch.

Contracts of what the strings name:

    model            class: ``Model(cfg)`` -> nn.Module returning ``trex.models.common.heads.ModelOutput``
    decode_cache     class: ``Cache(max_new_tokens)``, the sampler's incremental generation state
    split_rule       module: ``check_shardable(cfg, seq_len, shards)`` (ValueError naming lengths that work) and
                     ``shardable_length(cfg, length, shards) -> int``, the context-parallel split rule
    flops            function: ``flops(cfg, seq_len, training, with_mtp) -> trex.models.common.flops.FlopsPerToken``
    plan_terms       module: the planner's memory and time terms of the family (trex.plan reads them; the
                     functions it calls are listed in trex.models.common.plan_terms)
    checkpoint_names object: a ``trex.models.common.checkpoint_names.CheckpointNames``, what trex.checkpoint
                     asks of the architecture's checkpoints: its tensor names in each layout (read and
                     written), the layouts it is written in and the one engines read, each tensor's on-disk
                     precision under a ``quantize`` mode and config.json's ``quantization_config`` (the
                     contract: that module's docstring)
    tokenizer_map    function or None: ``tokenizer_map(cfg, tokenizer) -> TokenMap | None`` (a
                     ``tokenizers.Tokenizer``), for a model that hashes token ids through its tokenizer (V4.1's
                     Engram; None when ``cfg``'s model does not); the model then takes it with
                     ``model.set_engram_token_map(token_map, compressed_vocab)``
    drafter          class or None: the drafter a checkpoint carries besides the model (V4.1's DSpark stages),
                     ``Drafter(cfg)``, loaded frozen by trex.checkpoint.load.load_drafter
    params           function or None: ``params(cfg, model, counted) -> trex.models.common.params.ParamCount``,
                     the count read from the model (trex.models.params) corrected for what the model alone does not
                     say (V4.1: Engram rows a token does not read, the DSpark stages it does not build)
    tp_plan          module or None: ``TP_PLAN``, what tensor parallelism splits, as data (module-path patterns ->
                     styles; trex.parallel.tensor_parallel applies it); None: the family has no plan yet
    official_config  function or None: ``official_config(cfg, hf_dict) -> dict``, the config.json of the
                     "official" checkpoint layout from the transformers one (None: the same)
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple


class TokenMap(NamedTuple):
    """What ``Architecture.tokenizer_map`` makes of a tokenizer: each token id's compressed id, the number of
    compressed ids, and the config fields that number fixes (set on a config built fresh, e.g. from a preset)."""

    token_map: list[int]
    compressed_vocab: int
    overrides: dict


@dataclass(frozen=True)
class Architecture:
    """One architecture (a config's ``architecture``) and where its implementations live.

    ``passthrough``: the checkpoint tensors this architecture carries untrained (V4.1's vision tower and DSpark
    stages), written back as they were read; None when it has none. ``drafter_kind(cfg)``: which drafter a
    config's model has for speculative decoding ("dspark", "mtp") or None."""

    name: str
    model: str
    decode_cache: str
    split_rule: str
    flops: str
    plan_terms: str
    checkpoint_names: str
    drafter_kind: Callable[[object], str | None]
    passthrough: re.Pattern | None = None
    tokenizer_map: str | None = None
    drafter: str | None = None
    params: str | None = None
    tp_plan: str | None = None
    official_config: str | None = None

    def load(self, part: str):
        """The object ``part`` (a field naming an implementation) names, imported now; None for an unset
        optional part."""
        target = getattr(self, part)
        if target is None:
            return None
        module, _, name = target.partition(":")
        loaded = importlib.import_module(module)
        return getattr(loaded, name) if name else loaded


def mtp_drafter(cfg) -> str | None:
    """``Architecture.drafter_kind`` of a family whose drafter is its MTP modules (one token drafted per module)."""
    return "mtp" if cfg.num_nextn_predict_layers else None
