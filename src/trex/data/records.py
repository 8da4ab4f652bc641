"""Reading JSONL, Parquet and Arrow (HF ``datasets`` ``save_to_disk``) records, each with its file and
line, streamed a batch at a time (a file is never loaded whole), and the bad-record policy.

A bad record is one that cannot become a training document: malformed JSON, invalid UTF-8, a
missing/unknown role, an empty conversation, a document longer than seq_len, ... The policy decides:
``fail`` raises :class:`BadRecordError` naming file, line and reason; ``skip`` drops it and counts it
in :class:`SkipCounter`; ``truncate`` does the same except that an over-long document is cut to
seq_len (counted as truncated).
"""

from __future__ import annotations

import glob
import json
import logging
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, TypeVar

from trex import atomic, logs
from trex.data.chat import RecordError
from trex.data.config import BadRecordPolicyName, DataSection
from trex.recipe import check_choices

log = logging.getLogger(__name__)
T = TypeVar("T")

SUFFIXES = {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet", ".arrow": "arrow"}
HF_DATASET_FILES = ("state.json", "dataset_info.json")  # a directory written by datasets' save_to_disk


@dataclass(frozen=True)
class Record:
    """One input record; ``line`` is the 1-based JSONL line or Parquet/Arrow row. ``data`` is a
    RecordError when the line could not be read (invalid UTF-8, malformed JSON), or the line's raw
    bytes when read with ``raw=True`` (see :func:`parsed`). ``size``: its share of the file's bytes
    (a JSONL line's length; a table row's file size / rows), so progress over mixed inputs has one unit."""
    data: dict | RecordError | bytes
    path: str
    line: int
    size: float = 0.0


class BadRecordError(ValueError):
    """Raised under the ``fail`` policy: ``path:line: reason: detail``."""

    def __init__(self, path: str, line: int, reason: str, detail: str):
        super().__init__(f"{path}:{line}: bad record ({reason}): {detail}")
        self.path, self.line, self.reason = path, line, reason


@dataclass
class SkipCounter:
    """Skipped and truncated records, by reason, with the first location of each reason."""
    skipped: Counter = field(default_factory=Counter)
    truncated: int = 0
    first_seen: dict[str, str] = field(default_factory=dict)
    files_skipped: list[str] = field(default_factory=list)
    """Files of a data directory that are not data (other suffixes), by path."""

    def skip(self, reason: str, where: str) -> None:
        self.skipped[reason] += 1
        self.first_seen.setdefault(reason, where)

    def truncate(self, where: str) -> None:
        self.truncated += 1
        self.first_seen.setdefault("truncated", where)

    def as_dict(self) -> dict:
        """For summary.json: {"skipped": total, "skipped_by_reason": {...}, "truncated": n, "first_seen": {...}}."""
        return {"skipped": sum(self.skipped.values()), "skipped_by_reason": dict(sorted(self.skipped.items())),
                "truncated": self.truncated, "first_seen": dict(sorted(self.first_seen.items())),
                "files_skipped": len(self.files_skipped), "files_skipped_first": self.files_skipped[:5]}


def describe_skips(data: dict) -> str | None:
    """One console line of what a run's data left out or cut, from the ``SkipCounter.as_dict`` keys
    of its summary.json ``data`` (absent keys count as none), or None when nothing was."""
    parts = []
    first = data.get("first_seen", {})
    if data.get("skipped"):
        reasons = ", ".join(f"{n} {r} (first {first.get(r, '?')})" for r, n in data["skipped_by_reason"].items())
        parts.append(f"skipped {logs.plural(data['skipped'], 'bad record')}: {reasons}")
    if data.get("truncated"):
        parts.append(f"truncated {logs.plural(data['truncated'], 'record')} to seq_len (first "
                     f"{first.get('truncated', '?')})")
    if data.get("files_skipped"):
        parts.append(f"ignored {logs.plural(data['files_skipped'], 'non-data file')} (first "
                     f"{data['files_skipped_first'][0]})")
    return "; ".join(parts) or None


@dataclass
class BadRecordPolicy:
    """Applies ``policy`` (fail | skip | truncate) to bad records, counting into ``counter``."""
    policy: BadRecordPolicyName
    counter: SkipCounter = field(default_factory=SkipCounter)
    records_read: int = 0

    def __post_init__(self):
        check_choices(self, "data.bad_record_policy")

    def parsed(self, cfg: DataSection, parse: Callable[[Record], T]) -> Iterator[tuple[Record, T]]:
        """``(record, parse(record))`` for every record of ``cfg.paths`` in file order; a record whose
        parse raises RecordError goes to :meth:`reject`. ``records_read`` counts them all."""
        for record in iter_records(cfg.paths, cfg.format, self.counter):
            self.records_read += 1
            try:
                value = parse(record)
            except RecordError as err:
                self.reject(record.path, record.line, err.reason, err.detail)
                continue
            yield record, value

    def reject(self, path: str, line: int, reason: str, detail: str) -> None:
        """Raise under ``fail``, otherwise count the skip."""
        if self.policy == "fail":
            raise BadRecordError(path, line, reason, detail)
        self.counter.skip(reason, f"{path}:{line}")

    def too_long(self, path: str, line: int, length: int, seq_len: int) -> bool:
        """For a document of ``length`` > seq_len tokens: True to truncate it, False to drop it
        (counted); raises under ``fail``."""
        if self.policy == "truncate":
            self.counter.truncate(f"{path}:{line}")
            return True
        self.reject(path, line, "too_long", f"{length} tokens; seq_len is {seq_len}")
        return False


def resolve_paths(patterns: list[str], fmt: str = "auto",
                  counter: SkipCounter | None = None) -> list[tuple[Path, str]]:
    """Expand files, directories and globs into ``(path, format)`` in a stable order.

    Environment variables in a pattern are expanded (``/data/$RANK/*.jsonl`` for per-rank data).
    Files of a directory with other suffixes are warned about and recorded in ``counter``."""
    out: list[tuple[Path, str]] = []
    for pattern in patterns:
        pattern = os.path.expandvars(pattern)
        p = Path(pattern)
        if p.is_dir() and all((p / name).is_file() for name in HF_DATASET_FILES):
            files = _hf_dataset_files(p)
        elif p.is_dir():
            found = sorted(f for f in p.rglob("*") if f.is_file())
            files = [f for f in found if f.suffix in SUFFIXES]
            others = [f for f in found if f.suffix not in SUFFIXES and not f.name.startswith(".")]
            if others:  # counted and named, never dropped in silence (hidden files are not data)
                log.warning("%s: %d file(s) skipped, not .jsonl/.json/.parquet: %s%s", p, len(others),
                            ", ".join(str(f.relative_to(p)) for f in others[:5]), " ..." if len(others) > 5 else "")
                if counter is not None:
                    counter.files_skipped.extend(str(f) for f in others)
        elif p.is_file():
            files = [p]
        else:
            files = sorted(Path(f) for f in glob.glob(pattern, recursive=True) if Path(f).is_file())
        if not files:
            raise FileNotFoundError(f"data path {pattern!r} matches no file; expected a file, a directory "
                                    "of .jsonl/.parquet files or a glob")
        for f in files:
            kind = fmt if fmt != "auto" else SUFFIXES.get(f.suffix)
            if kind is None:
                raise ValueError(f"{f}: cannot tell the format from the extension {f.suffix!r}; "
                                 "expected .jsonl, .json or .parquet, or set data.format")
            out.append((f, kind))
    return out


def _hf_dataset_files(path: Path) -> list[Path]:
    """The Arrow files of a ``datasets`` ``save_to_disk`` directory, in the order its state.json lists."""
    try:
        state = json.loads((path / "state.json").read_text())
        files = [path / entry["filename"] for entry in state["_data_files"]]
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise ValueError(f"{path / 'state.json'}: not a datasets save_to_disk state ({err}); expected "
                         "_data_files with a filename each") from None
    missing = [f for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"{missing[0]}: listed in {path / 'state.json'} but missing")
    return files


def _parse_json_line(raw: bytes) -> dict | RecordError:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        return RecordError("invalid_utf8", f"byte {err.start}: {err.reason}")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:  # the parser's "line 1" is within the record: the file's line is the caller's
        return RecordError("malformed_json", f"{err.msg} at column {err.colno}")
    if not isinstance(data, dict):
        return RecordError("malformed_json", f"a JSON {type(data).__name__}; expected an object")
    return data


def parsed(record: Record) -> Record:
    """``record`` with raw JSONL bytes parsed (a dict, or a RecordError); other records as they are."""
    return (Record(_parse_json_line(record.data), record.path, record.line, record.size)
            if isinstance(record.data, bytes) else record)


def _jsonl_records(path: Path, raw: bool = False) -> Iterator[Record]:
    with open(path, "rb") as f:
        for line_no, line in enumerate(f, start=1):
            if line.strip():
                yield Record(line if raw else _parse_json_line(line), str(path), line_no, len(line))


def _arrow_batches(path: Path):
    """Record batches of an Arrow IPC stream (what datasets writes) or file, memory-mapped."""
    import pyarrow as pa

    source = pa.memory_map(str(path))
    try:
        reader = pa.ipc.open_stream(source)
    except pa.ArrowInvalid:
        source.seek(0)
        file = pa.ipc.open_file(source)
        return (file.get_batch(i) for i in range(file.num_record_batches))
    return iter(reader)


def _table_rows(path: Path, kind: str) -> int:
    """A Parquet or Arrow file's row count, from its metadata (Parquet) or its batches' headers (Arrow,
    memory-mapped: no data is read)."""
    import pyarrow.parquet as pq

    if kind == "parquet":
        return pq.ParquetFile(path).metadata.num_rows
    return sum(batch.num_rows for batch in _arrow_batches(path))


def _table_records(path: Path, kind: str) -> Iterator[Record]:
    import pyarrow.parquet as pq

    row = 0
    size = path.stat().st_size / max(1, _table_rows(path, kind))
    batches = pq.ParquetFile(path).iter_batches(batch_size=1024) if kind == "parquet" else _arrow_batches(path)
    for batch in batches:
        try:
            rows = batch.to_pylist()
        except UnicodeDecodeError:  # find the offending rows one by one
            rows = []
            for k in range(batch.num_rows):
                try:
                    rows.append(batch.slice(k, 1).to_pylist()[0])
                except UnicodeDecodeError as err:
                    rows.append(RecordError("invalid_utf8", err.reason))
        for data in rows:
            row += 1
            yield Record(data, str(path), row, size)


def iter_records(patterns: list[str], fmt: str = "auto", counter: SkipCounter | None = None,
                 raw: bool = False) -> Iterator[Record]:
    """Every record of every file in order, unreadable ones included (``data`` is a RecordError);
    files that are not data go to ``counter`` (see `resolve_paths`). ``raw``: JSONL lines stay bytes
    (parsed later by :func:`parsed`, in whichever process encodes them)."""
    for path, kind in resolve_paths(patterns, fmt, counter):
        yield from _jsonl_records(path, raw) if kind == "jsonl" else _table_records(path, kind)


def write_jsonl(path: str | Path, records: list[dict]) -> None:
    """Write one JSON object per line, atomically (temp file in the same folder, then rename). The
    temp name is the call's own, so processes writing the same file at once (every rank of a job
    generating its data) each rename a complete file and none loses its temp file."""
    atomic.write_text(path, "".join(json.dumps(rec, ensure_ascii=False) + "\n" for rec in records))
