"""Greedy decoding with the trex model (evaluation of the default job and recipes).

Prompts of different lengths share one batch: each row is left-padded and the padding is its own
document (``doc_ids`` 0, the prompt is document 1), so padding never enters attention or a
compression window and the prompt's positions start at 0. Each new token re-runs the full
sequence (no incremental cache yet), which is fine for short evaluation answers.
"""

from __future__ import annotations

import torch

from trex.models import DeepseekV4


@torch.no_grad()
def greedy_generate(model: DeepseekV4, prompts: list[list[int]], max_new_tokens: int, stop_id: int,
                    pad_id: int, batch_size: int = 64) -> list[list[int]]:
    """Generated ids per prompt (stop token excluded), at most ``max_new_tokens`` each."""
    was_training = model.training
    model.eval()
    device = model.embed.weight.device
    results: list[list[int]] = []
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start:start + batch_size]
        width = max(len(p) for p in chunk)
        ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        docs = torch.zeros((len(chunk), width), dtype=torch.long)
        for i, p in enumerate(chunk):
            ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
            docs[i, width - len(p):] = 1
        ids, docs = ids.to(device), docs.to(device)
        done = torch.zeros(len(chunk), dtype=torch.bool, device=device)
        new = []
        for _ in range(max_new_tokens):
            next_ids = model(ids, doc_ids=docs).logits[:, -1].argmax(dim=-1)
            next_ids = torch.where(done, torch.full_like(next_ids, stop_id), next_ids)
            new.append(next_ids)
            done |= next_ids == stop_id
            if bool(done.all()):
                break
            ids = torch.cat([ids, next_ids[:, None]], dim=1)
            docs = torch.cat([docs, torch.ones_like(next_ids)[:, None]], dim=1)
        generated = torch.stack(new, dim=1).tolist() if new else [[] for _ in chunk]
        for row in generated:
            results.append(row[: row.index(stop_id)] if stop_id in row else row)
    model.train(was_training)
    return results
