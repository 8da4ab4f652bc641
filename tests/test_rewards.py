"""Reward plug-ins: built-ins on examples, user functions by module path and entry point, errors."""

import pytest

from trex.data.tokenizer import EOS, THINK_END, THINK_START
from trex.posttrain.rewards import Completion, RewardSet, exact_match, format_reward, load_reward


def c(text, answer="46", thinking=False, finished=True):
    return Completion(text=text, record={"answer": answer}, thinking=thinking, finished=finished)


def test_exact_match_chat_and_thinking():
    assert exact_match(c("46" + EOS)) == 1.0
    assert exact_match(c(" 46 " + EOS)) == 1.0      # surrounding space does not matter
    assert exact_match(c("47" + EOS)) == 0.0
    assert exact_match(c("46" + EOS + "junk")) == 1.0  # text after EOS is not the answer
    assert exact_match(c("460")) == 0.0
    assert exact_match(c("12+34 is" + THINK_END + "46" + EOS, thinking=True)) == 1.0
    assert exact_match(c("46" + EOS, thinking=True)) == 0.0  # never closed its reasoning
    assert exact_match(c("7" + EOS, answer=7)) == 1.0       # numeric answers compare as text
    with pytest.raises(KeyError, match="answer"):
        exact_match(Completion("46", {"label": "46"}, False, True))


def test_format_reward():
    assert format_reward(c("46" + EOS)) == 1.0
    assert format_reward(c("46", finished=False)) == 0.0
    assert format_reward(c(EOS)) == 0.0                           # empty answer
    assert format_reward(c("x" + THINK_END + "46" + EOS)) == 0.0  # think tag in chat mode
    assert format_reward(c("add" + THINK_END + "46" + EOS, thinking=True)) == 1.0
    assert format_reward(c(THINK_END + "46" + EOS, thinking=True)) == 0.0   # no reasoning
    assert format_reward(c("a" + THINK_END + "b" + THINK_END + "46" + EOS, thinking=True)) == 0.0
    assert format_reward(c(THINK_START + "a" + THINK_END + "46" + EOS, thinking=True)) == 0.0
    assert format_reward(c("add" + THINK_END + EOS, thinking=True)) == 0.0


def test_reward_set_weights_and_parts():
    rs = RewardSet.load(["exact_match", "format"], [1.0, 0.25])
    total, parts = rs.score(c("47" + EOS))
    assert parts == {"exact_match": 0.0, "format": 1.0} and total == 0.25
    with pytest.raises(ValueError, match="2 rewards"):
        RewardSet.load(["exact_match", "format"], [1.0])
    with pytest.raises(ValueError, match="empty"):
        RewardSet.load([])


def test_module_path_plugin(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def length_bonus(c):\n    return len(c.text) / 10\n\nNOT_A_FUNCTION = 3\n\n"
        "def bad(c):\n    return 'high'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert load_reward("my_rewards:length_bonus")(c("12345")) == 0.5
    with pytest.raises(ValueError, match="has no attribute 'missing'"):
        load_reward("my_rewards:missing")
    with pytest.raises(ValueError, match="not a function"):
        load_reward("my_rewards:NOT_A_FUNCTION")
    with pytest.raises(ValueError, match="cannot import module 'no_such_module_xyz'"):
        load_reward("no_such_module_xyz:f")
    with pytest.raises(TypeError, match="returned 'high'"):
        RewardSet.load(["my_rewards:bad"]).score(c("x"))


def test_entry_point_plugin(tmp_path, monkeypatch):
    (tmp_path / "ep_rewards.py").write_text("def always_one(c):\n    return 1.0\n")
    dist = tmp_path / "ep_rewards-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: ep-rewards\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[trex.rewards]\nalways_one = ep_rewards:always_one\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert load_reward("always_one")(c("anything")) == 1.0
    with pytest.raises(ValueError, match=r"not a built-in .*registered: \['always_one'\]"):
        load_reward("nope")
