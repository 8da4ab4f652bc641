"""The calculator demonstration (trex.train.tool_demo, docs/post_training.md): its warm-up data renders as
the trajectories the rollout builds, and on a short run with a fixed seed the arm with the calculator
out-earns the same run without tools, its env/* metrics logged."""

import json

import pytest

from trex.data.arithmetic import Problem, tool_call_records
from trex.data.chat import render_conversation
from trex.data.tool_calls import ToolCall, tool_codec
from trex.rollout.environment import ToolsEnvironment


def test_a_demonstration_renders_as_the_trajectory_the_rollout_builds():
    """The warm-up teaches the very tokens a rollout samples and appends: the prompt of an episode that
    lists no tools, the call, the calculator's answer as V4 renders a tool result, the copied answer;
    the loss on the model's two turns only."""
    (record,) = tool_call_records([Problem(12345, "+", 67890)])
    segments = render_conversation(record["messages"], thinking=False)
    codec = tool_codec("deepseek-v4", thinking=False)
    episode = ToolsEnvironment(["calculator"], schemas=False).reset({"prompt": "12345+67890"})
    call = {"name": "calculator", "arguments": {"expression": "12345+67890"}}
    (result,) = episode.step([ToolCall(**call)], 1.0)
    assert result.ok and result.content == "80235"
    turns = [codec.assistant("", [call]), codec.assistant("80235")]
    want = codec.prompt(episode.system, episode.user, episode.tools) + turns[0] + codec.results(["80235"]) + turns[1]
    assert "".join(s.text for s in segments) == want
    assert [s.text for s in segments if s.trainable] == turns
