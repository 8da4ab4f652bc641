"""``[environment]``: multi-turn, tool-using rollouts in the on-policy modes (grpo, distill).

With ``name`` set, each sampled row is a trajectory (trex.rollout.multiturn.roll_out_turns) instead of
one completion: the environment (the contract: trex.rollout.environment) answers the calls the model
makes in its tool-call format (trex.data.tool_calls), its answers are appended as the template's tokens
with no loss, and the rewards see the whole trajectory (``Completion.trajectory``). The rows the losses
read are laid out as single-turn ones (on_policy.lay_out), the tool tokens off the mask.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from trex.data.tokenizer import Tokenizer
from trex.data.tool_calls import tool_codec
from trex.parallel.mesh import Parallel
from trex.posttrain.on_policy import Prompt, Rollouts, lay_out, rank_uniforms
from trex.posttrain.plugins import load_plugin
from trex.posttrain.rewards import Completion
from trex.recipe import require_positive
from trex.rollout.engine import InProcessEngine
from trex.rollout.environment import BUILTIN_ENVIRONMENTS
from trex.rollout.multiturn import Trajectory, TurnLimits, as_samples, roll_out_turns
from trex.rollout.sampling import SamplingParams, agree_max

ENTRY_POINT_GROUP = "trex.environments"
METRICS = ("turns", "tool_calls", "tool_errors", "parse_errors", "tool_seconds", "answered")


@dataclass
class EnvironmentSection:
    """Multi-turn, tool-using rollouts of grpo and distill (docs/post_training.md, "Environments")."""
    name: str = ""
    """The environment: "tools" (built in: the calculator and a sandboxed Python), a name registered under
    the entry-point group trex.environments, or module:Class; empty: single-turn rollouts."""
    options: dict = field(default_factory=dict)
    """Keyword arguments of the environment's constructor ("tools": tools = ["calculator", "python"],
    python_wall_s, python_cpu_s, schemas = false: the prompt lists no tools)."""
    tool_format: str = ""
    """The tool-call format (deepseek-v3, deepseek-v3.1, deepseek-v3.2, deepseek-v4, deepseek-v4.1; in
    thinking or chat form as [data] thinking); empty: [data] chat_format."""
    max_turns: int = 4
    """Model turns per trajectory; a turn that calls tools after the last one ends it unanswered."""
    max_tokens: int = 512
    """Tokens per trajectory after the prompt, model and tool tokens together."""
    tool_seconds: float = 30.0
    """Tool wall seconds per trajectory; once spent, the next calls end it unanswered."""
    tool_workers: int = 8
    """Threads that run the episodes' tool calls of one round side by side."""

    def __post_init__(self) -> None:
        require_positive(self, "environment", ("max_turns", "max_tokens", "tool_seconds", "tool_workers"))


class MultiTurn:
    """The run's environment, tool-call codec and limits, and the rollouts of one step."""

    def __init__(self, section: EnvironmentSection, chat_format: str, thinking: bool, tokenizer: Tokenizer,
                 where: str):
        self.section, self.tokenizer, self.thinking = section, tokenizer, thinking
        self.codec = tool_codec(section.tool_format or chat_format, thinking=thinking)
        self.codec.marker_ids(tokenizer)  # a tokenizer without the format's markers: refused now, in one line
        cls = load_plugin(section.name, BUILTIN_ENVIRONMENTS, ENTRY_POINT_GROUP, "environment", "module:Class")
        if not callable(cls):
            raise ValueError(f"environment {section.name!r} is a {type(cls).__name__}, not a class")
        try:
            self.env = cls(**section.options)
        except (TypeError, ValueError) as e:  # an option it does not take, or a value it refuses
            raise ValueError(f"environment.options = {section.options}: environment {section.name!r} refused "
                             f"them: {e}") from None
        self.limits = TurnLimits(section.max_turns, section.max_tokens, section.tool_seconds)
        self.where = where

    def uniforms(self, generator: torch.Generator, rows: int, max_new_tokens: int, par: Parallel) -> torch.Tensor:
        """This rank's draws of a step of ``rows`` trajectories over all ranks: [rows / data_world,
        max_turns, max_new_tokens] (as on_policy.rank_uniforms: a row's draws depend on its place only)."""
        every = rank_uniforms(generator, rows, self.limits.max_turns * max_new_tokens, par)
        return every.view(-1, self.limits.max_turns, max_new_tokens)

    def roll_out(self, model, engine, prompts: list[Prompt], params: SamplingParams, uniforms: torch.Tensor | None,
                 batch_size: int, device: torch.device, record_routes: bool = False
                 ) -> tuple[Rollouts, list[Trajectory]]:
        """A trajectory per prompt (each its own episode) and the training rows they make."""
        trajs = self.trajectories(engine, prompts, params, uniforms, batch_size, device, record_routes)
        return self.lay_out(model, trajs, device), trajs

    def lay_out(self, model, trajs: list[Trajectory], device: torch.device) -> Rollouts:
        """The trajectories as training rows (on_policy.lay_out; the tool tokens off the mask)."""
        return lay_out(model, as_samples(trajs), self.tokenizer, device)

    def trajectories(self, engine, prompts: list[Prompt], params: SamplingParams, uniforms: torch.Tensor | None,
                     batch_size: int, device: torch.device, record_routes: bool = False) -> list[Trajectory]:
        """A trajectory per prompt, each its own episode. Touches no model and runs no collective with an
        engine of its own process (asynchronous rollouts run it in a thread beside training)."""
        episodes = []
        for i, p in enumerate(prompts):
            try:
                episodes.append(self.env.reset(p.record))
            except ValueError as e:
                raise ValueError(f"{self.where}: environment {self.section.name!r} refused the record "
                                 f"{p.record!r:.200}: {e}") from None
        # an in-process engine on a sharded model samples with collectives: every rank runs every round
        lockstep = isinstance(engine, InProcessEngine)
        trajs = roll_out_turns(engine, episodes, [p.record for p in prompts], self.codec, self.tokenizer, params,
                               self.limits, uniforms, batch_size, record_routes,
                               (lambda n: agree_max(n, device)) if lockstep else int, self.section.tool_workers)
        return trajs

    def completions(self, trajs: list[Trajectory]) -> list[Completion]:
        """The trajectories as reward inputs: ``text`` the last model turn, ``trajectory`` the whole."""
        return [Completion(self.tokenizer.decode(t.turn_ids[-1]), t.record, self.thinking, t.finished, t)
                for t in trajs]

    @staticmethod
    def metrics(trajs: list[Trajectory], par: Parallel, device: torch.device) -> dict[str, float]:
        """Per trajectory over all ranks: ``env/turns``, ``env/tool_calls``, ``env/tool_errors`` (results
        not ok, malformed calls included), ``env/parse_errors`` (malformed calls), ``env/tool_seconds``,
        ``env/answered`` (the share that ended with an answer rather than a limit)."""
        sums = torch.tensor([float(len(trajs)), sum(len(t.turns) for t in trajs), sum(t.calls for t in trajs),
                             sum(t.tool_errors for t in trajs), sum(t.parse_errors for t in trajs),
                             sum(t.tool_seconds for t in trajs), sum(t.finished for t in trajs)],
                            dtype=torch.float64, device=device)
        n, *totals = par.all_reduce_sum(sums).tolist()
        return {f"env/{k}": v / max(n, 1.0) for k, v in zip(METRICS, totals)}
