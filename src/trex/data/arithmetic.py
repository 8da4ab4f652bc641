"""The default job's task, generated at run time: multi-digit arithmetic.

Problems are ``a op b`` with operands below ``10**digits``: ``+``, ``-`` (a >= b, so answers are not
negative) and ``*`` (b is a single digit). The same problems serve three uses:

* continued pretraining: raw text records ``{"text": "12+34=46\\n7-5=2\\n..."}``;
* SFT: ``{"messages": [{"role": "user", "content": "12+34"}, {"role": "assistant", "content": "46"}]}``;
* evaluation: held-out prompts (never in the training problems) with their exact answers.
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
    n = 10 ** task.digits
    per_op = {"+": n * n, "-": n * (n + 1) // 2, "*": n * 10}
    return sum(per_op[op] for op in set(task.ops))


def generate(task: ArithmeticTask) -> tuple[list[Problem], list[Problem]]:
    """``(train, held_out)``: distinct problems, seeded by ``task.seed``; no held-out problem is in train."""
    if not task.ops or set(task.ops) - set(OPS):
        raise ValueError(f"arithmetic ops {task.ops!r}; expected a non-empty subset of {OPS!r}")
    wanted = task.n_train + task.n_eval
    if wanted > _space_size(task) // 2:
        raise ValueError(f"{wanted} distinct problems requested but digits={task.digits} with ops "
                         f"{task.ops!r} allows only {_space_size(task)}; raise digits or lower the counts")
    rng = np.random.default_rng(task.seed)
    seen: dict[Problem, None] = {}
    limit = 10 ** task.digits
    while len(seen) < wanted:
        n = wanted - len(seen)
        ops = rng.choice(list(task.ops), size=n)
        a = rng.integers(0, limit, size=n)
        b = rng.integers(0, limit, size=n)
        for op, x, y in zip(ops.tolist(), a.tolist(), b.tolist()):
            if op == "-" and x < y:
                x, y = y, x
            if op == "*":
                y %= 10
            seen.setdefault(Problem(x, op, y))
    problems = list(seen)[:wanted]
    return problems[task.n_eval:], problems[:task.n_eval]


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


def carries(problem: Problem) -> int:
    """Columns that carry (``+``, ``*``) or borrow (``-``) when the problem is worked digit by digit,
    ones column first: the steps small models get wrong, used to pick harder prompts for GRPO."""
    a, b, op = problem.a, problem.b, problem.op
    count, carry = 0, 0
    while a or (b and op != "*"):  # the right operand of * is one digit: it multiplies every column
        if op == "+":
            carry = int(a % 10 + b % 10 + carry >= 10)
        elif op == "-":
            carry = int(a % 10 < b % 10 + carry)
        else:
            carry = (a % 10 * b + carry) // 10
        count += carry > 0
        a //= 10
        if op != "*":
            b //= 10
    return count


def prompt_records(problems: list[Problem]) -> list[dict]:
    """GRPO/distillation prompts: the question as ``prompt`` and its exact ``answer``."""
    return [{"prompt": p.question, "answer": p.answer} for p in problems]
