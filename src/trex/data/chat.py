"""DeepSeek-V4 chat format: conversations in the common ``messages`` form -> text segments -> token
ids with a per-token loss mask.

The layout follows the official ``encoding/encoding_dsv4.py`` of DeepSeek-V4::

    <BOS>{system}[\\n\\n{tools block}]
    <｜User｜>{user}<｜Assistant｜></think>{answer}<EOS>                        chat mode
    <｜User｜>{user}<｜Assistant｜><think>{reasoning}</think>{answer}<EOS>      thinking mode

* ``tool`` messages have no turn of their own: a run of consecutive user/tool messages becomes one
  user turn, its pieces joined by a blank line, each tool result wrapped in <tool_result>...
  </tool_result> and ordered like the calls of the preceding assistant message.
* Assistant tool calls follow the answer as a DSML block (``\\n\\n<｜DSML｜tool_calls>...``).
* Thinking mode drops the reasoning of assistant turns before the last user turn (those turns get
  ``</think>`` like chat mode) unless ``drop_thinking`` is off or the system message defines tools.
* The ``<think>``/``</think>`` right after ``<｜Assistant｜>`` belongs to the prompt; an assistant
  turn's own tokens (reasoning, ``</think>``, answer, tool calls, EOS) are the ones that carry loss.

Every boundary between a trainable and a non-trainable segment sits next to a special token, and
tokenizers split special tokens out before anything else, so encoding segment by segment gives the
same ids as encoding the whole rendered string.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from trex.data.tokenizer import ASSISTANT, BOS, DSML, EOS, THINK_END, THINK_START, USER, Tokenizer

ROLES = ("system", "user", "assistant", "tool")

TOOLS_PROMPT = f"""## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "<{DSML}tool_calls>" block like the following:

<{DSML}tool_calls>
<{DSML}invoke name="$TOOL_NAME">
<{DSML}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{DSML}parameter>
...
</{DSML}invoke>
<{DSML}invoke name="$TOOL_NAME2">
...
</{DSML}invoke>
</{DSML}tool_calls>

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by {THINK_START}), you MUST output your complete reasoning inside {THINK_START}...{THINK_END} BEFORE any tool calls or final response.

Otherwise, output directly after {THINK_END} with tool calls or final response.

### Available Tool Schemas

{{schemas}}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""
RESPONSE_FORMAT_PROMPT = "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n{schema}"


class RecordError(ValueError):
    """A record that cannot be encoded. ``reason`` is a short key (counted in summary.json)."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class Segment:
    text: str
    trainable: bool


def _to_json(value) -> str:
    return json.dumps(value, ensure_ascii=False)


def _tool_arguments(call: dict, where: str) -> dict:
    args = call["function"]["arguments"]
    if isinstance(args, dict):
        return args
    try:
        parsed = json.loads(args)
    except json.JSONDecodeError:
        return {"arguments": args}  # the official encoder's fallback for non-JSON argument strings
    if not isinstance(parsed, dict):
        raise RecordError("bad_tool_call", f"{where}: tool call arguments decode to {type(parsed).__name__}; "
                                           "expected a JSON object")
    return parsed


def _check_message(i: int, msg) -> None:
    where = f"message {i}"
    if not isinstance(msg, dict) or "role" not in msg:
        raise RecordError("missing_role", f"{where} has no role; expected an object with a role key")
    role = msg["role"]
    if role not in ROLES:
        raise RecordError("unknown_role", f"{where} has unknown role {role!r}; expected one of {', '.join(ROLES)}")
    if role == "system" and i != 0:
        raise RecordError("misplaced_system", f"{where} is a system message; expected it only as message 0")
    content = msg.get("content")
    tool_calls = msg.get("tool_calls")
    if role == "assistant":
        if content is None and not tool_calls:
            raise RecordError("bad_content", f"{where} (assistant) has neither content nor tool_calls")
        if not isinstance(msg.get("reasoning_content") or "", str):
            raise RecordError("bad_content", f"{where} has a non-string reasoning_content")
    content_ok = isinstance(content, str) or (content is None and role == "assistant")
    if not content_ok:
        raise RecordError("bad_content", f"{where} ({role}) content is {type(content).__name__}; expected a string")
    if tool_calls:
        if role != "assistant" or not isinstance(tool_calls, list):
            raise RecordError("bad_tool_call", f"{where}: tool_calls must be a list on an assistant message")
        for call in tool_calls:
            fn = call.get("function") if isinstance(call, dict) else None
            if not (isinstance(fn, dict) and isinstance(fn.get("name"), str)
                    and isinstance(fn.get("arguments"), (str, dict))):
                raise RecordError("bad_tool_call", f"{where}: expected tool calls like "
                                  '{"function": {"name": str, "arguments": str|object}}')
            _tool_arguments(call, where)
    if msg.get("tools") is not None:
        tools = msg["tools"]
        if role != "system" or not isinstance(tools, list) or not all(
                isinstance(t, dict) and isinstance(t.get("function"), dict) for t in tools):
            raise RecordError("bad_tools", f"{where}: tools must be a list of "
                              '{"type": "function", "function": {...}} on the system message')


def validate_conversation(messages, require_assistant: bool = True) -> None:
    """Raise RecordError if ``messages`` is not an encodable conversation."""
    if not isinstance(messages, list):
        raise RecordError("bad_messages", f"messages is {type(messages).__name__}; expected a list")
    if not messages:
        raise RecordError("empty_conversation", "messages is empty")
    for i, msg in enumerate(messages):
        _check_message(i, msg)
    if require_assistant and not any(m["role"] == "assistant" for m in messages):
        raise RecordError("no_assistant_turn", "conversation has no assistant message to train on")


def _merge_turns(messages: list[dict]) -> list[dict]:
    """Fold runs of user/tool messages into one user turn with ``blocks`` [(kind, call_id, text)],
    tool results ordered like the calls of the latest assistant message that made calls."""
    turns: list[dict] = []
    call_order: dict[str, int] = {}
    for msg in messages:
        role = msg["role"]
        if role in ("user", "tool"):
            block = (role, msg.get("tool_call_id") or "", msg["content"])
            if turns and turns[-1]["role"] == "user":
                turns[-1]["blocks"].append(block)
            else:
                turns.append({"role": "user", "blocks": [block], "call_order": call_order})
        else:
            if role == "assistant" and msg.get("tool_calls"):
                call_order = {c["id"]: k for k, c in enumerate(msg["tool_calls"]) if c.get("id")}
            turns.append(msg)
    for turn in turns:
        if turn["role"] == "user":
            turn["blocks"] = _order_tool_results(turn["blocks"], turn.pop("call_order"))
    return turns


def _order_tool_results(blocks: list[tuple], call_order: dict[str, int]) -> list[tuple]:
    results = [b for b in blocks if b[0] == "tool"]
    if len(results) < 2 or not call_order:
        return blocks
    ordered = iter(sorted(results, key=lambda b: call_order.get(b[1], 0)))
    return [next(ordered) if b[0] == "tool" else b for b in blocks]


def _user_text(blocks: list[tuple]) -> str:
    return USER + "\n\n".join(f"<tool_result>{text}</tool_result>" if kind == "tool" else text
                              for kind, _, text in blocks)


def _system_text(msg: dict) -> str:
    text = msg["content"]
    if msg.get("tools"):
        schemas = "\n".join(_to_json(t["function"]) for t in msg["tools"])
        text += "\n\n" + TOOLS_PROMPT.format(schemas=schemas)
    if msg.get("response_format"):
        text += "\n\n" + RESPONSE_FORMAT_PROMPT.format(schema=_to_json(msg["response_format"]))
    return text


def dsml_tool_calls(tool_calls: list[dict], block: str = "tool_calls", invoke: str = "invoke",
                     parameter: str = "parameter") -> str:
    """An assistant turn's DSML calls block. The tag names differ per release (V3.2: function_calls,
    V4: tool_calls, V4.1: " calls"/" invoke"/" parameter"; trex.data.tool_calls)."""
    invokes = []
    for call in tool_calls:
        params = "\n".join(
            f'<{DSML}{parameter} name="{key}" string="{"true" if isinstance(v, str) else "false"}">'
            f'{v if isinstance(v, str) else _to_json(v)}</{DSML}{parameter}>'
            for key, v in _tool_arguments(call, "tool call").items())
        invokes.append(f'<{DSML}{invoke} name="{call["function"]["name"]}">\n{params}\n</{DSML}{invoke}>')
    return f"\n\n<{DSML}{block}>\n" + "\n".join(invokes) + f"\n</{DSML}{block}>"


def render_conversation(messages: list[dict], *, thinking: bool, drop_thinking: bool = True,
                        loss_on: str = "assistant", require_assistant: bool = True,
                        chat_format: str = "deepseek-v4") -> list[Segment]:
    """Render a conversation as consecutive text segments, each flagged trainable or not.

    ``loss_on``: "assistant" (every assistant turn), "last_assistant" (assistant turns after the last
    user/tool turn) or "all". A conversation ending in a user message ends with the generation
    prompt ``<｜Assistant｜></think>`` (chat) or ``<｜Assistant｜><think>`` (thinking).

    ``chat_format``: deepseek-v4 (the default), deepseek-v3 (V3/V3-0324; with ``thinking``, R1's form)
    or deepseek-v3.1, each rendered as the released chat template renders it (docs/data.md).
    """
    validate_conversation(messages, require_assistant=require_assistant)
    if chat_format != "deepseek-v4":
        if chat_format not in CHAT_FORMATS:
            raise ValueError(f"chat_format {chat_format!r}; expected one of {', '.join(CHAT_FORMATS)}")
        return _render_v3(messages, chat_format=chat_format, thinking=thinking, drop_thinking=drop_thinking,
                          loss_on=loss_on, prompt=not require_assistant)
    turns = _merge_turns(messages)
    keep_reasoning = not drop_thinking or any(t["role"] == "system" and t.get("tools") for t in turns)
    last_user = max((i for i, t in enumerate(turns) if t["role"] == "user"), default=-1)
    segments = [Segment(BOS, False)]
    for i, turn in enumerate(turns):
        if turn["role"] == "system":
            segments.append(Segment(_system_text(turn), False))
        elif turn["role"] == "user":
            text = _user_text(turn["blocks"])
            if i + 1 == len(turns) or turns[i + 1]["role"] == "assistant":
                opens_thinking = thinking and (keep_reasoning or i == last_user)
                text += ASSISTANT + (THINK_START if opens_thinking else THINK_END)
            segments.append(Segment(text, False))
        else:
            text = ""
            if thinking and (keep_reasoning or i > last_user):
                text = (turn.get("reasoning_content") or "") + THINK_END
            text += turn.get("content") or ""
            if turn.get("tool_calls"):
                text += dsml_tool_calls(turn["tool_calls"])
            text += EOS
            segments.append(Segment(text, loss_on != "last_assistant" or i > last_user))
    if loss_on == "all":
        segments = [Segment(s.text, True) for s in segments]
    for s in segments:
        check_utf8(s.text)
    return segments


def check_utf8(text: str) -> None:
    """Raise RecordError for text that has no UTF-8 form (lone surrogates from JSON escapes)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise RecordError("invalid_utf8", f"text is not valid UTF-8 ({err.reason} at {err.start})") from None


def render_prompt(messages: list[dict], *, thinking: bool, chat_format: str = "deepseek-v4") -> str:
    """The generation prompt for a conversation that ends with a user message (evaluation)."""
    return "".join(s.text for s in render_conversation(messages, thinking=thinking, require_assistant=False,
                                                       chat_format=chat_format))


def encode_segments(docs: list[list[Segment]], tokenizer: Tokenizer) -> list[tuple[np.ndarray, np.ndarray]]:
    """Tokenize many rendered documents in one batched call.

    Returns per document ``(input_ids int32 [n], loss_mask bool [n])``.
    """
    texts = [s.text for doc in docs for s in doc]
    pieces = tokenizer.encode_batch(texts)
    out, k = [], 0
    for doc in docs:
        ids = pieces[k:k + len(doc)]
        k += len(doc)
        lengths = [len(p) for p in ids]
        mask = np.repeat(np.array([s.trainable for s in doc], dtype=bool), lengths)
        out.append((np.concatenate(ids), mask))
    return out


def completion_answer(text: str, *, thinking: bool) -> str:
    """The answer part of a generated assistant turn: text before EOS, after ``</think>`` in thinking
    mode (a completion that never closes its reasoning has no answer: "")."""
    text = text.split(EOS, 1)[0]
    if thinking:
        head, sep, tail = text.partition(THINK_END)
        return tail if sep else ""
    return text


# ---- DeepSeek-V3 / R1 / V3.1 chat formats ----------------------------------------------------------
# Plain-Python renderings of the chat templates DeepSeek released in tokenizer_config.json (tests render
# the released Jinja text with jinja2 and compare). The system message opens the text; no tools block
# (the released templates render none), so records that define tools are refused.
CHAT_FORMATS = ("deepseek-v4", "deepseek-v3", "deepseek-v3.1")
TOOL_CALLS_BEGIN, TOOL_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
TOOL_CALL_BEGIN, TOOL_CALL_END, TOOL_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
TOOL_OUTPUT_BEGIN, TOOL_OUTPUT_END = "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>"
R1_THINK_OPEN = THINK_START + "\n"  # R1's template ends its generation prompt with "<think>\n"
R1_THINK_CLOSE = "\n" + THINK_END + "\n\n"  # and R1 writes "<think>\n{reasoning}\n</think>\n\n{answer}"


def _check_v3_record(messages: list[dict], chat_format: str, thinking: bool) -> None:
    for i, msg in enumerate(messages):
        if msg.get("tools") or msg.get("response_format"):
            raise RecordError("unsupported_tools", f"message {i} defines tools/response_format, which the released "
                              f"{chat_format} template does not render; describe them in the system text instead")
        has_tools = msg["role"] == "tool" or msg.get("tool_calls") is not None
        if has_tools and chat_format == "deepseek-v3":
            raise RecordError("unsupported_tools", f"message {i} has tool calls/results, which data.chat_format = "
                              "'deepseek-v3' does not train (the released V3 template renders them inconsistently); "
                              "use chat_format 'deepseek-v3.1'")
        if has_tools and thinking:
            raise RecordError("unsupported_tools", f"message {i} has tool calls/results; DeepSeek-V3.1 calls tools in "
                              "non-thinking mode only: set data.thinking = false for these records")


def v31_tool_calls(msg: dict) -> str:
    calls = msg["tool_calls"]
    text = ""
    for k, call in enumerate(calls):
        args = call["function"]["arguments"]
        args = args if isinstance(args, str) else _to_json(args)
        head = ((msg.get("content") or "") + TOOL_CALLS_BEGIN) if k == 0 else ""
        text += head + TOOL_CALL_BEGIN + call["function"]["name"] + TOOL_SEP + args + TOOL_CALL_END
    return text + TOOL_CALLS_END + EOS


def _render_v3(messages: list[dict], *, chat_format: str, thinking: bool, drop_thinking: bool, loss_on: str,
               prompt: bool) -> list[Segment]:
    """V3 (no thinking; ``thinking``: DeepSeek-R1's form) or V3.1 (``</think>``/``<think>`` after
    ``<｜Assistant｜>``). ``prompt``: end a conversation whose last message is a user turn with the
    generation prompt (the template's ``add_generation_prompt``)."""
    _check_v3_record(messages, chat_format, thinking)
    v31 = chat_format == "deepseek-v3.1"
    last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=-1)
    last_input = max((i for i, m in enumerate(messages) if m["role"] in ("user", "tool")), default=-1)
    segments = [Segment(BOS, False)]
    is_last_user = False
    for i, msg in enumerate(messages):
        role, content = msg["role"], msg.get("content")
        if role == "system":
            segments.append(Segment(content, False))
        elif role == "user":
            segments.append(Segment(USER + content, False))
        elif role == "tool":
            segments.append(Segment(TOOL_OUTPUT_BEGIN + content + TOOL_OUTPUT_END, False))
        else:
            reasons = thinking and (i > last_user or not drop_thinking)
            if v31:
                if msg.get("tool_calls") is not None:
                    head, body = ASSISTANT + THINK_END, v31_tool_calls(msg)
                else:
                    head = ASSISTANT + (THINK_START if reasons else THINK_END)
                    if reasons:
                        body = (msg.get("reasoning_content") or "") + THINK_END + content
                    elif messages[i - 1]["role"] == "tool":
                        body = content
                    else:
                        body = content.split(THINK_END, 1)[1] if THINK_END in content else content
                    body += EOS
                if not is_last_user:
                    head = ""
            elif reasons:
                # the "\n" after <think> is the prompt's in R1's template; it rides with the trained text so
                # that the segment boundary sits next to a special token (a leading "\n" would merge)
                head = ASSISTANT + THINK_START
                body = "\n" + (msg.get("reasoning_content") or "") + R1_THINK_CLOSE + content + EOS
            else:
                head = ASSISTANT
                body = (content.split(THINK_END)[-1] if thinking else content) + EOS
            if head:
                segments.append(Segment(head, False))
            segments.append(Segment(body, loss_on != "last_assistant" or i > last_input))
        is_last_user = role == "user"
    if prompt and is_last_user:
        if v31:
            segments.append(Segment(ASSISTANT + (THINK_START if thinking else THINK_END), False))
        else:
            segments.append(Segment(ASSISTANT + (R1_THINK_OPEN if thinking else ""), False))
    if loss_on == "all":
        segments = [Segment(s.text, True) for s in segments]
    for s in segments:
        check_utf8(s.text)
    return segments
