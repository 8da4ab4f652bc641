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


SHORT = {  # a run of seconds: the plumbing of both arms, not the learning (docs/post_training.md measures that)
    "warmup": ["train.steps=2", "schedule.warmup_steps=1", "data.micro_batch_size=1", "train.log_every=1"],
    "grpo": ["train.steps=2", "grpo.prompts_per_step=1", "grpo.group_size=2", "sampling.max_new_tokens=8",
             "environment.max_tokens=16"],
}


@pytest.mark.slow
def test_both_arms_run_from_the_recipes_and_the_report_holds_their_metrics(tmp_path, monkeypatch):
    from trex.train import tool_demo

    monkeypatch.chdir(tool_demo_root())
    demo = tool_demo.ToolDemo(out=str(tmp_path / "demo"), demonstrations=4, prompts=4, warmup_set=SHORT["warmup"],
                              grpo_set=SHORT["grpo"])
    summary = tool_demo.run(demo)
    assert set(summary) == {"tools", "no_tools"} and all(s["steps"] == 2 for s in summary.values())
    tools = tool_demo.read_metrics(str(tmp_path / "demo" / "grpo_tools"))
    plain = tool_demo.read_metrics(str(tmp_path / "demo" / "grpo_no_tools"))
    assert all(k in r for r in tools for k in tool_demo.ENV_METRICS)  # the tool arm logs its env metrics
    assert not any(k.startswith("env/") for r in plain for k in r)  # the no-tool arm is single-turn
    for name in ("tool_demo.png", "tool_demo.md", "tool_demo.json"):
        assert (tmp_path / "demo" / name).stat().st_size > 0
    table = (tmp_path / "demo" / "tool_demo.md").read_text().splitlines()
    assert table[2].startswith("| tools | 2 |") and table[3].startswith("| no-tools | 2 |") and table[3].endswith("| - |")
    # each arm's GRPO started from its own warm-up's exported model
    for arm in tool_demo.ARMS:
        config = (tmp_path / "demo" / f"grpo_{arm}" / "config.toml").read_text()
        assert f'path = "{tmp_path / "demo" / f"warmup_{arm}" / "model"}"' in config
    assert json.loads((tmp_path / "demo" / "tool_demo.json").read_text()) == summary


def tool_demo_root():
    """The checkout's root, where the recipes the demonstration names live."""
    import os

    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
