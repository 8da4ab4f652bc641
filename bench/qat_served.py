"""The default job trained with and without quantisation-aware training, then served as released.

Each run is the default job (CPT then SFT on generated arithmetic, same seeds; QAT, when on, in
the SFT stage: the CPT stage stands for the pretraining that post-training starts from). Its final model is
exported to the official layout with FP8 linears and FP4 routed experts (unquantised tensors in
fp32, so only the quantisation differs), loaded back, and run the way the official inference code
runs it (trex's QuantSim("official"): FP8 GEMM inputs, FP8 KV, the indexer's Hadamard + FP4). On the
held-out problems it reports greedy exact match of the trained model and of the served one, and the
gap between their logits (relative L2 norm, top-1 agreement) on the held-out conversations.

    .venv/bin/python bench/qat_served.py --write      # both runs, the default job's full schedule
    .venv/bin/python bench/qat_served.py --steps 140  # a shorter schedule, printed only
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from model_step import report  # noqa: E402

MARK_BEGIN, MARK_END = "<!-- qat-served-bench:begin -->", "<!-- qat-served-bench:end -->"


def served_copy(model, path: str):
    """``model`` exported as released (FP8 + FP4 experts) and loaded back, simulating the serving
    code's quantisation."""
    from trex.checkpoint import load_pretrained, save_pretrained
    from trex.precision import PrecisionSection

    save_pretrained(model, path, layout="official", quantize="fp8+fp4experts", dtype="fp32", overwrite=True)
    served = load_pretrained(path, dtype=torch.float32, device="cpu").eval()
    served.set_quant(PrecisionSection(qat="official").quant_sim())
    return served


def logit_gap(trained, served, rows: list[list[int]]) -> tuple[float, float]:
    """(relative L2 of the logits, fraction of positions with the same argmax) over ``rows``."""
    num = den = same = total = 0.0
    with torch.no_grad():
        for ids in rows:
            x = torch.tensor([ids])
            a, b = trained.eval()(x).logits[0], served(x).logits[0]
            num += (b - a).pow(2).sum().item()
            den += a.pow(2).sum().item()
            same += (a.argmax(-1) == b.argmax(-1)).sum().item()
            total += a.shape[0]
    return (num / den) ** 0.5, same / total


def run(qat: str, steps: int | None, out: str) -> dict:
    from trex.data.chat import render_prompt
    from trex.data.tokenizer import compact_tokenizer
    from trex.data.arithmetic import eval_prompts, generate
    from trex.checkpoint import load_pretrained
    from trex.precision import PrecisionSection
    from trex.train.default_job import DefaultJob, exact_match, run_default_job

    job = DefaultJob(out=out, qat=qat, progress=False)
    if steps:
        job.scale_steps(steps)
    summary = run_default_job(job)
    trained = load_pretrained(summary["model"], dtype=torch.float32, device="cpu").eval()
    trained.set_quant(PrecisionSection(qat=qat).quant_sim())  # as it trained
    served = served_copy(trained, os.path.join(out, "served"))
    tokenizer = compact_tokenizer()
    _, held_out = generate(dataclasses.replace(job.task, seed=job.seed))
    prompts = eval_prompts(held_out)
    served_em, _ = exact_match(served, tokenizer, prompts)
    convs = [tokenizer.encode(render_prompt(messages, thinking=False)).tolist() for messages, _ in prompts[:64]]
    gap, top1 = logit_gap(trained, served, convs)
    return {"qat": qat, "steps": job.cpt_steps + job.sft_steps, "exact_match_trained": summary["exact_match_after_sft"],
            "exact_match_served": served_em, "logit_gap": gap, "top1_agreement": top1}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=None, help="total steps of both stages (default: the job's)")
    ap.add_argument("--out", default="runs/bench_qat")
    ap.add_argument("--write", action="store_true", help="write the table to docs/benchmarks.md")
    args = ap.parse_args()
    results = [run(qat, args.steps, os.path.join(args.out, qat)) for qat in ("none", "official")]
    print(json.dumps(results, indent=1))
    lines = ["## Quantisation-aware training: the default job served as released (bench/qat_served.py)", "",
             f"CPU, fp32 masters, {results[0]['steps']} steps (CPT + SFT; QAT in SFT), same seeds; served = exported "
             "FP8 linears + FP4 experts, run with the official inference code's quantisation.", "",
             "| run | exact match, trained | exact match, served | logit gap (rel. L2) | top-1 agreement |",
             "|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| qat = \"{r['qat']}\" | {100 * r['exact_match_trained']:.1f}% | "
                     f"{100 * r['exact_match_served']:.1f}% | {r['logit_gap']:.4f} | {100 * r['top1_agreement']:.1f}% |")
    report(MARK_BEGIN, MARK_END, lines, args.write)


if __name__ == "__main__":
    main()
