"""Does SFT need the indexer alignment loss? The indexer's recall of the main attention before and
after the default job's SFT, with and without ``[train] indexer_loss``.

Recall (trex.models.deepseek_v4.compressor.Indexer.picked_mass): per query of a CSA layer, the share of the
main attention's mass over all the compressed entries it may see (heads averaged) that falls on the
indexer's top-k picks; the mean over queries and CSA layers, on the job's continued-pretraining
texts packed as in training (its SFT conversations are shorter than the top-k: a query there sees at
most k entries, and every indexer has recall 1). Each run is the whole default job (CPT, then SFT with the indexer frozen, or
trained on the loss alone: the LM loss gives it no gradient); "before" is the CPT model both start
from. Exact match is the job's own held-out figure.

    .venv/bin/python bench/indexer_alignment.py --write             # weights 0 and 0.1, the full job
    .venv/bin/python bench/indexer_alignment.py --steps 140 --weights 0 1   # shorter, printed only
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from model_step import report  # noqa: E402

MARK_BEGIN, MARK_END = "<!-- indexer-alignment-bench:begin -->", "<!-- indexer-alignment-bench:end -->"


def recall(path: str, texts: str, seq_len: int) -> float:
    """The mean recall of the model at ``path`` on the first packed rows of ``texts`` (CPT records)."""
    from trex.checkpoint import load_pretrained
    from trex.data import build_loader
    from trex.data.config import DataSection
    from trex.data.tokenizer import compact_tokenizer

    model = load_pretrained(path, dtype=torch.float32, device="cpu").eval()
    model.measure_recall = True
    section = DataSection(paths=[texts], mode="cpt", tokenizer="compact", seq_len=seq_len, micro_batch_size=32,
                          shuffle=False)
    loader = build_loader(section, rank=0, world_size=1, tokenizer=compact_tokenizer())
    values = []
    with torch.no_grad():
        for _ in range(4):
            batch = next(loader)
            values.append(model(batch.input_ids, doc_ids=batch.doc_ids).indexer_recall.item())
    return sum(values) / len(values)


def run(weight: float, steps: int | None, out: str) -> dict:
    from trex.train.default_job import DefaultJob, run_default_job

    job = DefaultJob(out=out, indexer_loss=weight, progress=False)
    if steps:
        job.scale_steps(steps)
    summary = run_default_job(job)
    texts = os.path.join(out, "data", "cpt.jsonl")
    final = [json.loads(line) for line in open(os.path.join(out, "sft", "metrics.jsonl"))][-1]
    return {"indexer_loss": weight, "steps": job.cpt_steps + job.sft_steps,
            "recall_before_sft": recall(os.path.join(out, "cpt", "model"), texts, job.seq_len),
            "recall_after_sft": recall(summary["model"], texts, job.seq_len),
            "final_indexer_kl": final.get("indexer_loss"), "exact_match": summary["exact_match_after_sft"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=None, help="total steps of both stages (default: the job's)")
    ap.add_argument("--weights", type=float, nargs="+", default=[0.0, 0.1])
    ap.add_argument("--out", default="runs/bench_indexer")
    ap.add_argument("--write", action="store_true", help="write the table to docs/benchmarks.md")
    args = ap.parse_args()
    results = [run(w, args.steps, os.path.join(args.out, f"w{w:g}")) for w in args.weights]
    print(json.dumps(results, indent=1))
    lines = ["## Indexer alignment: the indexer's recall through SFT (bench/indexer_alignment.py)", "",
             f"The default job on CPU, {results[0]['steps']} steps (CPT + SFT), same seeds; recall = the share of "
             "the main attention's mass over the visible compressed entries that the top-k picks hold, on the "
             "job's CPT texts.", "",
             "| `train.indexer_loss` | recall before SFT | recall after SFT | final indexer KL | exact match |",
             "|---|---|---|---|---|"]
    for r in results:
        kl = "-" if r["final_indexer_kl"] is None else f"{r['final_indexer_kl']:.4f}"
        lines.append(f"| {r['indexer_loss']:g} | {100 * r['recall_before_sft']:.1f}% | "
                     f"{100 * r['recall_after_sft']:.1f}% | {kl} | {100 * r['exact_match']:.1f}% |")
    report(MARK_BEGIN, MARK_END, lines, args.write)


if __name__ == "__main__":
    main()
