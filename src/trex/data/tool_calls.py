"""Tool calls in DeepSeek's own formats: one codec per family trex trains.

A codec renders the pieces of a tool-using trajectory as the release's template or encoder renders
them, and parses an assistant turn's calls from the sampled token ids:

    codec = tool_codec("deepseek-v4", thinking=True)
    text = codec.prompt(system, user, tools)          # BOS ... generation prompt
    turn = codec.parse(completion_ids, tokenizer)     # AssistantTurn(reasoning, content, calls, finished)
    text += codec.results(["18C", "24C"])             # the tool outputs, through the next generation prompt

Families, named like ``[data] chat_format``'s formats (which has no V3.2 or V4.1 yet): deepseek-v3
(R1's form with ``thinking``), deepseek-v3.1 (non-thinking only), deepseek-v3.2, deepseek-v4,
deepseek-v4.1. Their rules (calls, results, tool schemas, the reasoning kept in the history) are
tabled in docs/post_training.md ("Tool calls"); each codec class names its source.

Calls are parsed from token ids, never from a decode that skips special tokens (the markers are
special tokens): each marker id becomes a sentinel character before any text is matched, so text that
merely spells a marker is never read as one. A malformed call is a :class:`ToolCall` with ``error``
set (what was wrong, for the tool message), never an exception.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from trex.data.chat import (R1_THINK_CLOSE, R1_THINK_OPEN, TOOL_CALL_BEGIN, TOOL_CALL_END, TOOL_CALLS_BEGIN,
                            TOOL_CALLS_END, TOOL_OUTPUT_BEGIN, TOOL_OUTPUT_END, TOOL_SEP, TOOLS_PROMPT,
                            dsml_tool_calls, v31_tool_calls)
from trex.data.tokenizer import ASSISTANT, BOS, DSML, EOS, THINK_END, THINK_START, USER, Tokenizer

FAMILIES = ("deepseek-v3", "deepseek-v3.1", "deepseek-v3.2", "deepseek-v4", "deepseek-v4.1")
TOOL_OUTPUTS_BEGIN, TOOL_OUTPUTS_END = "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>"
SYSTEM = "<｜System｜>"  # V4.1's system token (V4.1's tokenizer; not in V4's)


@dataclass(frozen=True)
class ToolCall:
    """One call of an assistant turn: ``arguments`` a dict, or None with ``error`` saying what was wrong."""
    name: str
    arguments: dict | None
    error: str | None = None


@dataclass(frozen=True)
class AssistantTurn:
    """A parsed assistant turn. ``finished``: it ended with EOS (else it was cut off)."""
    reasoning: str
    content: str
    calls: tuple[ToolCall, ...]
    finished: bool


def _schemas(tools: list[dict]) -> list[dict]:
    """OpenAI-form tools ``[{"type": "function", "function": {...}}]`` -> the function dicts."""
    if not isinstance(tools, list) or not all(isinstance(t, dict) and isinstance(t.get("function"), dict)
                                              and isinstance(t["function"].get("name"), str) for t in tools):
        raise ValueError('tools must be a list of {"type": "function", "function": {"name": ..., ...}}')
    return [t["function"] for t in tools]


def _openai_calls(calls: list[dict]) -> list[dict]:
    """``[{"name": str, "arguments": dict}]`` -> the OpenAI form the chat encoders take."""
    return [{"type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}} for c in calls]


def _json_object(text: str) -> tuple[dict | None, str | None]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        return None, f"arguments are not valid JSON ({err.msg} at char {err.pos}): {text[:200]!r}"
    if not isinstance(value, dict):
        return None, f"arguments are a JSON {type(value).__name__}, expected an object: {text[:200]!r}"
    return value, None


class ToolCodec:
    """The tool-call format of one family in one mode (``thinking``). Subclasses fill in the format."""

    family: str
    markers: tuple[str, ...]  # special tokens the parser reads; each must be one token id
    reopens_thinking = True  # thinking mode: results() ends by opening the next turn's reasoning

    def __init__(self, thinking: bool):
        self.thinking = thinking

    # ---- rendering ------------------------------------------------------------------------------
    def prompt(self, system: str, user: str, tools: list[dict]) -> str:
        """BOS, the system text with the tool schemas, the user turn and the generation prompt. No tools
        (``[]``): no tools block, the prompt of a conversation that defines none (as trex.data.chat renders
        it): a model that learnt the calls from demonstrations is still answered."""
        raise NotImplementedError

    def assistant(self, content: str = "", calls: list[dict] = (), reasoning: str = "") -> str:
        """An assistant turn as the model writes it after the generation prompt (EOS included);
        ``calls``: ``[{"name": str, "arguments": dict}]``."""
        raise NotImplementedError

    def results(self, outputs: list[str]) -> str:
        """What follows an assistant turn that made ``len(outputs)`` calls: the tool outputs in call
        order, through the prompt of the next assistant turn."""
        raise NotImplementedError

    def reasoning_kept(self, after_last_user: bool) -> bool:
        """Whether the release's template keeps an earlier assistant turn's reasoning in the history
        (``after_last_user``: the turn answers the latest user message, e.g. a tool-calling turn of it).
        Where it does not, a trajectory built by appending differs from the template's re-rendering."""
        raise NotImplementedError

    # ---- parsing --------------------------------------------------------------------------------
    def marker_ids(self, tokenizer: Tokenizer) -> dict[int, str]:
        """Token id -> marker; ValueError naming the markers ``tokenizer`` lacks as single tokens."""
        if getattr(self, "_for", None) is tokenizer:
            return self._ids
        ids, missing = {}, []
        for m in self.markers:
            tid = tokenizer.backend.token_to_id(m)
            if tid is None or tokenizer.backend.encode(m, add_special_tokens=False).ids != [tid]:
                missing.append(m)
            else:
                ids[tid] = m
        if missing:
            raise ValueError(f"tokenizer {tokenizer.source} lacks the {self.family} tool-call marker(s) "
                             f"{', '.join(missing)} as single tokens")
        self._for, self._ids = tokenizer, ids
        return ids

    def parse(self, ids, tokenizer: Tokenizer, *, after_results: bool = False) -> AssistantTurn:
        """The assistant turn sampled as ``ids`` (after the generation prompt, or after :meth:`results`
        with ``after_results``; EOS ends the turn). Malformed calls come back as ToolCall(error=...)."""
        text = _sentinel_text(ids, tokenizer, self.marker_ids(tokenizer), self.markers)
        s = {m: _sentinel(i) for i, m in enumerate(self.markers)}
        finished = s[EOS] in text
        text = text.split(s[EOS], 1)[0]
        reasoning = ""
        if self.thinking:
            head, sep, rest = text.partition(s[THINK_END])
            if sep:
                reasoning, text = head, rest
            elif self.reopens_thinking or not after_results:  # reasoning never closed: no answer, no calls
                return AssistantTurn(_plain(head, s), "", (), finished)
        content, calls = self._parse_calls(text, s, finished)
        reasoning, content = self._trim(reasoning, content)
        return AssistantTurn(_plain(reasoning, s), _plain(content, s), tuple(calls), finished)

    def _parse_calls(self, text: str, s: dict[str, str], finished: bool) -> tuple[str, list[ToolCall]]:
        raise NotImplementedError

    def _trim(self, reasoning: str, content: str) -> tuple[str, str]:
        return reasoning, content


def _sentinel(k: int) -> str:
    return chr(0xE000 + k)  # a private-use character per marker


def _sentinel_text(ids, tokenizer: Tokenizer, marker_ids: dict[int, str], markers: tuple[str, ...]) -> str:
    """The decoded text of ``ids`` with each marker token replaced by its sentinel; text runs between
    markers are decoded with special tokens kept, private-use sentinels in them replaced by U+FFFD."""
    index = {m: k for k, m in enumerate(markers)}
    out, run = [], []

    def flush():
        if run:
            out.append(re.sub("[\ue000-\ue0ff]", "\ufffd", tokenizer.decode(run)))
            run.clear()
    for i in ids:
        m = marker_ids.get(int(i))
        if m is None:
            run.append(int(i))
        else:
            flush()
            out.append(_sentinel(index[m]))
    flush()
    return "".join(out)


def _plain(text: str, s: dict[str, str]) -> str:
    """Sentinels back to their marker strings (for reasoning/content that held stray markers)."""
    for m, c in s.items():
        text = text.replace(c, m)
    return text


# ---- DeepSeek-V3 / R1 -----------------------------------------------------------------------------
class V3Codec(ToolCodec):
    """DeepSeek-V3 (``thinking``: R1). Calls and results as the released tokenizer_config.json chat
    templates render them, in the terminated form of R1's and R1-0528's (calls joined by "\n" and closed
    by ``<｜tool▁calls▁end｜>``; outputs joined by "\n" as in V3's and R1-0528's; the original V3 template
    leaves a single call unterminated). The templates render no tool schemas, so the schemas go into
    the system text in the model card's function-calling form ("## Tools / ### Function")."""

    family = "deepseek-v3"
    reopens_thinking = False  # R1's template opens "<think>\n" after a user turn only
    markers = (EOS, THINK_END, TOOL_CALLS_BEGIN, TOOL_CALLS_END, TOOL_CALL_BEGIN, TOOL_CALL_END, TOOL_SEP)

    def prompt(self, system, user, tools):
        listing = "\n\n".join(f"- `{fn['name']}`:\n```json\n{json.dumps(fn, indent=4, ensure_ascii=False)}\n```"
                              for fn in _schemas(tools))
        head = f"{system}\n\n## Tools\n\n### Function\n\nYou have the following functions available:\n\n{listing}"
        return BOS + (head if tools else system) + USER + user + ASSISTANT + (R1_THINK_OPEN if self.thinking else "")

    def assistant(self, content="", calls=(), reasoning=""):
        text = (reasoning + R1_THINK_CLOSE) if self.thinking else ""
        text += content
        if calls:
            text += TOOL_CALLS_BEGIN + "\n".join(
                f"{TOOL_CALL_BEGIN}function{TOOL_SEP}{c['name']}\n```json\n"
                f"{json.dumps(c['arguments'], ensure_ascii=False)}\n```{TOOL_CALL_END}" for c in calls) + TOOL_CALLS_END
        return text + EOS

    def results(self, outputs):
        return (TOOL_OUTPUTS_BEGIN + "\n".join(TOOL_OUTPUT_BEGIN + o + TOOL_OUTPUT_END for o in outputs)
                + TOOL_OUTPUTS_END)

    def reasoning_kept(self, after_last_user):
        return False  # R1's template keeps only what follows </think> of an earlier turn

    def _trim(self, reasoning, content):
        # R1 writes "<think>\n{reasoning}\n</think>\n\n{answer}"; the prompt holds the first "\n"
        return (reasoning.removesuffix("\n"), content.removeprefix("\n\n")) if self.thinking else (reasoning, content)

    def _parse_calls(self, text, s, finished):
        pattern = re.compile(f"\n?{s[TOOL_CALL_BEGIN]}(.*?){s[TOOL_SEP]}(.*?)\n```json\n(.*?)\n```{s[TOOL_CALL_END]}",
                             re.DOTALL)

        def call(m):
            kind, name, args = m.groups()
            if kind != "function":
                return ToolCall(name, None, f"call type {kind!r}; expected 'function'")
            return ToolCall(name, *_json_object(args))

        return _block_calls(text, s, finished, pattern, call,
                            f"{TOOL_CALL_BEGIN}function{TOOL_SEP}NAME\\n```json\\n{{...}}\\n```{TOOL_CALL_END}")


# ---- DeepSeek-V3.1 --------------------------------------------------------------------------------
V31_TOOLS = """## Tools
You have access to the following tools:

{listing}IMPORTANT: ALWAYS adhere to this exact format for tool use:
<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>tool_call_name<｜tool▁sep｜>tool_call_arguments<｜tool▁call▁end｜>{{additional_tool_calls}}<｜tool▁calls▁end｜>

Where:
- `tool_call_name` must be an exact match to one of the available tools
- `tool_call_arguments` must be valid JSON that strictly follows the tool's Parameters Schema
- For multiple tool calls, chain them directly without separators or spaces
"""


class V31Codec(ToolCodec):
    """DeepSeek-V3.1: tool calls in non-thinking mode only (model card, "ToolCall"). Calls and results
    as the released chat template renders them; the tool description block from the model card."""

    family = "deepseek-v3.1"
    markers = (EOS, THINK_END, TOOL_CALLS_BEGIN, TOOL_CALLS_END, TOOL_CALL_BEGIN, TOOL_CALL_END, TOOL_SEP)

    def __init__(self, thinking: bool):
        if thinking:
            raise ValueError("DeepSeek-V3.1 calls tools in non-thinking mode only (its model card); "
                             "use thinking = false with deepseek-v3.1")
        super().__init__(thinking)

    def prompt(self, system, user, tools):
        listing = "".join(f"### {fn['name']}\nDescription: {fn.get('description', '')}\n\n"
                          f"Parameters: {json.dumps(fn.get('parameters', {}))}\n\n" for fn in _schemas(tools))
        return BOS + system + ("\n\n" + V31_TOOLS.format(listing=listing) if tools else "") + USER + user + ASSISTANT + THINK_END

    def assistant(self, content="", calls=(), reasoning=""):
        if not calls:
            return content + EOS
        args = [{**c, "arguments": json.dumps(c["arguments"], ensure_ascii=False)} for c in calls]
        return v31_tool_calls({"content": content, "tool_calls": _openai_calls(args)})

    def results(self, outputs):
        return "".join(TOOL_OUTPUT_BEGIN + o + TOOL_OUTPUT_END for o in outputs)

    def reasoning_kept(self, after_last_user):
        return False  # the template keeps "</think>" and what follows it

    def _parse_calls(self, text, s, finished):
        pattern = re.compile(f"{s[TOOL_CALL_BEGIN]}(.*?){s[TOOL_SEP]}(.*?){s[TOOL_CALL_END]}", re.DOTALL)
        return _block_calls(text, s, finished, pattern, lambda m: ToolCall(m.group(1), *_json_object(m.group(2))),
                            f"{TOOL_CALL_BEGIN}NAME{TOOL_SEP}{{json}}{TOOL_CALL_END}")


# ---- DSML: DeepSeek-V3.2, V4, V4.1 ----------------------------------------------------------------
V32_TOOLS = """## Tools
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
{think}...thinking about results{end}
Here are the functions available in JSONSchema format:
<functions>
{{schemas}}
</functions>
""".format(D=DSML, think=THINK_START, end=THINK_END)
V41_REASONING_EFFORT = "Reasoning Effort: 50 (range 1-100, the higher the value, the more thorough the reasoning)\n\n"


class DSMLCodec(ToolCodec):
    """DeepSeek-V4 (the official ``encoding/encoding_dsv4.py``, as trex.data.chat encodes it). V3.2
    and V4.1 are subclasses that change the tag names, the tools block and the results."""

    family = "deepseek-v4"
    block, invoke, parameter = "tool_calls", "invoke", "parameter"
    markers = (EOS, THINK_END, DSML)

    def _tools_block(self, tools: list[dict]) -> str:
        return TOOLS_PROMPT.format(schemas="\n".join(json.dumps(fn, ensure_ascii=False) for fn in _schemas(tools)))

    def _system(self, system: str, tools: list[dict]) -> str:
        return system + ("\n\n" + self._tools_block(tools) if tools else "")

    def prompt(self, system, user, tools):
        opener = THINK_START if self.thinking else THINK_END
        return BOS + self._system(system, tools) + USER + user + ASSISTANT + opener

    def assistant(self, content="", calls=(), reasoning=""):
        text = (reasoning + THINK_END) if self.thinking else ""
        text += content
        if calls:
            text += dsml_tool_calls(_openai_calls(calls), self.block, self.invoke, self.parameter)
        return text + EOS

    def results(self, outputs):
        # no tool role: the outputs are a user turn; tools defined turn drop_thinking off, so thinking
        # mode opens <think> again
        return (USER + "\n\n".join(f"<tool_result>{o}</tool_result>" for o in outputs) + ASSISTANT
                + (THINK_START if self.thinking else THINK_END))

    def reasoning_kept(self, after_last_user):
        return True  # encode_messages: any message with tools -> drop_thinking off

    def _parse_calls(self, text, s, finished):
        d = s[DSML]
        opener = f"\n\n<{d}{self.block}>\n"
        content, sep, rest = text.partition(opener)
        if not sep:
            if f"<{d}" in text:  # a DSML tag without the block's exact opening
                head = text[text.index(f"<{d}"):]
                return text[:text.index(f"<{d}")], [_block_error(
                    f"expected the calls block to open with {opener!r}, got {_plain(head, s)[:200]!r}")]
            return content, []
        closer = f"</{d}{self.block}>"
        body, sep, tail = rest.partition(closer)
        if not sep:
            return content, [_block_error(f"the calls block has no </{DSML}{self.block}>" if finished else
                                          f"the turn was cut off before </{DSML}{self.block}>")]
        calls, pos = [], 0
        invoke = re.compile(f'<{d}{self.invoke} name="([^"\n]*)">\n(.*?)</{d}{self.invoke}>\n?', re.DOTALL)
        for m in invoke.finditer(body):
            if body[pos:m.start()].strip():
                calls.append(_block_error(f"unexpected text between calls: {_plain(body[pos:m.start()], s)[:200]!r}"))
            pos = m.end()
            calls.append(self._invoke(m.group(1), m.group(2), s))
        if body[pos:].strip() or not calls:
            calls.append(_block_error(f'expected <{DSML}{self.invoke} name="NAME">...</{DSML}{self.invoke}>, '
                                      f"got {_plain(body[pos:], s)[:200]!r}"))
        if tail.strip():
            calls.append(_block_error(f"unexpected text after </{DSML}{self.block}>: {_plain(tail, s)[:200]!r}"))
        return content, calls

    def _invoke(self, name: str, body: str, s: dict[str, str]) -> ToolCall:
        d, args, pos = s[DSML], {}, 0
        tag = f"{d}{self.parameter}"
        param = re.compile(f'<{tag} name="([^"\n]*)" string="(true|false)">(.*?)</{tag}>\n?', re.DOTALL)
        for m in param.finditer(body):
            if body[pos:m.start()].strip():
                break
            pos = m.end()
            key, is_str, value = m.groups()
            if key in args:
                return ToolCall(name, None, f"parameter {key!r} given twice")
            if is_str == "true":
                args[key] = value
            else:
                try:
                    args[key] = json.loads(value)
                except json.JSONDecodeError as err:
                    return ToolCall(name, None, f'parameter {key!r} has string="false" but its value is not JSON '
                                    f"({err.msg}): {value[:200]!r}")
        if body[pos:].strip():
            return ToolCall(name, None, f'expected <{DSML}{self.parameter} name="KEY" string="true|false">VALUE'
                            f"</{DSML}{self.parameter}>, got {_plain(body[pos:], s)[:200]!r}")
        return ToolCall(name, args)


class V32Codec(DSMLCodec):
    """DeepSeek-V3.2: the release's Python encoder ``encoding/encoding_dsv32.py`` (no Jinja template)."""

    family = "deepseek-v3.2"
    block = "function_calls"

    def _tools_block(self, tools):
        return V32_TOOLS.format(schemas="\n".join(json.dumps(fn, ensure_ascii=False) for fn in _schemas(tools)))

    def results(self, outputs):
        # a tool message continues the text after the calling turn's EOS; the last one reopens thinking
        # (thinking mode: these results come after the last user message) or closes it
        return ("\n\n<function_results>" + "".join(f"\n<result>{o}</result>" for o in outputs)
                + "\n</function_results>\n\n" + (THINK_START if self.thinking else THINK_END))

    def reasoning_kept(self, after_last_user):
        return after_last_user  # drop_thinking_messages drops reasoning before the last user message only


class V41Codec(DSMLCodec):
    """DeepSeek-V4.1: V4's format with spaced DSML tag names, the ``<｜System｜>`` token and, in thinking
    mode, the default reasoning-effort line ("high" = 50) at the start (the release's
    ``encoding/encoding_dsv41.py``)."""

    family = "deepseek-v4.1"
    block, invoke, parameter = " calls", " invoke", " parameter"

    def _tools_block(self, tools):
        block = super()._tools_block(tools)  # V4's text; only the tag names differ
        for v4, v41 in (("tool_calls", self.block), ("invoke", self.invoke), ("parameter", self.parameter)):
            block = block.replace(f"<{DSML}{v4}", f"<{DSML}{v41}").replace(f"</{DSML}{v4}", f"</{DSML}{v41}")
        return block

    def _system(self, system, tools):
        return SYSTEM + (V41_REASONING_EFFORT if self.thinking else "") + super()._system(system, tools)


def _block_error(message: str) -> ToolCall:
    return ToolCall("", None, message)


def _block_calls(text: str, s: dict[str, str], finished: bool, pattern: re.Pattern, call, expected: str
                 ) -> tuple[str, list[ToolCall]]:
    """V3's and V3.1's calls block: (the content before it, its calls). Each call is a match of ``pattern``
    made a ToolCall by ``call``; a block never closed, text around the calls, or a block without a call
    that matches (``expected`` names the form) is an error call."""
    content, sep, rest = text.partition(s[TOOL_CALLS_BEGIN])
    if not sep:
        return content, []
    body, sep, tail = rest.partition(s[TOOL_CALLS_END])
    if not sep:
        return content, [_block_error(f"the calls block has no {TOOL_CALLS_END}" if finished else
                                      f"the turn was cut off before {TOOL_CALLS_END}")]
    calls, pos = [], 0
    for m in pattern.finditer(body):
        if body[pos:m.start()].strip():
            calls.append(_block_error(f"unexpected text between calls: {body[pos:m.start()][:200]!r}"))
        pos = m.end()
        calls.append(call(m))
    if body[pos:].strip() or not calls:
        calls.append(_block_error(f"expected {expected}, got {body[pos:][:200]!r}"))
    if tail.strip():
        calls.append(_block_error(f"unexpected text after {TOOL_CALLS_END}: {tail[:200]!r}"))
    return content, calls


CODECS = {"deepseek-v3": V3Codec, "deepseek-v3.1": V31Codec, "deepseek-v3.2": V32Codec,
          "deepseek-v4": DSMLCodec, "deepseek-v4.1": V41Codec}


def tool_codec(family: str, *, thinking: bool) -> ToolCodec:
    """The codec of ``family`` (a chat format name; deepseek-v3 with ``thinking`` is R1's form)."""
    if family not in CODECS:
        raise ValueError(f"tool-call family {family!r}; expected one of {', '.join(FAMILIES)}")
    return CODECS[family](thinking)
