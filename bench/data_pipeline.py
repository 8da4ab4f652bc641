"""The data pipeline at the size of real runs (trex.data.prepared), in one run:

- prepare's tokens/s with 1 and 2 workers, beside the tokenizer's own batch-encode rate on one core
  (the ceiling: rendering, validating, packing and writing cost the rest);
- the time from `trex train` start to the end of step 1 on a prepared set of 20,000 records and of
  the full set: mapping must not grow with the set;
- the peak RSS of that process over the same run on 1,000 records (the no-data baseline);
- packing efficiency at 4096 tokens: next_fit (the default) and best_fit;
- the storage format: the same packed rows served from prepare's memory-mapped arrays and from an
  Arrow table laid out as HF `datasets` keeps tokenized data (one row per document, list columns),
  memory-mapped with pyarrow: conversion, open and rows/s.

    .venv/bin/python bench/data_pipeline.py                    # 1,000,000 records, about 0.5 B tokens
    .venv/bin/python bench/data_pipeline.py --records 100000 --write   # figures into docs/benchmarks.md

The records are a generated long-tailed chat set (1-3 turns, log-normal turn lengths) encoded with
the DeepSeek-V4 tokenizer. Every figure is measured here; nothing is copied from elsewhere.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ["RAYON_NUM_THREADS"] = "1"  # one core per worker: the ceiling and the in-process prepare alike

import numpy as np  # noqa: E402

from trex.data import DataSection, load_tokenizer  # noqa: E402
from trex.data.documents import record_segments  # noqa: E402
from trex.data.packing import pack, pack_best_fit  # noqa: E402
from trex.data.prepared import open_prepared, prepare  # noqa: E402
from trex.data.records import Record, write_jsonl  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MARK_BEGIN, MARK_END = "<!-- data-pipeline-bench:begin -->", "<!-- data-pipeline-bench:end -->"
WORDS = [w for w in re.findall(r"[a-z]+", (ROOT / "docs" / "data.md").read_text().lower()) if len(w) > 2]


def chat_set(n: int, seed: int = 0) -> list[dict]:
    """n conversations of 1-3 turns; words per message log-normal (median 60, a long tail)."""
    rng = np.random.default_rng(seed)
    words = np.array(WORDS)

    def text() -> str:
        return " ".join(words[rng.integers(0, len(words), min(3000, int(rng.lognormal(np.log(60), 1.0)) + 1))])

    out = []
    for _ in range(n):
        messages = []
        for _ in range(int(rng.integers(1, 4))):
            messages += [{"role": "user", "content": text()}, {"role": "assistant", "content": text()}]
        out.append({"messages": messages})
    return out


def ceiling(cfg: DataSection, tok, records: list[dict]) -> float:
    """The tokenizer's batch-encode tokens/s on the rendered texts of ``records`` (chunks of 512)."""
    texts = [s.text for r in records for s in record_segments(Record(r, "", 0), cfg)]
    start, tokens = time.perf_counter(), 0
    for k in range(0, len(texts), 512):
        tokens += sum(len(e.ids) for e in tok.backend.encode_batch_fast(texts[k:k + 512], add_special_tokens=False))
    return tokens / (time.perf_counter() - start)


def _serve(rows, picks: np.ndarray, piece) -> float:
    """rows/s assembling the packed rows ``picks`` (input ids with -100 where not a target), each
    document's (tokens, loss mask) from ``piece(d)``: the same loop for every storage."""
    start = time.perf_counter()
    for index in picks:
        for r in index.tolist():
            row, at = np.zeros(rows.seq_len, dtype=np.int64), 0
            for d in rows.order[rows.bounds[r]:rows.bounds[r + 1]].tolist():
                values, keep = piece(d)
                row[at:at + len(values)] = np.where(keep, values, -100)
                at += len(values)
    return picks.size / (time.perf_counter() - start)


def arrow_vs_mmap(prepared: Path, batches: int = 300, batch_rows: int = 8) -> dict[str, dict[str, float]]:
    """Serve the same random packed rows from the prepared arrays (np.memmap) and from an Arrow IPC
    file of one row per document (input_ids large_list<int32>, loss_mask large_list<uint8>, in
    record batches of 1,000, as HF datasets stores a tokenized set), memory-mapped: seconds to
    convert, seconds to open, rows/s through pyarrow's own calls and through numpy views of its buffers."""
    import pyarrow as pa

    rows, _ = open_prepared(prepared, pad_id=0)
    docs, out = rows.docs, {}
    arrow = prepared.parent / "arrow.arrow"
    start = time.perf_counter()
    offsets = pa.array(np.asarray(docs.offsets), pa.int64())
    table = pa.table({"input_ids": pa.LargeListArray.from_arrays(offsets, pa.array(np.asarray(docs.tokens))),
                      "loss_mask": pa.LargeListArray.from_arrays(offsets, pa.array(np.asarray(docs.loss_mask)))})
    with pa.OSFile(str(arrow), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table, max_chunksize=1000)
    convert = time.perf_counter() - start
    del table
    picks = np.random.default_rng(0).integers(0, len(rows), (batches, batch_rows))

    start = time.perf_counter()
    mapped, _ = open_prepared(prepared, pad_id=0)
    opened = time.perf_counter() - start
    off, tokens, mask = mapped.docs.offsets, mapped.docs.tokens, mapped.docs.loss_mask

    def from_memmap(d):
        lo, hi = int(off[d]), int(off[d + 1])
        return tokens[lo:hi], mask[lo:hi]

    out["trex prepare: memory-mapped arrays"] = {"rows": picks.size, "convert_s": 0.0, "open_s": opened,
                                       "rows_per_s": _serve(rows, picks, from_memmap)}

    start = time.perf_counter()
    table = pa.ipc.open_file(pa.memory_map(str(arrow))).read_all()  # zero-copy over the mapped file
    ids, keep = table.column("input_ids"), table.column("loss_mask")
    opened = time.perf_counter() - start

    def from_take(d):
        at = pa.array([d])
        return ids.take(at).combine_chunks().flatten().to_numpy(), keep.take(at).combine_chunks().flatten().to_numpy()

    out["Arrow IPC mapped, pyarrow take"] = {"rows": picks.size, "convert_s": convert, "open_s": opened,
                                             "rows_per_s": _serve(rows, picks, from_take)}

    start = time.perf_counter()  # the most Arrow can give: numpy views of each record batch's buffers
    views = [(b.column(0).offsets.to_numpy(), b.column(0).values.to_numpy(), b.column(1).values.to_numpy())
             for b in pa.ipc.open_file(pa.memory_map(str(arrow))).read_all().to_batches()]
    firsts = np.cumsum([0] + [len(v[0]) - 1 for v in views])
    opened = time.perf_counter() - start

    def from_views(d):
        b = int(np.searchsorted(firsts, d, side="right")) - 1
        offs, values, flags = views[b]
        lo, hi = int(offs[d - firsts[b]]), int(offs[d - firsts[b] + 1])
        return values[lo:hi], flags[lo:hi]

    out["Arrow IPC mapped, numpy views of its buffers"] = {"rows": picks.size, "convert_s": convert, "open_s": opened,
                                                           "rows_per_s": _serve(rows, picks, from_views)}
    return out


def train_start(prepared: Path, data: Path, out: Path) -> tuple[float, float]:
    """(seconds, peak RSS MiB) of `trex train` on ``prepared`` to the end of step 1 (a tiny model)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    (out.parent / "recipe.toml").write_text("# everything set on the command line\n")
    sets = [f'data.paths=["{data}"]', f'data.prepared="{prepared}"', "data.seq_len=4096", "train.steps=1",
            'data.bad_record_policy="skip"',
            "train.progress=false", "fidelity.every=0", "model.overrides={vocab_size=129280}"]
    cmd = ["/usr/bin/time", "-f", "%M", sys.executable, "-m", "trex", "train", str(out.parent / "recipe.toml"),
           "--out", str(out), *[a for s in sets for a in ("--set", s)]]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"trex train failed:\n{proc.stderr[-3000:]}")
    return seconds, int(proc.stderr.strip().splitlines()[-1]) / 1024


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--records", type=int, default=1_000_000)
    p.add_argument("--write", action="store_true", help="put the figures into docs/benchmarks.md")
    args = p.parse_args()
    tok = load_tokenizer("deepseek-v4")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        sizes = {"baseline": 1_000, "20k": 20_000, "full": args.records}
        cfgs = {}
        for name, n in sizes.items():
            write_jsonl(tmp / f"{name}.jsonl", chat_set(n))
            cfgs[name] = DataSection(paths=[str(tmp / f"{name}.jsonl")], seq_len=4096, bad_record_policy="skip")
        rate = ceiling(cfgs["20k"], tok, chat_set(20_000))
        runs = {}
        for workers in (1, 2):
            start = time.perf_counter()
            manifest = prepare(cfgs["full"], tok, tmp / f"full-w{workers}", workers=workers)
            runs[workers] = manifest["counts"]["tokens"] / (time.perf_counter() - start)
        for name in ("baseline", "20k"):
            prepare(cfgs[name], tok, tmp / f"{name}-w1", workers=1)
        starts = {name: train_start(tmp / f"{name}-w1" if name != "full" else tmp / "full-w1", tmp / f"{name}.jsonl",
                                    tmp / "runs" / name) for name in ("baseline", "20k", "full")}
        lengths = np.diff(np.fromfile(tmp / "full-w1" / "doc_offsets.i64", dtype="<i8"))
        lengths = lengths[np.random.default_rng(0).permutation(len(lengths))]
        best = pack_best_fit(lengths, 4096, DataSection().pack_window)[1]
        efficiency = {"next_fit": lengths.sum() / ((len(pack(lengths, 4096)) - 1) * 4096),
                      "best_fit": lengths.sum() / ((len(best) - 1) * 4096)}
        formats = arrow_vs_mmap(tmp / "full-w1")
        tokens = json.loads((tmp / "full-w1" / "manifest.json").read_text())["counts"]["tokens"]
        disk = sum(f.stat().st_size for f in (tmp / "full-w1").iterdir())
    rows = [
        f"{args.records:,} generated chat records, {tokens / 1e6:,.1f} M tokens (V4 tokenizer), seq_len 4096, "
        f"{os.cpu_count()} cores; {disk / tokens:.2f} bytes on disk per token.",
        "",
        "| measure | value | against |",
        "|---|---|---|",
        f"| tokenizer batch encode, one core (the ceiling) | {rate / 1e6:.2f} M tokens/s | |",
        f"| prepare, 1 worker | {runs[1] / 1e6:.2f} M tokens/s | {runs[1] / rate:.0%} of the ceiling |",
        f"| prepare, 2 workers | {runs[2] / 1e6:.2f} M tokens/s | {runs[2] / runs[1]:.2f}x 1 worker |",
        f"| `trex train` to the end of step 1, 20,000 records | {starts['20k'][0]:.1f} s | |",
        f"| `trex train` to the end of step 1, {args.records:,} records | {starts['full'][0]:.1f} s | "
        f"{starts['full'][0] / starts['20k'][0]:.2f}x 20,000 |",
        f"| peak RSS over 1,000 records, {args.records:,} records | {starts['full'][1] - starts['baseline'][1]:+.0f} MiB "
        f"| {starts['baseline'][1]:.0f} MiB baseline |",
        f"| packing efficiency at 4096: next_fit / best_fit | {efficiency['next_fit']:.1%} / "
        f"{efficiency['best_fit']:.1%} | |",
    ]
    mmap_rate = formats["trex prepare: memory-mapped arrays"]["rows_per_s"]
    rows += ["", f"Storage of the prepared set: the same {formats['trex prepare: memory-mapped arrays']['rows']:,} random packed rows "
             f"of 4096 tokens, {args.records:,} records.",
             "", "| format | convert s | open s | rows/s | against memmap |", "|---|---|---|---|---|"]
    rows += [f"| {name} | {f['convert_s']:.1f} | {f['open_s']:.3f} | {f['rows_per_s']:,.0f} | "
             f"{f['rows_per_s'] / mmap_rate:.2f}x |" for name, f in formats.items()]
    section = "\n".join([MARK_BEGIN, "## Data pipeline at scale (bench/data_pipeline.py)", "", *rows, MARK_END])
    print(section)
    if args.write:
        path = ROOT / "docs" / "benchmarks.md"
        doc = path.read_text()
        if MARK_BEGIN in doc:
            doc = doc[:doc.index(MARK_BEGIN)] + section + doc[doc.index(MARK_END) + len(MARK_END):]
        else:
            doc = doc.rstrip("\n") + "\n\n" + section + "\n"
        path.write_text(doc)


if __name__ == "__main__":
    main()
