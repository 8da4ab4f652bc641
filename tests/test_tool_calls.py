"""The tool-call codec of each DeepSeek family against the released templates and encoders.

The expected strings below are written out from reading the references (none of their code is in
the repository); each block names its source:

* V3 / R1: the ``chat_template`` of deepseek-ai/DeepSeek-R1-0528 tokenizer_config.json (as embedded in
  public copies, e.g. for DeepSeek-R1-0528-Qwen3-8B; R1-Distill's in ggml-org/llama.cpp
  models/templates/deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja): ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>``
  + type + ``<｜tool▁sep｜>`` + name + "\\n```json\\n" + arguments + "\\n```" + ``<｜tool▁call▁end｜>``, later
  calls after "\\n", then ``<｜tool▁calls▁end｜><｜end▁of▁sentence｜>``; outputs
  ``<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>`` ... ``<｜tool▁output▁end｜>`` joined by "\\n", closed by
  ``<｜tool▁outputs▁end｜>``, the answer following with no ``<｜Assistant｜>``. No tool schemas in the
  templates: the system block is the model card's function-calling form (DeepSeek-V2.5's card,
  "## Tools / ### Function / You have the following functions available:").
* V3.1: huggingface.co/deepseek-ai/DeepSeek-V3.1 README "ToolCall" (tool_description) and its
  ``chat_template`` (ggml-org/llama.cpp models/templates/deepseek-ai-DeepSeek-V3.1.jinja).
* V3.2: huggingface.co/deepseek-ai/DeepSeek-V3.2 encoding/encoding_dsv32.py (vLLM's copy,
  vllm/tokenizers/deepseek_v32_encoding.py): TOOLS_SYSTEM_TEMPLATE, ``function_calls`` blocks,
  ``\\n\\n<function_results>\\n<result>..</result>\\n</function_results>\\n\\n`` + ``<think>``/``</think>``.
* V4: huggingface.co/deepseek-ai/DeepSeek-V4-Flash encoding/encoding_dsv4.py, already encoded by
  trex.data.chat (tests/test_data_chat.py); the codec must agree with it.
* V4.1: DeepSeek-V4.1-Flash encoding/encoding_dsv41.py (sglang python/sglang/srt/entrypoints/openai/
  encoding_dsv41.py, "Adapted from the DeepSeek-V4.1 release reference implementation"): tag names
  ``" calls"``, ``" invoke"``, ``" parameter"``; ``<｜System｜>``; "Reasoning Effort: 50 ..." in thinking mode.
"""

import json

import pytest

from trex.data.chat import render_conversation, render_prompt
from trex.data.tokenizer import ASSISTANT, BOS, EOS, USER, load_tokenizer
from trex.data.tool_calls import FAMILIES, ToolCall, tool_codec

TOOLS = [{"type": "function", "function": {
    "name": "weather", "description": "Current weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
SYS, USER_TEXT = "You are helpful.", "Weather in Paris?"
CALL = {"name": "weather", "arguments": {"city": "Paris"}}
D = "｜DSML｜"
TCSB, TCSE, TCB, TCE, SEP = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
                             "<｜tool▁call▁end｜>", "<｜tool▁sep｜>")
TOSB, TOSE, TOB, TOE = ("<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>",
                        "<｜tool▁output▁end｜>")


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("deepseek-v4")  # carries V3's tool markers and V4's DSML under the same ids


def trajectory(codec, reasoning=("", "")):
    """prompt + a calling turn + its result + the final answer, as a rollout appends them."""
    return (codec.prompt(SYS, USER_TEXT, TOOLS) + codec.assistant("", [CALL], reasoning=reasoning[0])
            + codec.results(["18C"]) + codec.assistant("Paris: 18C.", reasoning=reasoning[1]))


V3_TOOLS = ("\n\n## Tools\n\n### Function\n\nYou have the following functions available:\n\n- `weather`:\n```json\n"
            + json.dumps(TOOLS[0]["function"], indent=4) + "\n```")
V3_CALL = TCSB + TCB + "function" + SEP + 'weather\n```json\n{"city": "Paris"}\n```' + TCE + TCSE + EOS


def test_v3_released_form():
    want = (BOS + SYS + V3_TOOLS + USER + USER_TEXT + ASSISTANT + V3_CALL
            + TOSB + TOB + "18C" + TOE + TOSE + "Paris: 18C." + EOS)
    codec = tool_codec("deepseek-v3", thinking=False)
    assert trajectory(codec) == want
    two = codec.assistant("", [CALL, {"name": "time", "arguments": {}}])
    assert two == (TCSB + TCB + "function" + SEP + 'weather\n```json\n{"city": "Paris"}\n```' + TCE + "\n"
                   + TCB + "function" + SEP + "time\n```json\n{}\n```" + TCE + TCSE + EOS)
    assert codec.results(["a", "b"]) == TOSB + TOB + "a" + TOE + "\n" + TOB + "b" + TOE + TOSE


def test_r1_released_form():
    # R1's generation prompt ends "<think>\n"; the model writes "{reasoning}\n</think>\n\n{answer}"
    want = (BOS + SYS + V3_TOOLS + USER + USER_TEXT + ASSISTANT + "<think>\n" + "look it up\n</think>\n\n" + V3_CALL
            + TOSB + TOB + "18C" + TOE + TOSE + "think again\n</think>\n\nParis: 18C." + EOS)
    codec = tool_codec("deepseek-v3", thinking=True)
    assert trajectory(codec, ("look it up", "think again")) == want
    assert not codec.reasoning_kept(after_last_user=True)  # the template keeps only what follows </think>


V31_TOOLS = """## Tools
You have access to the following tools:

### weather
Description: Current weather

Parameters: {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}

IMPORTANT: ALWAYS adhere to this exact format for tool use:
<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>tool_call_name<｜tool▁sep｜>tool_call_arguments<｜tool▁call▁end｜>{additional_tool_calls}<｜tool▁calls▁end｜>

Where:
- `tool_call_name` must be an exact match to one of the available tools
- `tool_call_arguments` must be valid JSON that strictly follows the tool's Parameters Schema
- For multiple tool calls, chain them directly without separators or spaces
"""


def test_v31_released_form():
    codec = tool_codec("deepseek-v3.1", thinking=False)
    want = (BOS + SYS + "\n\n" + V31_TOOLS + USER + USER_TEXT + ASSISTANT + "</think>"
            + TCSB + TCB + 'weather' + SEP + '{"city": "Paris"}' + TCE + TCSE + EOS
            + TOB + "18C" + TOE + "Paris: 18C." + EOS)
    assert trajectory(codec) == want
    # the same conversation through trex's V3.1 chat renderer (checked against the released template)
    messages = [{"role": "system", "content": SYS}, {"role": "user", "content": USER_TEXT},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "content": "18C"}, {"role": "assistant", "content": "Paris: 18C."}]
    rendered = "".join(s.text for s in render_conversation(messages, thinking=False, chat_format="deepseek-v3.1"))
    assert trajectory(codec).replace("\n\n" + V31_TOOLS, "") == rendered
    with pytest.raises(ValueError, match="non-thinking"):
        tool_codec("deepseek-v3.1", thinking=True)


V32_TOOLS = f"""## Tools
You have access to a set of tools you can use to answer the user's question.
You can invoke functions by writing a "<{D}function_calls>" block like the following as part of your reply to the user:
<{D}function_calls>
<{D}invoke name="$FUNCTION_NAME">
<{D}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{D}parameter>
...
</{D}invoke>
<{D}invoke name="$FUNCTION_NAME2">
...
</{D}invoke>
</{D}function_calls>
String and scalar parameters should be specified as is without any escaping or quotes, while lists and objects should use JSON format. The "string" attribute should be set to "true" for string type parameters and "false" for other types (numbers, booleans, arrays, objects).
If the thinking_mode is enabled, then after function results you should strongly consider outputting a thinking block. Here is an example:
<{D}function_calls>
...
</{D}function_calls>
<function_results>
...
</function_results>
<think>...thinking about results</think>
Here are the functions available in JSONSchema format:
<functions>
{json.dumps(TOOLS[0]["function"])}
</functions>
"""


def dsml_call(block, invoke="invoke", parameter="parameter"):
    return (f'\n\n<{D}{block}>\n<{D}{invoke} name="weather">\n<{D}{parameter} name="city" string="true">Paris'
            f'</{D}{parameter}>\n</{D}{invoke}>\n</{D}{block}>')


@pytest.mark.parametrize("thinking", [False, True])
def test_v32_released_form(thinking):
    codec = tool_codec("deepseek-v3.2", thinking=thinking)
    r = ("look</think>", "again</think>") if thinking else ("", "")
    want = (BOS + SYS + "\n\n" + V32_TOOLS + USER + USER_TEXT + ASSISTANT + ("<think>" if thinking else "</think>")
            + r[0] + dsml_call("function_calls") + EOS
            + "\n\n<function_results>\n<result>18C</result>\n</function_results>\n\n"
            + ("<think>" if thinking else "</think>") + r[1] + "Paris: 18C." + EOS)
    assert trajectory(codec, ("look", "again") if thinking else ("", "")) == want
    # drop_thinking_messages: reasoning kept for turns after the last user message only
    assert codec.reasoning_kept(after_last_user=True) and not codec.reasoning_kept(after_last_user=False)


@pytest.mark.parametrize("thinking", [False, True])
def test_v4_agrees_with_the_v4_chat_encoder(thinking):
    codec = tool_codec("deepseek-v4", thinking=thinking)
    messages = [{"role": "system", "content": SYS, "tools": TOOLS}, {"role": "user", "content": USER_TEXT},
                {"role": "assistant", "content": "", "reasoning_content": "look", "tool_calls": [
                    {"type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "content": "18C"},
                {"role": "assistant", "content": "Paris: 18C.", "reasoning_content": "again"}]
    rendered = "".join(s.text for s in render_conversation(messages, thinking=thinking))
    assert trajectory(codec, ("look", "again")) == rendered
    assert dsml_call("tool_calls") in rendered
    assert (USER + "<tool_result>18C</tool_result>" + ASSISTANT + ("<think>" if thinking else "</think>")) in rendered
    assert codec.reasoning_kept(after_last_user=False)  # tools defined: encode_messages keeps all reasoning


@pytest.mark.parametrize("family", ["deepseek-v3", "deepseek-v3.1", "deepseek-v4"])
def test_no_tools_renders_the_prompt_of_a_conversation_without_tools(family):
    """An episode that lists no tools: no tools block, as the chat encoder renders a conversation with none
    (the calculator demonstration's short prompts); V3.2's and V4.1's share V4's rule."""
    for system, messages in (("", []), (SYS, [{"role": "system", "content": SYS}])):
        want = render_prompt([*messages, {"role": "user", "content": USER_TEXT}], thinking=False, chat_format=family)
        assert tool_codec(family, thinking=False).prompt(system, USER_TEXT, []) == want
    for family in ("deepseek-v3.2", "deepseek-v4.1"):
        assert "## Tools" not in tool_codec(family, thinking=False).prompt(SYS, USER_TEXT, [])


def test_v41_released_form():
    v4, v41 = tool_codec("deepseek-v4", thinking=True), tool_codec("deepseek-v4.1", thinking=True)
    text = trajectory(v41, ("look", "again"))
    effort = "Reasoning Effort: 50 (range 1-100, the higher the value, the more thorough the reasoning)\n\n"
    assert text.startswith(BOS + "<｜System｜>" + effort + SYS + "\n\n## Tools\n\n")
    assert dsml_call(" calls", " invoke", " parameter") in text
    assert f'You can invoke tools by writing a "<{D} calls>" block' in text
    assert f'<{D} parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{D} parameter>' in text
    assert f"{D}tool_calls" not in text and f"<{D}invoke" not in text and f"<{D}parameter" not in text
    # apart from the tag names, the system token and the effort line, V4.1 renders as V4
    back = (text.replace("<｜System｜>" + effort, "").replace(f"{D} calls", f"{D}tool_calls")
            .replace(f"{D} invoke", f"{D}invoke").replace(f"{D} parameter", f"{D}parameter"))
    assert back == trajectory(v4, ("look", "again"))
    assert not tool_codec("deepseek-v4.1", thinking=False).prompt(SYS, USER_TEXT, TOOLS).count("Reasoning Effort")


CASES = [(f, t) for f in FAMILIES for t in (False, True) if not (f == "deepseek-v3.1" and t)]


@pytest.mark.parametrize("family,thinking", CASES)
def test_calls_round_trip_through_token_ids(tok, family, thinking):
    codec = tool_codec(family, thinking=thinking)
    calls = [CALL, {"name": "python", "arguments": {"code": "print(1 < 2)\n", "n": [1, 2.5, None], "ok": True}}]
    reasoning = "think\nhard" if thinking else ""
    ids = tok.encode(codec.assistant("Let me check.", calls, reasoning=reasoning))
    turn = codec.parse(ids, tok)
    assert turn.finished and turn.reasoning == reasoning and turn.content == "Let me check."
    assert turn.calls == tuple(ToolCall(c["name"], c["arguments"]) for c in calls)
    final = codec.parse(tok.encode(codec.assistant("Done.", reasoning=reasoning)), tok, after_results=True)
    assert final.calls == () and final.content == "Done." and final.finished
    cut = codec.parse(ids[:-3], tok)  # cut off inside the calls block: an error call, no exception
    assert not cut.finished and len(cut.calls) == 1 and "cut off" in cut.calls[0].error


def test_markers_spelled_in_plain_text_are_not_calls(tok):
    """The parser reads marker token ids: text that spells a marker (no special token) is content."""
    codec = tool_codec("deepseek-v3.1", thinking=False)
    text = codec.assistant("", [CALL])
    ids = []
    for piece in text.replace("｜>", "｜\x00>").split("\x00"):  # split each marker so it encodes as plain text
        ids += tok.encode(piece).tolist()
    turn = codec.parse(ids, tok)
    assert turn.calls == () and TCB in turn.content and not turn.finished
    assert codec.parse(tok.encode(text), tok).calls == (ToolCall("weather", {"city": "Paris"}),)


@pytest.mark.parametrize("family,completion,error", [
    ("deepseek-v3.1", TCSB + TCB + "weather" + SEP + "{city: Paris}" + TCE + TCSE + EOS, "not valid JSON"),
    ("deepseek-v3.1", TCSB + TCB + "weather" + SEP + "[1]" + TCE + TCSE + EOS, "JSON list"),
    ("deepseek-v3.1", TCSB + "weather(Paris)" + TCSE + EOS, "expected"),
    ("deepseek-v3", TCSB + TCB + "function" + SEP + "weather\n{\"city\": 1}" + TCE + TCSE + EOS, "expected"),
    ("deepseek-v4", f'\n\n<{D}tool_calls>\n<{D}invoke name="weather">\n<{D}parameter name="n" string="false">'
                    f'one</{D}parameter>\n</{D}invoke>\n</{D}tool_calls>' + EOS, "not JSON"),
    ("deepseek-v4", f'\n\n<{D}tool_calls>\n<{D}invoke name="weather">\n<{D}parameter name="a" string="true">1'
                    f'</{D}parameter>\n<{D}parameter name="a" string="true">2</{D}parameter>\n</{D}invoke>\n'
                    f'</{D}tool_calls>' + EOS, "given twice"),
    ("deepseek-v4", f'\n\n<{D}tool_calls>\n<{D}invoke name="weather">\n' + EOS, "no </"),
    ("deepseek-v4", f'<{D}tool_calls>\n<{D}invoke name="weather">\n</{D}invoke>\n</{D}tool_calls>' + EOS,
     "expected the calls block to open"),
    ("deepseek-v3.2", f'\n\n<{D}function_calls>\n<{D}invoke name="weather">\ncity=Paris\n</{D}invoke>\n'
                      f'</{D}function_calls>' + EOS, "expected"),
])
def test_malformed_calls_become_errors_not_exceptions(tok, family, completion, error):
    turn = tool_codec(family, thinking=False).parse(tok.encode(completion), tok)
    assert turn.calls and any(c.arguments is None and error in c.error for c in turn.calls), turn.calls


def test_tokenizer_without_the_markers_is_refused_in_one_line():
    from trex.data.tokenizer import compact_tokenizer
    with pytest.raises(ValueError, match="tool▁calls▁begin") as err:
        tool_codec("deepseek-v3", thinking=False).parse([0], compact_tokenizer())
    assert "\n" not in str(err.value)
    assert tool_codec("deepseek-v4", thinking=False).parse(
        compact_tokenizer().encode("hi" + EOS), compact_tokenizer()).content == "hi"  # V4's markers are in it
    with pytest.raises(ValueError, match="family"):
        tool_codec("kimi", thinking=False)
