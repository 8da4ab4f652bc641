"""Small generated arithmetic SFT files for tests (the default job's task, trex.data.arithmetic)."""

from __future__ import annotations

from pathlib import Path

from trex.data.arithmetic import ArithmeticTask, generate, sft_records
from trex.data.records import write_jsonl


def write_sft(directory, n_train: int, n_eval: int = 20, held_out: str = "held.jsonl") -> tuple[Path, Path]:
    """``directory``/sft.jsonl with ``n_train`` two-digit problems and ``directory``/``held_out``
    with ``n_eval`` others, as chat records; returns both paths."""
    directory = Path(directory)
    train, held = generate(ArithmeticTask(digits=2, n_train=n_train, n_eval=n_eval))
    write_jsonl(directory / "sft.jsonl", sft_records(train))
    write_jsonl(directory / held_out, sft_records(held))
    return directory / "sft.jsonl", directory / held_out
