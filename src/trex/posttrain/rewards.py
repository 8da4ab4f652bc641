"""Reward functions for GRPO: a registry of built-ins plus user plug-ins.

A reward function takes one :class:`Completion` and returns a float. A recipe names it by:

* a built-in name: ``exact_match`` (the answer equals the record's ``answer``, as the default
  job's evaluation checks it) or ``format`` (the V4 chat/thinking layout is respected);
* a name registered by an installed package under the entry-point group ``trex.rewards``
  (``[project.entry-points."trex.rewards"] my_reward = "my_pkg.rewards:score"``);
* a ``module:function`` path; the module is imported from the Python path (the user's own code,
  named in their own recipe; nothing is ever imported from data or checkpoints).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from trex.data.chat import completion_answer
from trex.data.tokenizer import EOS, THINK_END, THINK_START
from trex.posttrain.plugins import load_plugin

if TYPE_CHECKING:
    from trex.rollout.multiturn import Trajectory

ENTRY_POINT_GROUP = "trex.rewards"


@dataclass(frozen=True)
class Completion:
    text: str
    """The sampled completion, decoded with its special tokens (EOS included when produced); multi-turn: the
    last model turn's."""
    record: dict
    """The prompt's JSONL record (``answer`` and any other field a reward needs)."""
    thinking: bool
    """Whether the prompt opened a ``<think>`` block (thinking mode) or closed it (chat mode)."""
    finished: bool
    """Whether a stop token ended the completion (False: cut at max_new_tokens); multi-turn: whether the
    trajectory ended with an answer (a turn that made no call)."""
    trajectory: Trajectory | None = None
    """A multi-turn rollout's whole trajectory (trex.rollout.multiturn: every turn's ids, parsed calls, tool
    results, stop reason); ``text`` is then its last model turn. None for a single-turn completion."""


RewardFn = Callable[[Completion], float]


def exact_match(c: Completion) -> float:
    """1.0 if the answer (text before EOS, after ``</think>`` in thinking mode), stripped, equals
    ``str(record["answer"])`` stripped; else 0.0."""
    if "answer" not in c.record:
        raise KeyError(f"exact_match reward: the record has no `answer` field (keys: {sorted(c.record)})")
    return float(completion_answer(c.text, thinking=c.thinking).strip() == str(c.record["answer"]).strip())


def format_reward(c: Completion) -> float:
    """1.0 if the completion is a well-formed V4 assistant turn, else 0.0.

    Thinking mode: ``{reasoning}</think>{answer}<EOS>`` with non-empty reasoning and answer and no
    other think tag. Chat mode: ``{answer}<EOS>`` with a non-empty answer and no think tag.
    """
    if not c.finished or not c.text.endswith(EOS) or c.text.count(EOS) != 1 or THINK_START in c.text:
        return 0.0
    body = c.text[: -len(EOS)]
    if not c.thinking:
        return float(THINK_END not in body and bool(body.strip()))
    if body.count(THINK_END) != 1:
        return 0.0
    reasoning, answer = body.split(THINK_END)
    return float(bool(reasoning.strip()) and bool(answer.strip()))


BUILTIN: dict[str, RewardFn] = {"exact_match": exact_match, "format": format_reward}


def load_reward(spec: str) -> RewardFn:
    """The reward function named by ``spec`` (built-in name, entry-point name or module:function)."""
    fn = load_plugin(spec, BUILTIN, ENTRY_POINT_GROUP, "reward", "module:function")
    if not callable(fn):
        raise ValueError(f"reward {spec!r} is a {type(fn).__name__}, not a function")
    return fn


@dataclass
class RewardSet:
    """Several reward functions and their weights: reward = sum_k weight_k * fn_k(completion)."""
    names: list[str]
    fns: list[RewardFn]
    weights: list[float]

    @classmethod
    def load(cls, names: list[str], weights: list[float] | None = None) -> RewardSet:
        if not names:
            raise ValueError("grpo.rewards is empty; name at least one reward (e.g. [\"exact_match\"])")
        weights = list(weights) if weights else [1.0] * len(names)
        if len(weights) != len(names):
            raise ValueError(f"grpo.reward_weights has {len(weights)} entries for {len(names)} rewards")
        return cls(list(names), [load_reward(n) for n in names], weights)

    def score(self, c: Completion) -> tuple[float, dict[str, float]]:
        """The weighted total and each function's raw value (by name)."""
        parts = {}
        for name, fn in zip(self.names, self.fns):
            value = fn(c)
            try:
                parts[name] = float(value)
            except (TypeError, ValueError):
                raise TypeError(f"reward {name!r} returned {value!r}; expected a number") from None
        return sum(w * parts[n] for n, w in zip(self.names, self.weights)), parts
