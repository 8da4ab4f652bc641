"""Greedy decoding with the trex model (evaluation of the default job and recipes).

A thin wrapper over :func:`trex.rollout.sample` at temperature 0; see that module for batching,
left padding and the cache.
"""

from __future__ import annotations

from trex.models.common.heads import Model
from trex.rollout import SamplingParams, sample


def greedy_generate(model: Model, prompts: list[list[int]], max_new_tokens: int, stop_id: int,
                    pad_id: int, batch_size: int = 64) -> list[list[int]]:
    """Generated ids per prompt (stop token excluded), at most ``max_new_tokens`` each."""
    params = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, stop_ids=(stop_id,))
    out = sample(model, prompts, params, pad_id=pad_id, batch_size=batch_size)
    return [ids[:-1] if done else ids for ids, done in zip(out.completion_ids, out.finished)]
