"""DeepSeek-V3 / V3.1 chat formats against the released chat templates; trex's renderer is plain Python.

The released templates' renderings of these conversations are recorded in
tests/fixtures/chat_templates/expected.json (the templates themselves are not in the repository). To
record them again from the `chat_template` of the models' tokenizer_config.json, saved as
`deepseek-v3.jinja` and `deepseek-v3.1.jinja` in DIR (rendered with jinja2's sandbox, as transformers does):

    TREX_CHAT_TEMPLATES=DIR .venv/bin/python -m pytest -q tests/test_data_chat_v3.py
"""

import json
import os
from pathlib import Path

import pytest

from trex.data.chat import RecordError, encode_segments, render_conversation, render_prompt
from trex.data.tokenizer import BOS, EOS, load_tokenizer

EXPECTED = Path(__file__).parent / "fixtures" / "chat_templates" / "expected.json"
TEMPLATES = os.environ.get("TREX_CHAT_TEMPLATES")  # recording mode: a directory of the released templates


def released(fmt, messages, **kw):
    """What the released ``fmt`` template renders for ``messages`` (its generation-prompt flags in ``kw``):
    recorded, or rendered from TREX_CHAT_TEMPLATES and recorded."""
    key = json.dumps([fmt, messages, kw], sort_keys=True, ensure_ascii=False)
    recorded = json.loads(EXPECTED.read_text()) if EXPECTED.exists() else {}
    if TEMPLATES:
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)  # transformers' settings
        recorded[key] = env.from_string((Path(TEMPLATES) / f"{fmt}.jinja").read_text()).render(
            messages=messages, bos_token=BOS, eos_token=EOS, **kw)
        EXPECTED.write_text(json.dumps(recorded, indent=1, sort_keys=True, ensure_ascii=False) + "\n")
    return recorded[key]


def text(messages, fmt, **kw):
    return "".join(s.text for s in render_conversation(messages, chat_format=fmt, **kw))


SYS = {"role": "system", "content": "You are helpful.\nBe brief."}
CHATS = [
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}],
    [SYS, {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
     {"role": "user", "content": "and 3+3?"}, {"role": "assistant", "content": "6\n\nDone."}],
    [{"role": "user", "content": "Ünïcode 你好"}, {"role": "assistant", "content": " spaced "},
     {"role": "user", "content": "again"}, {"role": "assistant", "content": "ok"}],
]
TOOLS = [
    [SYS, {"role": "user", "content": "Weather in Paris and Rome?"},
     {"role": "assistant", "content": None, "tool_calls": [
         {"type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}},
         {"type": "function", "function": {"name": "weather", "arguments": '{"city": "Rome"}'}}]},
     {"role": "tool", "content": "18C"}, {"role": "tool", "content": "24C"},
     {"role": "assistant", "content": "Paris 18C, Rome 24C."},
     {"role": "user", "content": "Thanks"}, {"role": "assistant", "content": "You're welcome."}],
    [{"role": "user", "content": "Look it up"},
     {"role": "assistant", "content": "Searching.", "tool_calls": [
         {"type": "function", "function": {"name": "search", "arguments": '{"q": "x"}'}}]},
     {"role": "tool", "content": "found"}, {"role": "assistant", "content": "It is x."}],
]


@pytest.mark.parametrize("messages", CHATS)
def test_v3_matches_released_template(messages):
    assert text(messages, "deepseek-v3", thinking=False) == released("deepseek-v3", messages)
    prompt = messages[:-1]
    assert render_prompt(prompt, thinking=False, chat_format="deepseek-v3") == released(
        "deepseek-v3", prompt, add_generation_prompt=True)


@pytest.mark.parametrize("messages", CHATS + TOOLS)
def test_v31_non_thinking_matches_released_template(messages):
    assert text(messages, "deepseek-v3.1", thinking=False) == released("deepseek-v3.1", messages)
    cut = max(i for i, m in enumerate(messages) if m["role"] == "user") + 1
    assert render_prompt(messages[:cut], thinking=False, chat_format="deepseek-v3.1") == released(
        "deepseek-v3.1", messages[:cut], add_generation_prompt=True)


@pytest.mark.parametrize("messages", CHATS)
def test_v31_thinking_is_released_prompt_plus_reasoning(messages):
    """The template renders history without reasoning and opens the last turn with <think>
    (add_generation_prompt, thinking=True); the trained turn is then reasoning</think>answer<EOS>."""
    msgs = [dict(m) for m in messages]
    msgs[-1]["reasoning_content"] = "Let me think.\nStep 1."
    for m in msgs[:-1]:
        if m["role"] == "assistant":
            m["reasoning_content"] = "old reasoning"  # dropped, as the template drops it
    want = released("deepseek-v3.1", msgs[:-1], add_generation_prompt=True, thinking=True)
    want += "Let me think.\nStep 1.</think>" + msgs[-1]["content"] + EOS
    assert text(msgs, "deepseek-v3.1", thinking=True) == want
    assert render_prompt(msgs[:-1], thinking=True, chat_format="deepseek-v3.1") == released(
        "deepseek-v3.1", msgs[:-1], add_generation_prompt=True, thinking=True)


def test_v31_strips_history_reasoning_in_content_like_the_template():
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "why</think>because"},
            {"role": "user", "content": "b"}, {"role": "assistant", "content": "c"}]
    assert text(msgs, "deepseek-v3.1", thinking=False) == released("deepseek-v3.1", msgs)


def test_r1_thinking_form():
    msgs = [SYS, {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "x</think>Hello"},
            {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4", "reasoning_content": "add"}]
    assert text(msgs, "deepseek-v3", thinking=True) == (
        BOS + SYS["content"] + "<｜User｜>Hi<｜Assistant｜>Hello" + EOS + "<｜User｜>2+2?<｜Assistant｜><think>\n"
        + "add\n</think>\n\n4" + EOS)
    assert render_prompt(msgs[:-1], thinking=True, chat_format="deepseek-v3").endswith("<｜Assistant｜><think>\n")


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("deepseek-v4")  # V3's tokenizer.json is not available offline; V4's shares these specials


@pytest.mark.parametrize("fmt,thinking,messages", [("deepseek-v3", False, CHATS[1]), ("deepseek-v3", True, CHATS[1]),
                                                   ("deepseek-v3.1", False, TOOLS[0]), ("deepseek-v3.1", True, CHATS[1])])
def test_loss_mask_on_assistant_output(tok, fmt, thinking, messages):
    segs = render_conversation(messages, thinking=thinking, chat_format=fmt)
    ids, mask = encode_segments([segs], tok)[0]
    assert ids.tolist() == tok.encode("".join(s.text for s in segs)).tolist()  # segment-wise == whole string
    trained = "".join(s.text for s in segs if s.trainable)
    assert tok.decode(ids[mask]) == trained
    assert trained.endswith(EOS) and "<｜User｜>" not in trained and "<｜Assistant｜>" not in trained
    last = render_conversation(messages, thinking=thinking, chat_format=fmt, loss_on="last_assistant")
    assert [s.text for s in last if s.trainable][-1] == [s.text for s in segs if s.trainable][-1]
    assert sum(s.trainable for s in last) == 1


def test_refusals():
    with pytest.raises(RecordError, match="deepseek-v3.1"):
        render_conversation(TOOLS[0], thinking=False, chat_format="deepseek-v3")
    with pytest.raises(RecordError, match="non-thinking"):
        render_conversation(TOOLS[1], thinking=True, chat_format="deepseek-v3.1")
    sys_tools = {**SYS, "tools": [{"type": "function", "function": {"name": "f"}}]}
    with pytest.raises(RecordError, match="system text"):
        render_conversation([sys_tools] + CHATS[0], thinking=False, chat_format="deepseek-v3.1")
    with pytest.raises(ValueError, match="chat_format"):
        render_conversation(CHATS[0], thinking=False, chat_format="kimi")


def test_data_section_chat_format_and_key():
    from trex.data.config import DataSection
    assert DataSection().chat_format == "deepseek-v4"
    with pytest.raises(ValueError):
        DataSection(chat_format="deepseek-v2")
    from trex.data.prepared import KEYED_OPTIONS
    assert "chat_format" in KEYED_OPTIONS


@pytest.mark.parametrize("files", [
    {"tokenizer_config.json": json.dumps({"auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]}}),
     "tokenization_kimi.py": "raise SystemExit('executed')\n", "tiktoken.model": "x"},
    {"tiktoken.model": "x"},
])
def test_remote_code_tokenizer_refused_in_one_line(tmp_path, files):
    for name, body in files.items():
        (tmp_path / name).write_text(body)
    with pytest.raises(ValueError) as err:
        load_tokenizer(str(tmp_path))
    msg = str(err.value)
    assert "\n" not in msg and "remote code" in msg and "tokenizer.json" in msg
