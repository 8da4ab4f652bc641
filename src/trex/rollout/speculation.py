"""How much of its DSpark drafter's output a DeepSeek-V4.1 model accepts: speculative decoding's yield.

The drafter (``trex.models.dspark``) was trained against the released backbone's hidden states; post-
training moves them, and the drafts' acceptance with them. This measures it on greedy decoding, where a
drafted token is accepted exactly when it equals the model's own greedy token at that place and every
draft token before it was accepted: the number a speculative decoder at temperature 0 would accept. Each
decode step of the model (one token) drafts ``dspark_block_size`` tokens from the step's greedy token and
the target layers' hidden; a step counts once the row has generated every token its draft is compared
with (its stop token ends the row).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from trex.models import evaluating
from trex.models.decode_v41 import V41DecodeCache
from trex.rollout.sampling import left_pad


@dataclass
class Acceptance:
    """``histogram[a]``: drafting steps whose first a drafted tokens were accepted (a = 0 .. block size)."""

    block_size: int
    histogram: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.histogram = self.histogram or [0] * (self.block_size + 1)

    @property
    def steps(self) -> int:
        return sum(self.histogram)

    @property
    def mean_accepted(self) -> float:
        """Drafted tokens accepted per step (0 .. block size); NaN without steps."""
        return sum(a * n for a, n in enumerate(self.histogram)) / self.steps if self.steps else float("nan")

    @property
    def tokens_per_step(self) -> float:
        """Tokens a speculative decoder emits per model step: the accepted drafts plus the model's own."""
        return 1 + self.mean_accepted

    def rates(self) -> list[float]:
        """Per draft position i (0-based): the fraction of steps that accepted it (and all before it)."""
        return [sum(self.histogram[i + 1:]) / self.steps if self.steps else float("nan") for i in range(self.block_size)]

    def add(self, other: "Acceptance") -> None:
        self.histogram = [a + b for a, b in zip(self.histogram, other.histogram)]


@torch.no_grad()
def measure_acceptance(model, drafter, prompts: list[list[int]], max_new_tokens: int, pad_id: int,
                       stop_ids: tuple[int, ...] = (), batch_size: int = 16) -> Acceptance:
    """Greedy-decode up to ``max_new_tokens`` tokens per prompt (token ids) with ``model`` (a V4.1
    ``DeepseekV41``), drafting at every step with ``drafter`` (its ``DSparkDrafter``); the acceptance over
    all prompts. Reads the host once per batch, after it is decoded."""
    T = drafter.cfg.dspark_block_size
    total = Acceptance(T)
    for b in range(0, len(prompts), batch_size):
        generated, drafted = draft_steps(model, drafter, prompts[b:b + batch_size], max_new_tokens, pad_id)
        for row, row_drafts in zip(generated.tolist(), drafted.tolist()):
            n = next((i + 1 for i, t in enumerate(row) if t in stop_ids), len(row))  # tokens this row generated
            for k, draft in enumerate(row_drafts):
                if k + 1 + T >= n:  # the draft reaches past the row's end: not comparable
                    break
                truth = row[k + 2:k + 2 + T]
                total.histogram[next((i for i in range(T) if draft[i] != truth[i]), T)] += 1
    return total


@torch.no_grad()
def draft_steps(model, drafter, prompts: list[list[int]], max_new_tokens: int, pad_id: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch of prompts, left-padded, greedy-decoded against the decode cache, drafting at every step ->
    (generated [B, N] the greedy tokens g_0 ..., drafted [B, N - 1, T]: step k's draft of g_{k+2} ...
    g_{k+1+T}, made from g_{k+1} and the hidden of the step that fed g_k); N = max_new_tokens."""
    device = model.embed.weight.device
    ids, docs = left_pad(prompts, pad_id, device)
    cache = V41DecodeCache(max_new_tokens)
    taps = drafter.target_layers
    with evaluating(model):
        out = model(ids, doc_ids=docs, cache=cache, tap_layers=taps)
        positions = cache.pos[:, None] - ids.shape[1] + torch.arange(ids.shape[1], device=device)  # padding: < 0
        draft_cache = drafter.prefill(out.hidden, positions)
        tokens = [out.logits[:, -1].argmax(-1)]
        drafts = []
        for _ in range(max_new_tokens - 1):
            step = model(tokens[-1][:, None], cache=cache, tap_layers=taps)
            token = step.logits[:, -1].argmax(-1)
            drafts.append(drafter.draft(draft_cache, token, step.hidden[:, -1], model.embed, model.head.weight).ids[:, 1:])
            tokens.append(token)
    T = drafter.cfg.dspark_block_size
    drafted = torch.stack(drafts, dim=1) if drafts else torch.zeros(len(prompts), 0, T, dtype=torch.long, device=device)
    return torch.stack(tokens, dim=1), drafted
