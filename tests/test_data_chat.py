"""DeepSeek-V4 chat encoding against hand-written token sequences.

Each expectation is written out as (piece, trained) pairs, where a piece is a special token or the
plain text between two special tokens; the pieces are tokenized one by one here, never by the
encoder under test.
"""

import json

import numpy as np
import pytest

from trex.data.chat import RecordError, completion_answer, encode_segments, render_conversation, render_prompt
from trex.data.tokenizer import (ASSISTANT, BOS, CHAT_SPECIAL_TOKENS, DSML, EOS, THINK_END, THINK_START, USER,
                                 compact_tokenizer, load_tokenizer)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("deepseek-v4")


def expected(tok, pieces):
    ids = [tok.encode(p) for p, _ in pieces]
    mask = np.concatenate([np.full(len(i), t) for i, (_, t) in zip(ids, pieces)])
    return np.concatenate(ids), mask


def encode(tok, messages, **kw):
    segs = render_conversation(messages, **kw)
    return encode_segments([segs], tok)[0]


def assert_encodes(tok, messages, pieces, **kw):
    ids, mask = encode(tok, messages, **kw)
    want_ids, want_mask = expected(tok, pieces)
    assert ids.tolist() == want_ids.tolist(), tok.decode(ids)
    assert mask.tolist() == want_mask.tolist()
    # segment-wise encoding equals encoding the whole rendered string at once
    assert ids.tolist() == tok.encode("".join(p for p, _ in pieces)).tolist()


def test_chat_mode_single_turn(tok):
    msgs = [{"role": "system", "content": "You are helpful."},
            {"role": "user", "content": "Hi there"},
            {"role": "assistant", "content": "Hello! How can I help?"}]
    assert_encodes(tok, msgs, [(BOS, 0), ("You are helpful.", 0), (USER, 0), ("Hi there", 0), (ASSISTANT, 0),
                               (THINK_END, 0), ("Hello! How can I help?", 1), (EOS, 1)], thinking=False)


def test_chat_mode_ignores_reasoning(tok):
    msgs = [{"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4", "reasoning_content": "add"}]
    assert_encodes(tok, msgs, [(BOS, 0), (USER, 0), ("2+2?", 0), (ASSISTANT, 0), (THINK_END, 0), ("4", 1),
                               (EOS, 1)], thinking=False)


def test_thinking_mode_single_turn(tok):
    msgs = [{"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4", "reasoning_content": "Two plus two."}]
    assert_encodes(tok, msgs, [(BOS, 0), (USER, 0), ("2+2?", 0), (ASSISTANT, 0), (THINK_START, 0),
                               ("Two plus two.", 1), (THINK_END, 1), ("4", 1), (EOS, 1)], thinking=True)


MULTI = [{"role": "user", "content": "Hello"},
         {"role": "assistant", "content": "Hi!", "reasoning_content": "greet"},
         {"role": "user", "content": "Capital of France?"},
         {"role": "assistant", "content": "Paris.", "reasoning_content": "easy"}]


def test_thinking_multi_turn_drops_earlier_reasoning(tok):
    assert_encodes(tok, MULTI, [(BOS, 0), (USER, 0), ("Hello", 0), (ASSISTANT, 0), (THINK_END, 0), ("Hi!", 1),
                                (EOS, 1), (USER, 0), ("Capital of France?", 0), (ASSISTANT, 0), (THINK_START, 0),
                                ("easy", 1), (THINK_END, 1), ("Paris.", 1), (EOS, 1)], thinking=True)


def test_thinking_multi_turn_keeps_reasoning_without_drop(tok):
    assert_encodes(tok, MULTI, [(BOS, 0), (USER, 0), ("Hello", 0), (ASSISTANT, 0), (THINK_START, 0), ("greet", 1),
                                (THINK_END, 1), ("Hi!", 1), (EOS, 1), (USER, 0), ("Capital of France?", 0),
                                (ASSISTANT, 0), (THINK_START, 0), ("easy", 1), (THINK_END, 1), ("Paris.", 1),
                                (EOS, 1)], thinking=True, drop_thinking=False)


def test_loss_on_last_assistant_and_all(tok):
    assert_encodes(tok, MULTI, [(BOS, 0), (USER, 0), ("Hello", 0), (ASSISTANT, 0), (THINK_END, 0), ("Hi!", 0),
                                (EOS, 0), (USER, 0), ("Capital of France?", 0), (ASSISTANT, 0), (THINK_END, 0),
                                ("Paris.", 1), (EOS, 1)], thinking=False, loss_on="last_assistant")
    _, mask = encode(tok, MULTI, thinking=False, loss_on="all")
    assert mask.all()


TOOL_CALLS = [{"id": "c1", "type": "function",
               "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "days": 2})}},
              {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": {"tz": "CET"}}}]
TOOL_CONVO = [{"role": "user", "content": "Weather and time?"},
              {"role": "assistant", "content": "Checking.", "reasoning_content": "need tools",
               "tool_calls": TOOL_CALLS},
              {"role": "tool", "tool_call_id": "c2", "content": "12:00"},
              {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
              {"role": "assistant", "content": "Sunny, 12:00.", "reasoning_content": "done"}]
DSML_BLOCK = [
    ("Checking.\n\n<", 1), (DSML, 1), ("tool_calls>\n<", 1), (DSML, 1), ('invoke name="get_weather">\n<', 1),
    (DSML, 1), ('parameter name="city" string="true">Paris</', 1), (DSML, 1), ("parameter>\n<", 1), (DSML, 1),
    ('parameter name="days" string="false">2</', 1), (DSML, 1), ("parameter>\n</", 1), (DSML, 1),
    ("invoke>\n<", 1), (DSML, 1), ('invoke name="get_time">\n<', 1), (DSML, 1),
    ('parameter name="tz" string="true">CET</', 1), (DSML, 1), ("parameter>\n</", 1), (DSML, 1),
    ("invoke>\n</", 1), (DSML, 1), ("tool_calls>", 1), (EOS, 1)]
# tool results merge into one user turn, ordered like the calls (c1 before c2)
TOOL_RESULTS = [(USER, 0), ("<tool_result>sunny</tool_result>\n\n<tool_result>12:00</tool_result>", 0),
                (ASSISTANT, 0)]


def test_tool_calls_and_results_chat_mode(tok):
    assert_encodes(tok, TOOL_CONVO, [(BOS, 0), (USER, 0), ("Weather and time?", 0), (ASSISTANT, 0), (THINK_END, 0),
                                     *DSML_BLOCK, *TOOL_RESULTS, (THINK_END, 0), ("Sunny, 12:00.", 1), (EOS, 1)],
                   thinking=False)


def test_tools_on_system_keep_all_reasoning(tok):
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                               "parameters": {"type": "object"}}}]
    msgs = [{"role": "system", "content": "Be brief.", "tools": tools}] + TOOL_CONVO
    ids, mask = encode(tok, msgs, thinking=True)
    tail = [(USER, 0), ("Weather and time?", 0), (ASSISTANT, 0), (THINK_START, 0), ("need tools", 1),
            (THINK_END, 1), *DSML_BLOCK, *TOOL_RESULTS, (THINK_START, 0), ("done", 1), (THINK_END, 1),
            ("Sunny, 12:00.", 1), (EOS, 1)]
    want_ids, want_mask = expected(tok, tail)
    assert ids[-len(want_ids):].tolist() == want_ids.tolist()
    assert mask[-len(want_ids):].tolist() == want_mask.tolist()
    system = tok.decode(ids[:len(ids) - len(want_ids)])
    assert system.startswith(BOS + "Be brief.\n\n## Tools\n\n")
    assert '\n\n{"name": "get_weather", "description": "Weather", "parameters": {"type": "object"}}\n\n' in system
    assert not mask[:len(ids) - len(want_ids)].any()


def test_generation_prompt_and_completion():
    msgs = [{"role": "user", "content": "12+30"}]
    assert render_prompt(msgs, thinking=False) == BOS + USER + "12+30" + ASSISTANT + THINK_END
    assert render_prompt(msgs, thinking=True) == BOS + USER + "12+30" + ASSISTANT + THINK_START
    assert completion_answer("42" + EOS + "junk", thinking=False) == "42"
    assert completion_answer("carry the one" + THINK_END + "42" + EOS, thinking=True) == "42"
    assert completion_answer("never closes", thinking=True) == ""


@pytest.mark.parametrize("messages, reason", [
    ([], "empty_conversation"),
    ("hello", "bad_messages"),
    ([{"content": "x"}], "missing_role"),
    ([{"role": "bot", "content": "x"}, {"role": "assistant", "content": "y"}], "unknown_role"),
    ([{"role": "user", "content": "x"}], "no_assistant_turn"),
    ([{"role": "user", "content": ["x"]}, {"role": "assistant", "content": "y"}], "bad_content"),
    ([{"role": "user", "content": "x"}, {"role": "system", "content": "s"}, {"role": "assistant", "content": "y"}],
     "misplaced_system"),
    ([{"role": "user", "content": "x"}, {"role": "assistant", "content": None,
                                         "tool_calls": [{"function": {"name": "f"}}]}], "bad_tool_call"),
    ([{"role": "user", "content": "\ud800"}, {"role": "assistant", "content": "y"}], "invalid_utf8"),
])
def test_invalid_conversations(messages, reason):
    with pytest.raises(RecordError) as err:
        render_conversation(messages, thinking=False)
    assert err.value.reason == reason


def test_compact_tokenizer_carries_v4_specials():
    tok = compact_tokenizer()
    v4 = load_tokenizer("deepseek-v4")
    for t in CHAT_SPECIAL_TOKENS:
        assert tok.encode(t).tolist() == [tok.token_id(t)]
    assert (tok.bos_id, tok.eos_id) == (v4.bos_id, v4.eos_id) == (0, 1)
    text = BOS + USER + "123*4 = 492\nok" + ASSISTANT + THINK_END + "492" + EOS
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert len(ids) == 5 + len("123*4 = 492\nok") + len("492")  # five specials, one id per character
    assert tok.vocab_size <= 256


def test_tokenizer_save_and_load_by_path(tmp_path):
    compact_tokenizer().save(tmp_path / "tokenizer.json")
    again = load_tokenizer(str(tmp_path))
    text = BOS + USER + "7-5" + ASSISTANT + THINK_END + "2" + EOS
    assert again.encode(text).tolist() == compact_tokenizer().encode(text).tolist()
    with pytest.raises(FileNotFoundError, match="no file"):
        load_tokenizer(str(tmp_path / "missing.json"))


def test_tokenizer_without_v4_specials_is_rejected(tmp_path):
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models

    HFTokenizer(models.WordLevel({"a": 0, "<unk>": 1}, unk_token="<unk>")).save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ValueError, match="lacks the DeepSeek-V4 special token"):
        load_tokenizer(str(tmp_path / "tokenizer.json"))
