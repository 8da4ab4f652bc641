"""Batched sampling from the trex model: temperature, top-p, max new tokens, stop tokens.

Prompts of different lengths share one batch: each row is left-padded and the padding is its own
document (``doc_ids`` 0, the prompt and its completion are document 1), so padding never enters
attention or a compression window and every prompt's positions start at 0.

Decoding is incremental: the prompt batch runs once through the ordinary forward, which fills the
architecture's decode cache (``trex.models.registry.decode_cache``: V4's
:class:`~trex.models.deepseek_v4.decode.DecodeCache`, V4.1's ``decode_v41``, DeepSeek-V3's MLA latents
``deepseek_v3.decode``); every later token is one forward
of [B, 1] against it (``use_cache=False`` re-runs the whole sequence per token instead, the reference the
cache is tested against). Under context parallelism every rank of the group samples whole rows (its
forwards run unsharded).

The sampler reads the live model weights and works on the plain and on the FSDP2/EP-sharded model:
when torch.distributed is initialised every rank runs the same number of forward calls (the number
of batches and the stop decision are agreed across ranks), so collectives inside the model match.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from trex.models import evaluating
from trex.models.registry import decode_cache


@dataclass
class SamplingParams:
    """temperature 0 means greedy; top_p keeps the smallest set of tokens whose probability reaches it."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 64
    stop_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 0:
            raise ValueError(f"SamplingParams.max_new_tokens must be >= 0, got {self.max_new_tokens}")
        self.stop_ids = tuple(int(s) for s in self.stop_ids)


@dataclass
class Samples:
    """Per prompt: the prompt, its completion (a stop token included when one ended it), the sampler's
    log p(token) under log_softmax(logits.float()) at temperature 1, and whether a stop token ended it;
    with ``record_routes``, ``routes[i]``: each MoE layer's experts [n, k] of the n = len(prompt) +
    len(completion) - 1 tokens the sampler fed through the model (all but the last), in order; ``version``:
    the weight version that sampled them (a rollout engine's; -1 unknown; multi-turn: the oldest). A multi-turn
    rollout (trex.rollout.multiturn) adds per completion token ``sampled`` (False: a tool output the rollout
    appended, no loss) and ``token_versions`` (the weight version that sampled it, -1 on tool tokens)."""

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    logprobs: list[list[float]]
    finished: list[bool]
    routes: list[dict[str, torch.Tensor]] | None = None
    version: int = -1
    sampled: list[list[bool]] | None = None
    token_versions: list[list[int]] | None = None


def choose_tokens(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
                  uniform: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] -> (tokens [B] long, log p(token) [B] fp32 under the untempered distribution).

    Sampling takes one uniform in [0, 1) per row (``uniform`` [B], else drawn from ``generator`` on
    the generator's device) and inverts the CDF of the temperature-scaled, top-p-truncated
    distribution. The probability sort decides only top-p's kept set (the smallest set of most likely
    tokens whose probability reaches ``top_p``, the most likely always in it); the CDF is then taken
    over the kept tokens in **vocabulary order**, not in probability order. The distribution is the
    same (each kept token owns an interval of [0, 1) as wide as its renormalised probability; only
    where the intervals lie changes), but the token a given uniform picks becomes robust to
    near-ties: two tokens of nearly equal probability that rounding noise swaps in a sort (the same
    model under another layout, 1 process vs 2, moves the fp32 logits by ~1e-5) keep their places in
    vocabulary order, so a uniform that lands on them still picks the same token; it picks another
    only when it falls within the noise of an interval's edge. In sorted order one such swap moves
    every later token's interval. Static shapes, no host sync; with ``uniform`` given per row a row's
    token depends on its logits and its uniform only (not on the batch or rank it lands in).
    ``temperature`` 0 is the argmax.
    """
    logits = logits.float()
    logp = F.log_softmax(logits, dim=-1)
    if params.temperature == 0:
        tokens = logits.argmax(dim=-1)
    else:
        probs = (logits / params.temperature).softmax(dim=-1)
        if params.top_p < 1:  # the kept set is decided in probability order; the draw is not
            ranked, order = probs.sort(dim=-1, descending=True, stable=True)
            kept = (ranked.cumsum(dim=-1) - ranked) < params.top_p  # the first token is always kept
            probs = probs * torch.zeros_like(kept).scatter(1, order, kept)
        cdf = probs.cumsum(dim=-1)  # in vocabulary order (see the docstring)
        if uniform is None:
            gen_device = generator.device if generator is not None else logits.device
            uniform = torch.rand(logits.shape[0], generator=generator, device=gen_device)
        u = uniform.float().to(logits.device)[:, None]
        # the first token whose CDF exceeds u * total (right=True: never a zero-probability token, whose
        # CDF equals its predecessor's); u * total rounding up to the total picks the last kept token
        ids = torch.arange(probs.shape[-1], device=probs.device)
        last = torch.where(probs > 0, ids, 0).amax(dim=-1, keepdim=True)
        tokens = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).clamp(max=last).squeeze(1)
    return tokens, logp.gather(1, tokens[:, None]).squeeze(1)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def agree_max(value: int, device: torch.device) -> int:
    """The largest ``value`` over all ranks (the value itself in one process)."""
    if not _distributed():
        return value
    t = torch.tensor([value], dtype=torch.long, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


@contextlib.contextmanager
def whole_rows(model) -> Iterator[None]:
    """The sampler's forwards see whole rows: a context-parallel model's ``sequence_shard`` is lifted for
    the block (a cached decode never shards; the cacheless one grows rows by one token a step, which no
    shard split follows)."""
    shard = getattr(model, "sequence_shard", None)
    model.sequence_shard = None
    try:
        yield
    finally:
        model.sequence_shard = shard


def left_pad(prompts: list[list[int]], pad_id: int, device: torch.device,
             width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [B, L], doc_ids [B, L]): prompts right-aligned; padding is document 0, prompts document 1.
    L = the longest prompt, or ``width`` (at least that)."""
    width = max(width or 0, max(len(p) for p in prompts))
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    docs = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
        docs[i, width - len(p):] = 1
    return ids.to(device), docs.to(device)


def _sample_batch(model, prompts: list[list[int]], params: SamplingParams, pad_id: int,
                  generator: torch.Generator | None, uniforms: torch.Tensor | None, done: torch.Tensor,
                  use_cache: bool, routes: dict[str, torch.Tensor] | None = None):
    """Decode one batch; rows already ``done`` [B] (dummy rows of a rank with no prompts left) only
    keep the collectives in step; ``uniforms`` [B, max_new_tokens] or None (draw from ``generator``).
    Returns (tokens [B, T], logprobs [B, T], finished [B]); ``routes`` (a dict) receives each MoE layer's
    experts [B, L + T - 1, k] of the fed tokens, the prompts left-padded to L as ``left_pad`` does."""
    device = done.device
    ids, docs = left_pad(prompts, pad_id, device)
    stop = torch.tensor(params.stop_ids, dtype=torch.long, device=device)
    cache = decode_cache(model.cfg, params.max_new_tokens) if use_cache else None
    finished = torch.zeros_like(done)
    tokens, logprobs = [], []
    for step in range(params.max_new_tokens):
        log = None if routes is None else {}
        if step and use_cache:
            logits = model(tokens[-1][:, None], cache=cache, route_log=log).logits[:, -1]
        else:
            if step:
                ids = torch.cat([ids, tokens[-1][:, None]], dim=1)
                docs = torch.cat([docs, torch.ones_like(docs[:, :1])], dim=1)
            logits = model(ids, doc_ids=docs, cache=cache, route_log=log).logits[:, -1]
        if log is not None:  # a cached step adds one token's experts; a cacheless one recomputes the rows
            for name, idx in log.items():
                routes[name] = torch.cat([routes[name], idx], dim=1) if step and use_cache else idx
        tok, lp = choose_tokens(logits, params, generator, None if uniforms is None else uniforms[:, step])
        tokens.append(torch.where(done, torch.full_like(tok, pad_id), tok))
        logprobs.append(lp)
        hit = torch.isin(tok, stop) & ~done
        finished |= hit
        done = done | hit
        if agree_max(int(not bool(done.all())), device) == 0:
            break
    if not tokens:
        empty = torch.zeros(len(prompts), 0, device=device)
        return empty.long(), empty, finished
    return torch.stack(tokens, dim=1), torch.stack(logprobs, dim=1), finished


@torch.no_grad()
def sample(model, prompts: list[list[int]], params: SamplingParams, pad_id: int,
           generator: torch.Generator | None = None, batch_size: int = 64, use_cache: bool = True,
           uniforms: torch.Tensor | None = None, record_routes: bool = False) -> Samples:
    """Sample a completion for every prompt (lists of token ids), ``batch_size`` prompts per batch.

    Deterministic given ``generator`` (same prompts, weights and batch size). ``uniforms``
    [len(prompts), max_new_tokens] in [0, 1), if given, replace the generator: prompt i's t-th token
    uses ``uniforms[i, t]``, so its completion does not depend on the batch or rank it lands in.
    Under torch.distributed each rank passes its own prompts; ranks with fewer batches run dummy
    rows until all are done. ``record_routes``: ``Samples.routes`` holds the experts every fed token
    took in every MoE layer (routing replay).
    """
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"sample: prompt {i} is empty; every prompt needs at least one token")
    if batch_size < 1:
        raise ValueError(f"sample: batch_size must be >= 1, got {batch_size}")
    if uniforms is not None and tuple(uniforms.shape) != (len(prompts), params.max_new_tokens):
        raise ValueError(f"sample: uniforms of shape {tuple(uniforms.shape)}; expected "
                         f"[{len(prompts)} prompts, {params.max_new_tokens} max_new_tokens]")
    device = model.embed.weight.device
    out = Samples([list(p) for p in prompts], [], [], [], [] if record_routes else None)
    n_batches = agree_max(-(-len(prompts) // batch_size), device)
    with evaluating(model), whole_rows(model):
        for b in range(n_batches):
            chunk = prompts[b * batch_size:(b + 1) * batch_size]
            real = bool(chunk)
            rows = chunk if real else [[pad_id]]
            done = torch.full((len(rows),), not real, dtype=torch.bool, device=device)
            u = None
            if uniforms is not None:
                u = uniforms[b * batch_size:(b + 1) * batch_size] if real else uniforms.new_zeros(1, params.max_new_tokens)
            routes = {} if record_routes else None
            tokens, logprobs, finished = _sample_batch(model, rows, params, pad_id, generator, u, done, use_cache,
                                                       routes)
            if not real:
                continue
            width = max(map(len, rows))
            for i, (toks, lps, fin) in enumerate(zip(tokens.tolist(), logprobs.tolist(), finished.tolist())):
                n = next((j + 1 for j, t in enumerate(toks) if t in params.stop_ids), len(toks))
                out.completion_ids.append(toks[:n])
                out.logprobs.append(lps[:n])
                out.finished.append(fin)
                if routes is not None:  # the fed tokens: the prompt, then all but the last of the completion
                    first = width - len(rows[i])
                    out.routes.append({k: v[i, first:first + len(rows[i]) + n - 1].cpu() for k, v in routes.items()})
    return out
