"""How much of a drafter's output a model accepts: speculative decoding's yield.

Two drafters: DeepSeek-V4.1's DSpark stages (``trex.models.deepseek_v4.dspark``: a block of ``dspark_block_size`` tokens
per step from the target layers' hidden states) and the multi-token-prediction modules of DeepSeek-V4 and
the V3 family (``model.mtp``: module j drafts the token j + 2 ahead from the model's last stream and the
tokens before it; vLLM and SGLang serve them as a one-token-per-module drafter). Each was trained against
a backbone that post-training moves, and the drafts' acceptance moves with it. This measures it on greedy
decoding, where a drafted token is accepted exactly when it equals the model's own greedy token at that
place and every draft token before it was accepted: the number a speculative decoder at temperature 0
would accept. Each decode step of the model (one token) drafts a block from the step's greedy token; a step
counts once the row has generated every token its draft is compared with (its stop token ends the row).

An MTP draft at a verified position depends only on the verified tokens (the modules attend over the
positions before it, fed the model's streams and the tokens one ahead), so one teacher-forced forward over
the greedy continuation gives every step's draft: what the decoder drafts, step by step, when the earlier
drafts' tokens are the greedy ones, which is the only case in which the later ones count.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from trex.models import evaluating
from trex.models.registry import decode_cache, shardable_length
from trex.parallel.parameter_view import whole
from trex.rollout.sampling import SamplingParams, choose_tokens, left_pad


@dataclass
class Acceptance:
    """``histogram[a]``: drafting steps whose first a drafted tokens were accepted (a = 0 .. block size);
    ``rows``: the continuations measured, ``new_tokens``: the tokens each was continued at most, ``at_once``:
    the rows whose first token was the stop token (what ``reason`` says without steps)."""

    block_size: int
    histogram: list[int] = field(default_factory=list)
    rows: int = 0
    new_tokens: int = 0
    at_once: int = 0

    def __post_init__(self) -> None:
        self.histogram = self.histogram or [0] * (self.block_size + 1)

    @property
    def steps(self) -> int:
        return sum(self.histogram)

    @property
    def reason(self) -> str | None:
        """Why there is no measure (no drafting steps), in one line; None when there are steps."""
        if self.steps:
            return None
        T = self.block_size
        need = f"checking a draft of {T} token{'s' if T > 1 else ''} needs a continuation of {T + 2}"
        if not self.rows:
            return "no drafting steps: no prompts were measured"
        if self.new_tokens < T + 2:
            return f"no drafting steps: each prompt was continued {self.new_tokens} tokens; {need}"
        once = " at once" if self.at_once == self.rows else ""  # else each row stopped before T + 2 tokens
        return (f"no drafting steps: every prompt's continuation ended{once} with the stop token, before a draft "
                f"could be checked ({need})")

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

    def to_dict(self) -> dict:
        """As JSON holds it (summary.json, ``trex fidelity drafter --format json``): without drafting steps the
        measures are null and ``reason`` says why (null with steps)."""
        finite = self.steps > 0
        return {"steps": self.steps, "mean_accepted": self.mean_accepted if finite else None,
                "tokens_per_step": self.tokens_per_step if finite else None,
                "rates": [r if finite else None for r in self.rates()], "histogram": self.histogram,
                "reason": self.reason}

    def add(self, other: "Acceptance") -> None:
        self.histogram = [a + b for a, b in zip(self.histogram, other.histogram)]
        self.rows, self.at_once = self.rows + other.rows, self.at_once + other.at_once
        self.new_tokens = max(self.new_tokens, other.new_tokens)


@torch.no_grad()
def measure_acceptance(model, drafter, prompts: list[list[int]], max_new_tokens: int, pad_id: int,
                       stop_ids: tuple[int, ...] = (), batch_size: int = 16) -> Acceptance:
    """Greedy-decode up to ``max_new_tokens`` tokens per prompt (token ids) with ``model`` (a V4.1
    ``DeepseekV41``), drafting at every step with ``drafter`` (its ``DSparkDrafter``); the acceptance over
    all prompts. Reads the host once per batch, after it is decoded."""
    total = Acceptance(drafter.cfg.dspark_block_size)
    for b in range(0, len(prompts), batch_size):
        tally(total, *draft_steps(model, drafter, prompts[b:b + batch_size], max_new_tokens, pad_id), stop_ids)
    return total


@torch.no_grad()
def measure_mtp_acceptance(model, prompts: list[list[int]], max_new_tokens: int, pad_id: int,
                           stop_ids: tuple[int, ...] = (), batch_size: int = 16, shards: int = 1) -> Acceptance:
    """The same measure for the multi-token-prediction modules of ``model`` (DeepSeek-V4 or the V3 family,
    ``len(model.mtp)`` tokens drafted per step): greedy-decode, then one teacher-forced forward per batch
    (``shards``: the model's context-parallel group, every rank of it calling with the same prompts). Reads the
    host once per batch."""
    total = Acceptance(len(model.mtp))
    for b in range(0, len(prompts), batch_size):
        tally(total, *mtp_draft_steps(model, prompts[b:b + batch_size], max_new_tokens, pad_id, shards), stop_ids)
    return total


def tally(total: Acceptance, generated: torch.Tensor, drafted: torch.Tensor, stop_ids: tuple[int, ...]) -> None:
    """Add one batch's steps to ``total``: generated [B, N] the greedy tokens g_0 ..., drafted [B, N - 1, T]
    step k's draft of g_{k+2} ... g_{k+1+T} (one host read)."""
    T = total.block_size
    total.new_tokens = max(total.new_tokens, generated.shape[1])
    for row, row_drafts in zip(generated.tolist(), drafted.tolist()):
        n = next((i + 1 for i, t in enumerate(row) if t in stop_ids), len(row))  # tokens this row generated
        total.rows += 1
        total.at_once += row[0] in stop_ids
        for k, draft in enumerate(row_drafts):
            if k + 1 + T >= n:  # the draft reaches past the row's end: not comparable
                break
            truth = row[k + 2:k + 2 + T]
            total.histogram[next((i for i in range(T) if draft[i] != truth[i]), T)] += 1


@torch.no_grad()
def draft_steps(model, drafter, prompts: list[list[int]], max_new_tokens: int, pad_id: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch of prompts, left-padded, greedy-decoded against the decode cache, drafting at every step ->
    (generated [B, N] the greedy tokens g_0 ..., drafted [B, N - 1, T]: step k's draft of g_{k+2} ...
    g_{k+1+T}, made from g_{k+1} and the hidden of the step that fed g_k); N = max_new_tokens."""
    device = model.embed.weight.device
    ids, docs = left_pad(prompts, pad_id, device)
    cache = decode_cache(model.cfg, max_new_tokens)
    taps = drafter.target_layers
    embed, head = whole(model.embed.weight), whole(model.head.weight)  # split by vocabulary under tp: gathered
    with evaluating(model):
        out = model(ids, doc_ids=docs, cache=cache, tap_layers=taps)
        positions = cache.pos[:, None] - ids.shape[1] + torch.arange(ids.shape[1], device=device)  # padding: < 0
        draft_cache = drafter.prefill(out.hidden, positions)
        tokens = [out.logits[:, -1].argmax(-1)]
        drafts = []
        for _ in range(max_new_tokens - 1):
            step = model(tokens[-1][:, None], cache=cache, tap_layers=taps)
            token = step.logits[:, -1].argmax(-1)
            drafts.append(drafter.draft(draft_cache, token, step.hidden[:, -1], embed, head).ids[:, 1:])
            tokens.append(token)
    T = drafter.cfg.dspark_block_size
    drafted = torch.stack(drafts, dim=1) if drafts else torch.zeros(len(prompts), 0, T, dtype=torch.long, device=device)
    return torch.stack(tokens, dim=1), drafted


@torch.no_grad()
def mtp_draft_steps(model, prompts: list[list[int]], max_new_tokens: int, pad_id: int, shards: int = 1
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """``draft_steps`` for the MTP modules: (generated [B, N], drafted [B, N - 1, T]) with T = len(model.mtp);
    step k's draft of g_{k+2 + j} is module j's argmax at g_k's position (fed the stream there and g_{k+1}).
    The rows are left-padded so that a context-parallel forward over ``shards`` ranks can split them."""
    c = continue_prompts(model, prompts, max_new_tokens, pad_id,
                         mtp_width(model.cfg, max(len(p) for p in prompts), max_new_tokens, shards))
    P = c.width
    with evaluating(model):
        out = model(c.ids, doc_ids=(c.positions >= 0).long())
    drafted = torch.stack([logits[:, P:P + max_new_tokens - 1].argmax(-1) for logits in out.mtp_logits], -1)
    return c.ids[:, P:], drafted


def mtp_width(cfg, longest: int, new_tokens: int, shards: int) -> int:
    """The prompt width (left-padded) whose rows, continued ``new_tokens``, a context-parallel forward over
    ``shards`` ranks splits (``trex.models.registry.shardable_length``): at least ``longest``."""
    return shardable_length(cfg, longest + new_tokens, shards) - new_tokens


# ---- the target's own continuation ------------------------------------------------------------------------
@dataclass
class Continuation:
    """The target's continuation of left-padded prompts: ids [B, L] (prompt width P, then G new tokens),
    positions [B, L] (< 0: padding), logits [B, G - 1, V] the target's at positions P .. L - 2 (each predicts
    the token after it), hidden [B, L - 1, k d] the tap layers' input (the last token's is never read; None
    without taps)."""

    ids: torch.Tensor
    positions: torch.Tensor
    logits: torch.Tensor
    width: int
    hidden: torch.Tensor | None = None


@torch.no_grad()
def continue_prompts(model, prompts: list[list[int]], new_tokens: int, pad_id: int, width: int | None = None,
                     temperature: float = 0.0, uniforms: torch.Tensor | None = None,
                     taps: list[int] | None = None) -> Continuation:
    """Continue ``prompts`` (left-padded to ``width``, default the longest) by ``new_tokens`` of ``model``'s own
    tokens (greedy at temperature 0, else sampled with ``uniforms`` [B, new_tokens]) through the architecture's
    decode cache: one prefill and new_tokens - 1 steps, every step's logits (and with ``taps``, a V4.1 model's
    tap layers' hidden) kept. Static shapes, no host read: a row's stop token does not end it."""
    device = model.embed.weight.device
    ids, docs = left_pad(prompts, pad_id, device, width)
    width = ids.shape[1]
    params = SamplingParams(temperature=temperature, max_new_tokens=new_tokens)
    cache = decode_cache(model.cfg, new_tokens)
    tap = {"tap_layers": taps} if taps else {}

    def choose(logits: torch.Tensor, i: int) -> torch.Tensor:
        return choose_tokens(logits, params, None, None if uniforms is None else uniforms[:, i])[0]

    with evaluating(model):
        out = model(ids, doc_ids=docs, cache=cache, **tap)
        positions = cache.pos[:, None] - width + torch.arange(width, device=device)
        hidden, logits = [out.hidden], []
        tokens = [choose(out.logits[:, -1], 0)]
        for i in range(1, new_tokens):
            step = model(tokens[-1][:, None], cache=cache, **tap)
            hidden.append(step.hidden)
            logits.append(step.logits[:, -1])
            tokens.append(choose(step.logits[:, -1], i))
    L = width + new_tokens
    full = torch.cat([ids, torch.stack(tokens, 1)], 1)
    positions = positions[:, :1] + torch.arange(L, device=device)
    return Continuation(full, positions, torch.stack(logits, 1), width, torch.cat(hidden, 1) if taps else None)
