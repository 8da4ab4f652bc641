"""The generated arithmetic task of the default job."""

import operator
import re

import pytest

from trex.data import DataConfig, build_loader, compact_tokenizer
from trex.data.arithmetic import ArithmeticTask, cpt_records, eval_prompts, generate, sft_records
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
    cfg = DataConfig(paths=[str(tmp_path / "train.jsonl")], mode=mode, tokenizer="compact", seq_len=128,
                     micro_batch_size=4)
    tok = compact_tokenizer()
    loader = build_loader(cfg, 0, 1, tok)
    summary = loader.summary()
    assert summary["documents"] == len(records) and summary["skipped"] == 0
    batch = next(loader)
    assert batch.input_ids.max() < tok.vocab_size and batch.n_loss_tokens > 0
