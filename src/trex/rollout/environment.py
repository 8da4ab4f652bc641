"""What a tool-using (multi-turn) rollout talks to: the environment contract and the built-in one.

An environment is a class named in the recipe (``[environment] name``: a built-in name, an entry point
of the group ``trex.environments``, or ``module:Class``), constructed once per run with the section's
``options`` as keyword arguments. Its contract:

    env = Environment(**options)
    episode = env.reset(record)          # one per trajectory (a GRPO group's G copies get one each)
    episode.system, episode.user         # the system text (before the tool schemas) and the user turn
    episode.tools                        # OpenAI-form schemas [{"type": "function", "function": {...}}]
    results = episode.step(calls, seconds_left)   # one ToolResult per ToolCall, in call order

The rollout loop (trex.rollout.multiturn) renders ``codec.prompt(episode.system, episode.user,
episode.tools)`` as the first prompt, parses each sampled turn's calls from the engine's token ids and
hands them to ``step`` (a malformed call is a ``ToolCall`` with ``error`` set: answer it with a message
saying so, as ``trex.rollout.tools.answer`` does); ``seconds_left`` is what remains of the trajectory's
tool time (bound a tool's wall clock by it). ``step`` may run in a worker thread (episodes of one round
in parallel, each episode in one thread at a time). Rewards are the recipe's reward functions, which
see the whole trajectory (``Completion.trajectory``).

Nothing an environment runs from a record (code, expressions) may execute in the trainer's process: the
built-in tools run Python in a sandboxed subprocess and evaluate arithmetic on its syntax tree
(trex.rollout.tools).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from trex.data.tool_calls import ToolCall
from trex.rollout.tools import BUILTIN_TOOLS, PythonTool, SandboxLimits, ToolResult, answer


class ToolsEnvironment:
    """``name = "tools"``: the built-in tools (``tools``: any of "calculator", "python") for every record.
    A record is ``{"prompt": str}`` or ``{"messages": [{"role": "system"}?, {"role": "user"}]}`` (an SFT
    record's final assistant turn left out: it is the prompt's answer), plus ``system`` (a string)
    optionally and whatever the rewards read (``answer``). ``schemas`` false: the prompt names no tools (no
    tools block: a prompt as short as the record's own), the calls are answered all the same; for a model that
    learnt the calls from demonstrations (the calculator demonstration, docs/post_training.md)."""

    def __init__(self, tools: Sequence[str] = ("calculator", "python"), python_cpu_s: int = 10,
                 python_wall_s: float = 10.0, schemas: bool = True):
        unknown = [t for t in tools if t not in BUILTIN_TOOLS]
        if unknown or not tools:
            raise ValueError(f"tools {list(tools)}: expected some of {', '.join(BUILTIN_TOOLS)}")
        self.names = list(tools)
        self.limits = SandboxLimits(wall_s=python_wall_s, cpu_s=python_cpu_s)
        self.schemas = bool(schemas)

    def reset(self, record: dict) -> ToolsEpisode:
        return ToolsEpisode(*_system_user(record), self.names, self.limits, self.schemas)


class ToolsEpisode:
    def __init__(self, system: str, user: str, names: list[str], limits: SandboxLimits, schemas: bool = True):
        self.system, self.user, self.limits = system, user, limits
        self._tools = {n: BUILTIN_TOOLS[n]() for n in names}
        self.tools = [t.schema for t in self._tools.values()] if schemas else []

    def step(self, calls: Sequence[ToolCall], seconds_left: float) -> list[ToolResult]:
        if "python" in self._tools:  # a program runs at most for what is left of the trajectory's tool time
            wall = max(min(self.limits.wall_s, seconds_left), 0.01)
            self._tools["python"] = PythonTool(dataclasses.replace(self.limits, wall_s=wall))
        return answer(calls, self._tools)


def _system_user(record: dict) -> tuple[str, str]:
    """(system, user) of a ``{"prompt"}`` or ``{"messages": [system?, user]}`` record; ValueError otherwise."""
    system = record.get("system", "")
    if isinstance(record.get("prompt"), str) and isinstance(system, str):
        return system, record["prompt"]
    messages = record.get("messages")
    if isinstance(messages, list) and messages and all(isinstance(m, dict) for m in messages):
        if messages[-1].get("role") == "assistant":  # an SFT record: the turn is its answer (on_policy.record_prompt)
            messages = messages[:-1]
        roles = [m.get("role") for m in messages]
        if roles in (["user"], ["system", "user"]) and all(isinstance(m.get("content"), str) for m in messages):
            return (messages[0]["content"] if len(messages) == 2 else system), messages[-1]["content"]
    raise ValueError('expected {"prompt": str, "system": str (optional)} or {"messages": [system (optional), '
                     'user]} with string contents')


BUILTIN_ENVIRONMENTS = {"tools": ToolsEnvironment}
