"""`trex data prepare` then `trex train` on the same recipe, as a user runs them: the seconds of each,
and what the train tokenizes (tokenizer calls and tokens), with the fidelity probe due (fidelity.every
= 1) and not due (the default, every 10 steps, in a 2-step run). The train runs first with every = 10, then
with every = 1 (which finds what the first one prepared).

    .venv/bin/python bench/prepare_then_train.py                     # 100,000 records
    .venv/bin/python bench/prepare_then_train.py --records 100000 --write   # figures into docs/benchmarks.md
    PYTHONPATH=OTHER/src .venv/bin/python bench/prepare_then_train.py --label before   # another trex's figures

It also times what the stale-input check adds: a whole-file digest of the input (read once while
preparing), and a start whose input was rewritten with the same bytes (hashed once, then a stat).
The records are bench/data_pipeline.py's long-tailed chat set with the DeepSeek-V4 tokenizer.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from data_pipeline import chat_set  # noqa: E402
from model_step import report  # noqa: E402

from trex.data.records import write_jsonl  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MARK_BEGIN, MARK_END = "<!-- prepare-then-train-bench:begin -->", "<!-- prepare-then-train-bench:end -->"

# run in a child: trex train in-process, every tokenizer call counted; prints {"calls", "tokens", "seconds"}
COUNTED_TRAIN = """
import json, sys, time
from trex.data.tokenizer import Tokenizer
seen = {"calls": 0, "tokens": 0}
def counted(real):
    def call(self, x):
        out = real(self, x)
        seen["calls"] += 1
        seen["tokens"] += sum(len(o) for o in out) if isinstance(x, list) else len(out)
        return out
    return call
Tokenizer.encode, Tokenizer.encode_batch = counted(Tokenizer.encode), counted(Tokenizer.encode_batch)
from trex.cli import main
start = time.perf_counter()
code = main(sys.argv[1:])
print(json.dumps({**seen, "seconds": time.perf_counter() - start, "code": code}))
"""


def run(cmd: list[str], env: dict) -> tuple[float, str]:
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:4])} failed:\n{proc.stderr[-3000:]}")
    return time.perf_counter() - start, proc.stdout


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--records", type=int, default=100_000)
    p.add_argument("--label", default="this trex", help="the name of the column these figures go in")
    p.add_argument("--write", action="store_true", help="put the figures into docs/benchmarks.md")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data = tmp / "chat.jsonl"
        write_jsonl(data, chat_set(args.records))
        recipe = tmp / "recipe.toml"
        recipe.write_text(f'[data]\npaths = ["{data}"]\nseq_len = 1024\nbad_record_policy = "skip"\n'
                          '[model]\npreset = "tiny"\noverrides = { vocab_size = 129280 }\n'
                          '[train]\nsteps = 2\nprogress = false\n')
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TREX_CACHE_DIR": str(tmp / "cache")}
        prep_s, _ = run([sys.executable, "-m", "trex", "data", "prepare", str(recipe), "--workers", "2"], env)
        figures = {"records": args.records, "input_mb": data.stat().st_size / 1e6, "prepare_s": prep_s}
        for every in (10, 1):
            # data.prepare_workers = 1: whatever the train tokenizes, it tokenizes in this process, where it is counted
            _, out = run([sys.executable, "-c", COUNTED_TRAIN, "train", str(recipe), "--out", str(tmp / f"run{every}"),
                          "--set", f"fidelity.every={every}", "--set", "data.prepare_workers=1"], env)
            figures[f"train_every{every}"] = json.loads(out.strip().splitlines()[-1])
        try:
            from trex.data.prepared import content_digest
        except ImportError:  # a trex before the stale-input check
            content_digest = None
        if content_digest:
            start = time.perf_counter()
            content_digest(data)
            figures["digest_s"] = time.perf_counter() - start
            shutil.copy2(data, tmp / "copy.jsonl")  # rsync -a: the same bytes and mtime, a new inode
            os.replace(tmp / "copy.jsonl", data)
            figures["rewritten_s"], _ = run([sys.executable, "-m", "trex", "data", "prepare", str(recipe)], env)
            figures["again_s"], _ = run([sys.executable, "-m", "trex", "data", "prepare", str(recipe)], env)
    print(json.dumps(figures, indent=2))
    section(figures, args.label, args.write)


def section(f: dict, label: str, write: bool) -> None:
    """The figures as markdown, printed; with ``write`` also in docs/benchmarks.md."""
    rows = [f"{f['records']:,} generated chat records ({f['input_mb']:.0f} MB of JSONL, DeepSeek-V4 tokenizer), "
            f"seq_len 1024, a tiny model, 2 steps, {os.cpu_count()} cores ({label}).", "",
            "| | seconds | tokenizer calls | tokens tokenized |", "|---|---|---|---|",
            f"| `trex data prepare --workers 2` | {f['prepare_s']:.1f} | | |"]
    for every in (10, 1):
        t = f[f"train_every{every}"]
        rows.append(f"| then `trex train`, fidelity.every = {every} | {t['seconds']:.1f} | {t['calls']:,} | "
                    f"{t['tokens']:,} |")
    if "digest_s" in f:
        rows += ["", f"The stale-input check: the whole-file digest taken while preparing costs {f['digest_s']:.2f} s "
                 f"({f['digest_s'] / f['prepare_s']:.1%} of the prepare); a start after the input was rewritten "
                 f"with the same bytes (hashed once) {f['rewritten_s']:.1f} s, the next one (a stat) "
                 f"{f['again_s']:.1f} s; neither tokenizes."]
    report(MARK_BEGIN, MARK_END, ["## Prepare, then train (bench/prepare_then_train.py)", "", *rows], write)


if __name__ == "__main__":
    main()
