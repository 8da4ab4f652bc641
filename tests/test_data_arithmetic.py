"""The generated arithmetic task of the default job."""

import operator
import re

import pytest

from trex.data import DataSection, build_loader, compact_tokenizer
from trex.data.arithmetic import (ArithmeticTask, Problem, cpt_records, eval_prompts, fresh_problems, generate,
                                  mistake_records, sft_records)
from trex.data.chat import render_prompt
from trex.data.records import write_jsonl
from trex.data.tokenizer import ASSISTANT, BOS, THINK_END, USER

OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}


def solve(question: str) -> str:
    a, op, b = re.fullmatch(r"(\d+)([-+*])(\d+)", question).groups()
    return str(OPS[op](int(a), int(b)))


def test_answers_are_correct_and_held_out_is_disjoint():
    task = ArithmeticTask(digits=3, ops="+-*", n_train=3000, n_eval=300, seed=7)
    train, held = generate(task)
    assert len(train) == 3000 and len(held) == 300
    assert not {p.question for p in train} & {p.question for p in held}
    assert len({p.question for p in train}) == 3000
    for p in train + held:
        assert p.answer == solve(p.question) and not p.answer.startswith("-")
        assert p.a < 1000 and p.b < (10 if p.op == "*" else 1000)
    assert {p.op for p in train} == {"+", "-", "*"}
    assert generate(task) == (train, held)
    assert generate(ArithmeticTask(digits=3, ops="+-*", n_train=3000, n_eval=300, seed=8)) != (train, held)


def test_fresh_problems_are_a_third_disjoint_split():
    task = ArithmeticTask(digits=2, ops="+-", n_train=3000, n_eval=200, seed=4)
    train, held = generate(task)
    fresh = fresh_problems(task, 2000, seed=1)
    assert len(fresh) == len(set(fresh)) == 2000
    assert not set(fresh) & (set(train) | set(held))
    assert {p.op for p in fresh} == {"+", "-"} and all(p.answer == solve(p.question) for p in fresh)
    assert fresh_problems(task, 2000, seed=1) == fresh  # deterministic
    assert fresh_problems(task, 2000, seed=2) != fresh
    assert generate(task) == (train, held)  # drawing them leaves the task's own splits as they were
    with pytest.raises(ValueError, match="fresh problems requested"):
        fresh_problems(task, 6000, seed=1)  # 15050 two-digit + and - problems, 3200 taken


def test_mistake_records_pair_the_answer_with_the_most_frequent_wrong_one():
    problems = [Problem(57, "+", 68), Problem(12, "+", 34), Problem(52, "-", 37), Problem(9, "-", 9)]
    answers = [["125", "115", "135", "115"],  # 115 twice beats 135 once
               ["46", "46"],                  # always right: no pair
               ["15", "25", "5", "1x"],       # 25 and 5 once each: the first; "1x" is not a number
               ["", "0"]]
    assert mistake_records(problems, answers) == [
        {"prompt": "57+68", "chosen": "125", "rejected": "115"},
        {"prompt": "52-37", "chosen": "15", "rejected": "25"}]
    with pytest.raises(ValueError, match="3 answer lists for 4 problems"):
        mistake_records(problems, answers[:3])


def test_record_formats():
    train, held = generate(ArithmeticTask(n_train=20, n_eval=5))
    texts = cpt_records(train, per_text=8)
    assert len(texts) == 3
    assert texts[0]["text"].split("\n") == [f"{p.question}={solve(p.question)}" for p in train[:8]]
    convo = sft_records(train[:1])[0]["messages"]
    assert convo == [{"role": "user", "content": train[0].question},
                     {"role": "assistant", "content": solve(train[0].question)}]
    messages, answer = eval_prompts(held)[0]
    assert answer == solve(held[0].question)
    assert render_prompt(messages, thinking=False) == BOS + USER + held[0].question + ASSISTANT + THINK_END


def test_fixed_width_puts_every_digit_at_the_same_place():
    """The calculator demonstration's problems: operands and sums all ``digits`` long, so a call copies the
    question at a constant distance; the space (m (m + 1) / 2 sums, m = 10**d - 2 * 10**(d - 1)) bounds the counts."""
    task = ArithmeticTask(digits=3, ops="+", n_train=2000, n_eval=100, fixed_width=True)
    train, held = generate(task)
    assert len(set(train + held)) == 2100
    assert all(len(str(p.a)) == len(str(p.b)) == len(p.answer) == 3 and p.answer == solve(p.question)
               for p in train + held)
    assert max(int(p.answer) for p in train) > 950 and min(p.a for p in train) < 110  # the whole range is drawn
    assert len(fresh_problems(task, 500, seed=1)) == 500
    with pytest.raises(ValueError, match="distinct problems"):  # 2-digit: m = 80, 3240 problems
        generate(ArithmeticTask(digits=2, ops="+", n_train=1700, n_eval=0, fixed_width=True))
    with pytest.raises(ValueError, match="fixed_width"):
        generate(ArithmeticTask(digits=2, ops="+-", fixed_width=True))


def test_too_many_problems_for_the_digit_count():
    with pytest.raises(ValueError, match="distinct problems"):
        generate(ArithmeticTask(digits=1, ops="+", n_train=60, n_eval=10))
    with pytest.raises(ValueError, match="ops"):
        generate(ArithmeticTask(ops="/"))


@pytest.mark.parametrize("mode", ["cpt", "sft"])
def test_task_flows_through_the_pipeline(tmp_path, mode):
    train, _ = generate(ArithmeticTask(n_train=200, n_eval=10))
    records = cpt_records(train, 8) if mode == "cpt" else sft_records(train)
    write_jsonl(tmp_path / "train.jsonl", records)
    cfg = DataSection(paths=[str(tmp_path / "train.jsonl")], mode=mode, tokenizer="compact", seq_len=128,
                     micro_batch_size=4)
    tok = compact_tokenizer()
    loader = build_loader(cfg, 0, 1, tok)
    summary = loader.summary()
    assert summary["documents"] == len(records) and summary["skipped"] == 0
    batch = next(loader)
    assert batch.input_ids.max() < tok.vocab_size and batch.n_loss_tokens > 0
