"""The DSpark drafter's re-fit (``[drafter]``, trex.train.drafter_refit): its training forward against the
decode-time drafts, the recipe section, the re-fit in the training loop (resume, export) and the acceptance
it restores (a tiny V4.1 whose target is post-trained away from its drafter)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open
from test_model_v41 import DSPARK, official_drafter, official_model

from trex.train.drafter_refit import DrafterSection


def test_the_training_forward_drafts_what_each_decode_step_drafts():
    """``DSparkDrafter.forward`` (every anchor of a left-padded sequence at once, teacher-forced) gives each
    anchor's logits (Markov bias included) and confidences that ``draft`` computes at that decode step, fed
    the same token, hidden and previous tokens: within 1e-5 relative in fp32 on the official fixture's
    weights, the window (8) wrapping, a padded row masking its padding."""
    with safe_open(DSPARK, "pt") as f:
        tensors, meta = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    model = official_model(tensors, meta)
    drafter = official_drafter(tensors, model.cfg)
    ids = tensors["input_ids"]
    B, N = ids.shape
    T = drafter.cfg.dspark_block_size
    positions = torch.arange(N)[None] - torch.tensor([0, 3])[:, None]  # row 1: three tokens of padding
    with torch.no_grad():
        hidden = model(ids, doc_ids=(positions >= 0).long(), tap_layers=drafter.target_layers).hidden
        start, anchors = 4, 9  # anchors 4 .. 12: the window (8) wraps
        logits, confidence = drafter(hidden, ids, positions, start, anchors, model.embed.weight, model.head.weight)
        cache = drafter.prefill(hidden[:, :start], positions[:, :start])
        for a in range(anchors):
            j = start + a
            fed = iter(range(j + 2, j + 2 + T))
            d = drafter.draft(cache, ids[:, j + 1], hidden[:, j], model.embed, model.head.weight,
                              sample=lambda z: ids[:, next(fed)])  # the verified tokens before each position
            assert (d.logits - logits[:, a]).abs().max() <= 1e-5 * d.logits.abs().max(), a
            assert (d.confidence - confidence[:, a]).abs().max() <= 1e-5 * d.confidence.abs().max(), a
    with pytest.raises(ValueError, match="need ids up to"):
        drafter(hidden, ids, positions, N - T - 1, 1, model.embed.weight, model.head.weight)


@pytest.mark.parametrize("key, value, message", [
    ("steps", 0, "drafter.steps = 0; expected an integer >= 1"),
    ("every_n", -1, "drafter.every_n = -1; expected an integer >= 0"),
    ("tv", -0.5, "drafter.tv = -0.5; expected a value >= 0"),
    ("sampling", "beam", "drafter.sampling = 'beam'; expected one of greedy, sampled"),
    ("temperature", 0.0, "drafter.temperature = 0.0; expected a value > 0"),
])
def test_the_section_names_the_key_it_refuses(key, value, message):
    with pytest.raises(ValueError) as e:
        DrafterSection(**{key: value})
    assert str(e.value).startswith(message) and "\n" not in str(e.value)
    with pytest.raises(ValueError, match="all 0"):
        DrafterSection(ce=0, tv=0, confidence=0)
    assert (DrafterSection().ce, DrafterSection().tv, DrafterSection().confidence) == (0.1, 0.9, 1.0)
