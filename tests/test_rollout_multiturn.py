"""Multi-turn rollouts (trex.rollout.multiturn) against a scripted engine: the trajectory holds exactly the
engine's ids for model turns and the template's ids for tool turns (never a re-tokenised history), the
limits end it, a malformed call is answered and the run goes on; each token's mask, log-prob, version
and routes."""

import time

import pytest
import torch

from trex.data.tokenizer import compact_tokenizer
from trex.data.tool_calls import ToolCall, tool_codec
from trex.rollout.environment import ToolsEnvironment
from trex.rollout.multiturn import TurnLimits, roll_out_turns
from trex.rollout.sampling import Samples, SamplingParams
from trex.rollout.tools import ToolResult

TOK = compact_tokenizer()
CODEC = tool_codec("deepseek-v4", thinking=False)
EOS = [TOK.eos_id]


def call(expression: str) -> list[int]:
    """A calling turn as the model would sample it (EOS included)."""
    return TOK.encode(CODEC.assistant("", [{"name": "calculator", "arguments": {"expression": expression}}])).tolist()


def spelled(text: str) -> list[int]:
    """``text`` one character token at a time, even where it spells a special token: what a model may sample,
    and what a decode followed by an encode turns into other ids."""
    return [TOK.backend.token_to_id(ch) for ch in text]


class ScriptedEngine:
    """Samples ``script[turn]`` (a list of ids, or a function of the prompt) for every row of a round, with
    log-probs -(position + 1) / 100, version ``version``, and routes that name the call which fed each token
    (layer "layers.0": [fed, 1] filled with the call's index). Records the prompts and uniforms it got."""

    def __init__(self, script, version: int = 3):
        self.script, self.version, self.calls = script, version, []

    def generate(self, prompts, params, uniforms, batch_size, record_routes=False):
        turn = len(self.calls)
        self.calls.append(([list(p) for p in prompts], None if uniforms is None else uniforms.clone(), params))
        step = self.script[min(turn, len(self.script) - 1)]
        outs = [(step(p) if callable(step) else list(step))[:params.max_new_tokens] for p in prompts]
        routes = None
        if record_routes:
            routes = [{"layers.0": torch.full((len(p) + len(c) - 1, 1), turn)} for p, c in zip(prompts, outs)]
        return Samples([list(p) for p in prompts], outs, [[-(j + 1) / 100 for j in range(len(c))] for c in outs],
                       [bool(c) and c[-1] == TOK.eos_id for c in outs], routes, self.version)


def run(script, limits=TurnLimits(), records=({"prompt": "What is 2+3?"},), env=None, max_new_tokens=400,
        **kwargs):
    env = env or ToolsEnvironment(tools=["calculator"])
    engine = ScriptedEngine(script)
    params = SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens, stop_ids=tuple(EOS))
    trajs = roll_out_turns(engine, [env.reset(r) for r in records], list(records), CODEC, TOK, params, limits,
                           kwargs.pop("uniforms", None), 8, **kwargs)
    return trajs, engine


def test_model_turns_are_the_engines_ids_and_tool_turns_the_templates():
    # the first turn spells "</think>" and "<think>" character by character: a history decoded and encoded
    # again would hold the special tokens instead, so a loop that re-tokenised could not give these ids
    first = spelled("</think><think>") + call("2+3")
    answer = TOK.encode("5").tolist() + EOS
    (t,), engine = run([first, answer], record_routes=True)
    tool = TOK.encode(CODEC.results(["5"])).tolist()
    assert t.ids == first + tool + answer
    assert t.sampled == [True] * len(first) + [False] * len(tool) + [True] * len(answer)
    assert t.logprobs == pytest.approx([-(j + 1) / 100 for j in range(len(first))] + [0.0] * len(tool)
                                       + [-(j + 1) / 100 for j in range(len(answer))])
    assert t.versions == [3] * len(first) + [-1] * len(tool) + [3] * len(answer)
    assert (t.stop, t.finished, t.calls, t.tool_errors, t.parse_errors) == ("answer", True, 1, 0, 0)
    assert t.results[0][0].content == "5" and [turn.content for turn in t.turns] == ["</think><think>", "5"]
    # the engine was given ids: the prompt, then prompt + its own first turn + the template's tool turn
    prompt = TOK.encode(CODEC.prompt("", "What is 2+3?", [ToolsEnvironment(["calculator"]).reset(
        {"prompt": ""}).tools[0]])).tolist()
    assert t.prompt_ids == prompt
    assert [c[0] for c in engine.calls] == [[prompt], [prompt + first + tool]]
    # routes: every fed token (all but the last) once, each from the call that fed it first
    fed_first = len(prompt) + len(first) - 1
    assert t.routes["layers.0"][:, 0].tolist() == [0] * fed_first + [1] * (len(t.prompt_ids) + len(t.ids) - 1
                                                                             - fed_first)
    # the plant: decoding the trajectory and encoding it again gives other ids, which the checks above reject
    again = TOK.encode(TOK.decode(t.prompt_ids + t.ids)).tolist()
    assert again != t.prompt_ids + t.ids and again[len(prompt):len(prompt) + len(first)] != first


def test_a_malformed_call_is_answered_with_a_message_and_the_run_goes_on():
    bad = TOK.encode('\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="calculator">\n<｜DSML｜parameter '
                     'name="expression" string="false">2+</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
                     '</｜DSML｜tool_calls>').tolist() + EOS
    unknown = TOK.encode(CODEC.assistant("", [{"name": "shell", "arguments": {"cmd": "ls"}}])).tolist()
    (t,), _ = run([bad, unknown, TOK.encode("ok").tolist() + EOS])
    assert (t.stop, len(t.turns), t.calls, t.parse_errors, t.tool_errors) == ("answer", 3, 2, 1, 2)
    assert t.results[0][0].content.startswith("Error: malformed tool call to calculator: parameter 'expression'")
    assert t.results[1][0].content.startswith("Error: unknown tool 'shell'")


def test_limits_end_the_trajectory():
    calls = call("1+1")
    # max_turns: the calls of the last allowed turn are not run; the trajectory ends with that model turn
    (t,), engine = run([calls], TurnLimits(max_turns=2))
    assert (t.stop, t.finished, len(t.turns), len(t.results), len(engine.calls)) == ("max_turns", False, 2, 1, 2)
    assert t.sampled[-1] and t.ids[-len(calls):] == calls
    # max_tokens: a turn is cut at what is left of the budget (that row's own, in a round sampled for the
    # longest budget)
    tool = len(TOK.encode(CODEC.results(["2"])))
    (t,), engine = run([calls], TurnLimits(max_tokens=len(calls) + tool + 5))
    assert (t.stop, len(t.ids), t.ids[-5:]) == ("length", len(calls) + tool + 5, calls[:5])
    assert engine.calls[1][2].max_new_tokens == 5
    # ... and results that would leave no token for another turn are not appended
    (t,), _ = run([calls], TurnLimits(max_tokens=len(calls) + tool))
    assert (t.stop, t.ids, len(t.results)) == ("max_tokens", calls, 1)
    # tool seconds: once spent, the next calls end the trajectory unanswered
    slow = SlowEnvironment(0.05)
    (t,), _ = run([calls], TurnLimits(tool_seconds=0.02), env=slow)
    assert (t.stop, len(t.results), slow.left) == ("tool_seconds", 1, [pytest.approx(0.02)])
    assert t.tool_seconds >= 0.05


def test_python_runs_at_most_for_the_tool_seconds_left():
    code = TOK.encode(CODEC.assistant("", [{"name": "python", "arguments": {"code": "while True: pass"}}])).tolist()
    start = time.monotonic()
    (t,), _ = run([code, EOS], TurnLimits(tool_seconds=0.5), env=ToolsEnvironment(tools=["python"]))
    assert time.monotonic() - start < 5 and t.tool_seconds < 3
    assert "timed out after 0.5 s" in t.results[0][0].content and t.tool_errors == 1


def test_rows_end_independently_and_each_turn_gets_its_own_draws():
    answer, calls = TOK.encode("7").tolist() + EOS, call("3+4")

    def first(prompt):  # the second record answers at once, the first calls a tool
        return calls if TOK.encode("first").tolist()[0] in prompt[-40:] else answer
    uniforms = torch.rand(2, 3, 400)
    trajs, engine = run([first, answer], records=({"prompt": "first"}, {"prompt": "2nd"}), uniforms=uniforms)
    assert [t.stop for t in trajs] == ["answer", "answer"] and [len(t.turns) for t in trajs] == [2, 1]
    assert len(engine.calls[1][0]) == 1  # round 2 samples the row still going only
    torch.testing.assert_close(engine.calls[0][1], uniforms[:, 0])
    n = engine.calls[1][2].max_new_tokens  # the longest budget left
    assert n == 512 - (len(trajs[0].ids) - len(answer))
    torch.testing.assert_close(engine.calls[1][1], uniforms[:1, 1, :n])


class SlowEnvironment:
    """Each step takes ``seconds`` and records the seconds it was given."""

    def __init__(self, seconds):
        self.seconds, self.left = seconds, []

    def reset(self, record):
        env = self

        class Episode:
            system, user = "", record["prompt"]
            tools = ToolsEnvironment(["calculator"]).reset(record).tools

            def step(self, calls, seconds_left):
                env.left.append(seconds_left)
                time.sleep(env.seconds)
                return [ToolResult("2", True, env.seconds) for _ in calls]
        return Episode()


def test_the_tools_environment_reads_prompt_and_messages_records():
    env = ToolsEnvironment(tools=["calculator", "python"])
    ep = env.reset({"prompt": "2+3?", "system": "Be brief."})
    assert (ep.system, ep.user, [t["function"]["name"] for t in ep.tools]) == ("Be brief.", "2+3?",
                                                                               ["calculator", "python"])
    sft = {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "U"},
                        {"role": "assistant", "content": "5"}]}
    assert (env.reset(sft).system, env.reset(sft).user) == ("S", "U")
    # schemas = false: the prompt lists no tools, the calls are answered all the same
    quiet = ToolsEnvironment(tools=["calculator"], schemas=False).reset({"prompt": "2+3?"})
    assert quiet.tools == [] and quiet.step([ToolCall("calculator", {"expression": "2+3"})], 1.0)[0].content == "5"
    with pytest.raises(ValueError, match="expected"):
        env.reset({"messages": [{"role": "user", "content": "a"}, {"role": "tool", "content": "b"}]})
    with pytest.raises(ValueError, match="tools \\['shell'\\]: expected some of"):
        ToolsEnvironment(tools=["shell"])
