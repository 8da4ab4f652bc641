"""Multi-turn, tool-using rollouts built token-in, token-out.

:func:`roll_out_turns` runs one trajectory per episode (trex.rollout.environment) through rounds: every
trajectory still going is one row of one ``engine.generate`` call, whose prompt is the trajectory's ids
so far (the engine is given ids, never text); the turn it samples is kept as the engine's ids, its calls
are parsed from those ids (``codec.parse``), answered by the episode, and the answers appended as the
template's tokens (``tokenizer.encode(codec.results(outputs))``). Nothing sampled is ever decoded and
encoded again: a re-tokenised history is not what the engine sampled (decode-then-encode is not a
bijection, e.g. text that spells a special token), and the policy ratio of such tokens is meaningless.

A trajectory ends after a turn that

* ended without EOS (cut at ``max_new_tokens`` or at the token budget): ``stop = "length"``;
* made no call: ``"answer"`` (the only ending with ``finished``);
* made calls when ``max_turns`` turns are done (``"max_turns"``) or its tool seconds are spent
  (``"tool_seconds"``): the calls are not run;
* made calls whose results would leave no token of ``max_tokens`` (the tokens after the prompt, model
  and tool tokens together) for another turn: ``"max_tokens"``, the results not appended.

So a trajectory always ends with a model turn. Per token after the prompt it keeps whether the engine
sampled it (the loss mask; tool tokens 0), the engine's log-prob (0 on tool tokens) and the weight
version that sampled it (-1 on tool tokens); with ``record_routes``, the experts of every fed token
(each position's from the call that first fed it), laid out as single-turn ``Samples.routes``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

import torch

from trex.data.tokenizer import Tokenizer
from trex.data.tool_calls import AssistantTurn, ToolCodec
from trex.rollout.sampling import Samples, SamplingParams
from trex.rollout.tools import ToolResult


@dataclass(frozen=True)
class TurnLimits:
    """Per-trajectory limits (``[environment]``)."""
    max_turns: int = 4
    max_tokens: int = 512
    tool_seconds: float = 30.0


@dataclass
class Trajectory:
    """One multi-turn rollout. ``ids``: the tokens after ``prompt_ids``, model and tool turns in order;
    per token of ``ids``: ``sampled`` (the engine sampled it: the loss mask), ``logprobs`` (the engine's
    untempered log p, 0.0 on tool tokens), ``versions`` (the weight version that sampled it, -1 on tool
    tokens). Per model turn: ``turn_ids`` (its ids, a slice of ``ids``) and ``turns`` (parsed); per turn
    whose calls ran: ``results`` (the last one's may be left out of ``ids`` when ``stop`` is
    "max_tokens"). ``routes`` (routing replay): per MoE layer [len(prompt_ids) + len(ids) - 1, k], the
    experts of every fed token, each from the engine call that fed it first. ``stop``: "answer",
    "length", "max_turns", "tool_seconds" or "max_tokens"; ``finished`` only with "answer"."""
    record: dict
    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)
    sampled: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    turns: list[AssistantTurn] = field(default_factory=list)
    results: list[list[ToolResult]] = field(default_factory=list)
    turn_ids: list[list[int]] = field(default_factory=list)
    routes: dict[str, torch.Tensor] | None = None
    tool_seconds: float = 0.0
    finished: bool = False
    stop: str = ""

    @property
    def calls(self) -> int:
        return sum(len(t.calls) for t in self.turns)

    @property
    def parse_errors(self) -> int:
        return sum(c.error is not None for t in self.turns for c in t.calls)

    @property
    def tool_errors(self) -> int:
        return sum(not r.ok for rs in self.results for r in rs)


def roll_out_turns(engine, episodes: Sequence, records: Sequence[dict], codec: ToolCodec, tokenizer: Tokenizer,
                   params: SamplingParams, limits: TurnLimits, uniforms: torch.Tensor | None, batch_size: int,
                   record_routes: bool = False, agree: Callable[[int], int] = int,
                   tool_workers: int = 8) -> list[Trajectory]:
    """One trajectory per episode (``records[i]`` its record). ``uniforms`` [rows, max_turns,
    max_new_tokens] or None: turn t of row i samples with ``uniforms[i, t]``, so a row's trajectory depends
    on its place only. ``agree(n)``: the largest ``n`` over the ranks that sample together (an in-process
    engine on a sharded model, whose forwards are collectives: every rank runs every round, with its rows or
    none); ``int`` for one process. ``params.stop_ids`` must hold EOS."""
    trajs = []
    for ep, rec in zip(episodes, records):  # the prompt is text only here, before anything is sampled
        trajs.append(Trajectory(rec, tokenizer.encode(codec.prompt(ep.system, ep.user, ep.tools)).tolist()))
    chunks: list[dict[str, list[torch.Tensor]]] = [{} for _ in trajs]  # routes of each row, call by call
    active = list(range(len(trajs)))
    with ThreadPoolExecutor(max(1, tool_workers)) as pool:
        for turn in range(limits.max_turns):
            budget = max([limits.max_tokens - len(trajs[i].ids) for i in active], default=0)
            n_new = agree(min(params.max_new_tokens, budget))
            if n_new <= 0:
                break
            rows = [trajs[i].prompt_ids + trajs[i].ids for i in active]
            u = None if uniforms is None else uniforms[active, turn, :n_new]
            out: Samples = engine.generate(rows, replace(params, max_new_tokens=n_new), u, batch_size, record_routes)
            calling = []
            for k, i in enumerate(active):
                t = trajs[i]
                ids, lps = out.completion_ids[k], out.logprobs[k]
                room = limits.max_tokens - len(t.ids)
                cut = len(ids) > room
                ids, lps = ids[:room], lps[:room]
                if out.routes is not None:  # the experts of the tokens this call fed first
                    fed = len(rows[k]) + len(ids) - 1
                    have = sum(len(c) for c in next(iter(chunks[i].values()), []))
                    for name, r in out.routes[k].items():
                        chunks[i].setdefault(name, []).append(r[have:fed])
                t.ids += ids
                t.sampled += [True] * len(ids)
                t.logprobs += [float(x) for x in lps]
                t.versions += [out.version] * len(ids)
                t.turn_ids.append(list(ids))
                parsed = codec.parse(ids, tokenizer, after_results=turn > 0)
                t.turns.append(parsed)
                if cut or not parsed.finished:
                    t.stop = "length"
                elif not parsed.calls:
                    t.stop, t.finished = "answer", True
                elif turn + 1 == limits.max_turns:
                    t.stop = "max_turns"
                elif t.tool_seconds >= limits.tool_seconds:
                    t.stop = "tool_seconds"
                else:
                    calling.append(i)
            answers = pool.map(lambda i: _step(episodes[i], trajs[i], limits), calling)
            for i, results in zip(calling, answers):
                t = trajs[i]
                t.results.append(results)
                more = tokenizer.encode(codec.results([r.content for r in results])).tolist()
                if len(t.ids) + len(more) >= limits.max_tokens:
                    t.stop = "max_tokens"
                    continue
                t.ids += more
                t.sampled += [False] * len(more)
                t.logprobs += [0.0] * len(more)
                t.versions += [-1] * len(more)
            active = [i for i in active if not trajs[i].stop]
            if agree(len(active)) == 0:
                break
    for t, c in zip(trajs, chunks):
        if not t.stop:  # not reached: a trajectory going on has a token of its budget left
            t.stop = "max_tokens"
        if record_routes:
            t.routes = {name: torch.cat(parts) for name, parts in c.items()}
    return trajs


def _step(episode, t: Trajectory, limits: TurnLimits) -> list[ToolResult]:
    """The episode's answers to the last turn's calls; its wall time counts against the trajectory's."""
    calls = list(t.turns[-1].calls)
    start = time.monotonic()
    results = list(episode.step(calls, limits.tool_seconds - t.tool_seconds))
    t.tool_seconds += time.monotonic() - start
    if len(results) != len(calls) or not all(isinstance(r, ToolResult) for r in results):
        raise ValueError(f"environment episode {type(episode).__name__}.step returned {len(results)} results for "
                         f"{len(calls)} calls; expected one trex.rollout.tools.ToolResult per call")
    return results


def as_samples(trajs: Sequence[Trajectory]) -> Samples:
    """Trajectories as ``Samples`` (``completion_ids`` = everything after the prompt) with ``sampled`` and
    ``token_versions``, for the on-policy modes' row layout."""
    routes = [t.routes for t in trajs] if trajs and trajs[0].routes is not None else None
    versions = [v for t in trajs for v in t.versions if v >= 0]
    return Samples([t.prompt_ids for t in trajs], [t.ids for t in trajs], [t.logprobs for t in trajs],
                   [t.finished for t in trajs], routes, min(versions, default=-1),
                   sampled=[t.sampled for t in trajs], token_versions=[t.versions for t in trajs])
