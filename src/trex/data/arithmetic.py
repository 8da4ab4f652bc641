"""The default job's task, generated at run time: multi-digit arithmetic.

Problems are ``a op b`` with operands below ``10**digits``: ``+``, ``-`` (a >= b, so answers are not
negative) and ``*`` (b is a single digit). The same problems serve three uses:

* continued pretraining: raw text records ``{"text": "12+34=46\\n7-5=2\\n..."}``;
* SFT: ``{"messages": [{"role": "user", "content": "12+34"}, {"role": "assistant", "content": "46"}]}``;
* evaluation: held-out prompts (never in the training problems) with their exact answers.

Post-training demos draw on a third split (`fresh_problems`): GRPO/distillation prompts
(`prompt_records`) and DPO pairs (`preference_records` with synthetic slips, or `mistake_records`
with a model's own wrong answers). The calculator demonstration (trex.train.tool_demo) warms a model up
on `tool_call_records`: the question answered by a call to the calculator and a copy of its result.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

OPS = "+-*"


@dataclass
class ArithmeticTask:
    digits: int = 2
    """Operands are drawn uniformly from [0, 10**digits) (the right operand of * from [0, 10))."""
    ops: str = "+-"
    """Operators to draw from, a subset of "+-*"."""
    n_train: int = 4000
    """Training problems."""
    n_eval: int = 200
    """Held-out problems, disjoint from the training ones."""
    problems_per_text: int = 8
    """Problems per raw-text record for continued pretraining (one per line)."""
    seed: int = 0
    fixed_width: bool = False
    """Every number exactly ``digits`` digits long: operands from [10**(digits-1), 10**digits), sums below
    10**digits, so each digit sits at the same place in every problem (``ops = "+"`` only). The calculator
    demonstration's: a call copies the question at a constant distance from it."""


@dataclass(frozen=True)
class Problem:
    a: int
    op: str
    b: int

    @property
    def question(self) -> str:
        return f"{self.a}{self.op}{self.b}"

    @property
    def answer(self) -> str:
        value = {"+": self.a + self.b, "-": self.a - self.b, "*": self.a * self.b}[self.op]
        return str(value)

    @property
    def text(self) -> str:
        return f"{self.question}={self.answer}"


def _space_size(task: ArithmeticTask) -> int:
    if task.fixed_width:  # a, b >= low with a + b < high: m (m + 1) / 2 pairs, m = high - 2 low
        m = max(0, 10 ** task.digits - 2 * 10 ** (task.digits - 1))
        return m * (m + 1) // 2
    n = 10 ** task.digits
    per_op = {"+": n * n, "-": n * (n + 1) // 2, "*": n * 10}
    return sum(per_op[op] for op in set(task.ops))


def _check_ops(task: ArithmeticTask) -> None:
    if not task.ops or set(task.ops) - set(OPS):
        raise ValueError(f"arithmetic ops {task.ops!r}; expected a non-empty subset of {OPS!r}")
    if task.fixed_width and task.ops != "+":
        raise ValueError(f"arithmetic fixed_width with ops {task.ops!r}; it takes ops \"+\" only")


def _draw(task: ArithmeticTask, wanted: int, rng: np.random.Generator, exclude: set[Problem]) -> list[Problem]:
    """``wanted`` distinct problems not in ``exclude``, in draw order: an operator uniformly from
    ``task.ops``, then both operands uniformly (swapped for ``-`` so a >= b; with ``fixed_width``, a draw
    whose sum is too long is dropped)."""
    seen: dict[Problem, None] = {}
    limit = 10 ** task.digits
    low = 10 ** (task.digits - 1) if task.fixed_width else 0
    while len(seen) < wanted:
        n = wanted - len(seen)
        ops = rng.choice(list(task.ops), size=n)
        a = rng.integers(low, limit, size=n)
        b = rng.integers(low, limit, size=n)
        for op, x, y in zip(ops.tolist(), a.tolist(), b.tolist()):
            if op == "-" and x < y:
                x, y = y, x
            if op == "*":
                y %= 10
            p = Problem(x, op, y)
            if task.fixed_width and x + y >= limit:
                continue
            if p not in exclude:
                seen.setdefault(p)
    return list(seen)[:wanted]


def generate(task: ArithmeticTask) -> tuple[list[Problem], list[Problem]]:
    """``(train, held_out)``: distinct problems, seeded by ``task.seed``; no held-out problem is in train."""
    _check_ops(task)
    wanted = task.n_train + task.n_eval
    if wanted > _space_size(task) // 2:
        raise ValueError(f"{wanted} distinct problems requested but digits={task.digits} with ops "
                         f"{task.ops!r} allows only {_space_size(task)}; raise digits or lower the counts")
    problems = _draw(task, wanted, np.random.default_rng(task.seed), set())
    return problems[task.n_eval:], problems[:task.n_eval]


def fresh_problems(task: ArithmeticTask, n: int, seed: int) -> list[Problem]:
    """A third split: ``n`` distinct problems of the same distribution that are in neither split of
    ``generate(task)`` (never trained on, never in its held-out set), seeded by ``seed``. Post-training
    demos draw their training prompts and a larger held-out set from it."""
    _check_ops(task)
    train, held_out = generate(task)
    left = _space_size(task) - len(train) - len(held_out)
    if n > left // 2:
        raise ValueError(f"{n} fresh problems requested but only {left} problems of digits={task.digits} "
                         f"with ops {task.ops!r} are outside the task's {len(train)} + {len(held_out)}; "
                         f"at most {left // 2}")
    return _draw(task, n, np.random.default_rng([seed, task.seed]), set(train) | set(held_out))


def cpt_records(problems: list[Problem], per_text: int) -> list[dict]:
    """Raw-text records, ``per_text`` problems per record, one per line."""
    return [{"text": "\n".join(p.text for p in problems[i:i + per_text])}
            for i in range(0, len(problems), per_text)]


def sft_records(problems: list[Problem]) -> list[dict]:
    """One single-turn conversation per problem: the question from the user, the answer from the assistant."""
    return [{"messages": [{"role": "user", "content": p.question}, {"role": "assistant", "content": p.answer}]}
            for p in problems]


def eval_prompts(problems: list[Problem]) -> list[tuple[list[dict], str]]:
    """``(messages ending in the user question, exact expected answer)`` per held-out problem."""
    return [([{"role": "user", "content": p.question}], p.answer) for p in problems]


def wrong_answer(problem: Problem, rng: np.random.Generator) -> str:
    """A plausible wrong answer: off by one in the ones digit, or a carry/borrow slip in the tens."""
    value = int(problem.answer)
    return str(rng.choice([v for v in (value + 1, value - 1, value + 10, value - 10) if v >= 0]))


def preference_records(problems: list[Problem], seed: int = 0) -> list[dict]:
    """DPO pairs: the question as ``prompt``, the exact answer ``chosen``, a `wrong_answer` ``rejected``."""
    rng = np.random.default_rng(seed)
    return [{"prompt": p.question, "chosen": p.answer, "rejected": wrong_answer(p, rng)} for p in problems]


def mistake_records(problems: list[Problem], answers: list[list[str]]) -> list[dict]:
    """DPO pairs from a model's own mistakes (on-policy negatives): ``answers[i]`` are answers a model
    gave to ``problems[i]``; a problem with a wrong numeric answer among them gives the pair
    ``{"prompt": question, "chosen": the exact answer, "rejected": its most frequent wrong answer}``
    (the first given among equally frequent ones); a problem always answered right gives none."""
    if len(answers) != len(problems):
        raise ValueError(f"mistake_records: {len(answers)} answer lists for {len(problems)} problems")
    records = []
    for p, given in zip(problems, answers):
        wrong = [a for a in given if a.isdigit() and a != p.answer]
        if wrong:
            rejected = max(dict.fromkeys(wrong), key=wrong.count)  # max keeps the first of equal counts
            records.append({"prompt": p.question, "chosen": p.answer, "rejected": rejected})
    return records


def prompt_records(problems: list[Problem]) -> list[dict]:
    """GRPO/distillation prompts: the question as ``prompt`` and its exact ``answer``."""
    return [{"prompt": p.question, "answer": p.answer} for p in problems]


def tool_call_records(problems: list[Problem], tool: str = "calculator", argument: str = "expression") -> list[dict]:
    """SFT demonstrations of a tool call, one conversation per problem: the question from the user, an
    assistant turn that calls ``tool`` with the question as ``argument``, the tool's answer (the exact
    answer) and the assistant's copy of it."""
    return [{"messages": [
        {"role": "user", "content": p.question},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": tool, "arguments": {argument: p.question}}}]},
        {"role": "tool", "content": p.answer},
        {"role": "assistant", "content": p.answer}]} for p in problems]
