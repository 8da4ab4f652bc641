"""The drafter kinds the re-fit (trex.train.drafter_refit, ``[drafter]``) trains, one module each, named by
``trex.models.registry.drafter_kind`` of the drafter's config:

    dspark.py  DeepSeek-V4.1's DSpark stages (``trex.models.deepseek_v4.dspark.DSparkDrafter``, a module of their
               own: loaded from the checkpoint, sharded like the model, exported in the released layout)
    mtp.py     the multi-token prediction modules of DeepSeek-V4 and the V3 family (``MTPDrafter``: the model's
               own ``mtp``, trained through the model's forward, exported as trex tensors)

Each module fills the same interface, which the driver calls and nothing else: ``check(section, cfg)`` the
recipe's ``[drafter]`` against the model (ValueError in one line); ``build(model, recipe, par, dev, policy)`` the
job's drafter, ready to train; ``trainable_parameters(drafter)``; ``block_size(drafter,
section)`` the tokens drafted per anchor; ``width(drafter, width, section, par)`` the continuations' prompt
width; ``target_layers(drafter)`` the target's hidden states the continuations keep (None: none);
``draft(drafter, model, c, anchors, block)`` -> (logits [B, A, T, V], confidence [B, A, T] or None) at anchors
P - 1 .. P - 2 + A of continuation ``c``; ``measure(drafter, model, prompts, section, pad_id, stop_ids, par)``
the acceptance; ``EXPORT_DIR`` and ``export(drafter, source, path, target_step, main)``.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from trex.models.registry import drafter_kind

KINDS = {"dspark": "trex.train.drafters.dspark", "mtp": "trex.train.drafters.mtp"}


def kind_of(cfg) -> ModuleType:
    """The module of the drafter kind of a config (``drafter_kind``): the model's, or a drafter's own."""
    return importlib.import_module(KINDS[drafter_kind(cfg)])
