"""Context parallelism: per-rank peak memory and step time of one sequence at cp = 1, 2, 4.

The model of bench/model_step.py (V4 proportions at toy width), one row of S tokens (several packed
documents), fp32, CPU, gloo; each rank one thread. Every layout runs in its own torchrun (cp = 1: one
process), the model replicated on every rank and only the sequence split (trex.parallel.context_parallel),
so the memory a rank adds during the step is the activations of its shard plus what context
parallelism keeps whole (the gathered compressed entries, the halo rows, the gathered per-token
losses). Memory: Linux VmHWM during the step minus VmRSS before it, the worst rank. Time: the slowest
rank's forward + backward, the median of the timed steps. On a machine with fewer cores than ranks
the ranks share cores, so there the times say nothing about speed-up; the memory does not depend on it.

    .venv/bin/python bench/context_parallel.py --write       # S = 16384, cp = 1, 2, 4
    .venv/bin/python bench/context_parallel.py --seq 4096    # printed only
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from model_step import BENCH_CONFIG, _status_kib, run_on_ranks, write_docs_section  # noqa: E402

MARK_BEGIN, MARK_END = "<!-- context-parallel-bench:begin -->", "<!-- context-parallel-bench:end -->"


def child(seq: int, steps: int, out: str) -> None:
    """One rank: build the model, split the sequence if under torchrun, time forward + backward."""
    import torch
    import torch.distributed as dist

    from trex.models import build_model
    from trex.models.common.context import shift_labels
    from trex.models.deepseek_v4.config import ModelConfig

    torch.set_num_threads(1)
    cfg = ModelConfig.from_dict(dict(BENCH_CONFIG, max_position_embeddings=max(seq, 16384)))
    model = build_model(cfg, seed=0).train()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh

        from trex.parallel.context_parallel import apply_context_parallel

        dist.init_process_group("gloo")
        apply_context_parallel(model, init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))["cp"])
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (1, seq), generator=g)
    docs = (torch.arange(seq) // (seq // 3 + 1))[None]  # three documents, boundaries inside shards
    targets = [shift_labels(ids, 1, docs)]

    def step() -> float:
        t0 = time.perf_counter()
        out = model(ids, doc_ids=docs, targets=targets, return_logits=False)
        out.token_nll[0].sum().backward()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    step()  # warm-up: the first step allocates the gradients
    before = _status_kib("VmRSS")
    times = sorted(step() for _ in range(steps))
    result = {"peak_step_kib": _status_kib("VmHWM") - before, "step_s": times[len(times) // 2]}
    if world > 1:
        gathered = [None] * world
        dist.all_gather_object(gathered, result)
        dist.destroy_process_group()
        result = {"peak_step_kib": max(r["peak_step_kib"] for r in gathered),
                  "step_s": max(r["step_s"] for r in gathered)}
    if int(os.environ.get("RANK", "0")) == 0:
        with open(out, "w") as f:
            json.dump(result, f)


def run(cp: int, seq: int, steps: int) -> dict:
    out = os.path.join(ROOT, ".bench_cp.json")
    me = [os.path.abspath(__file__), "--child", str(seq), str(steps), out]
    run_on_ranks(cp, me, f"cp = {cp}")
    with open(out) as f:
        result = json.load(f)
    os.remove(out)
    return result


def table(seq: int, results: dict[int, dict]) -> str:
    base = results[1]
    lines = [f"S = {seq} tokens, batch 1, fp32, {os.cpu_count()} CPU cores",
             "",
             "| cp | peak step MiB per rank | vs cp = 1 | ideal 1/cp | step s (slowest rank) |",
             "|---|---|---|---|---|"]
    for cp, r in results.items():
        lines.append(f"| {cp} | {r['peak_step_kib'] / 1024:.0f} | {r['peak_step_kib'] / base['peak_step_kib']:.2f} | "
                     f"{1 / cp:.2f} | {r['step_s']:.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq", type=int, default=16384)
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--write", action="store_true", help="put the table into docs/benchmarks.md (default: print)")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        seq, steps, out = args.child
        child(int(seq), int(steps), out)
        return
    results = {cp: run(cp, args.seq, args.steps) for cp in args.cp}
    text = table(args.seq, results)
    print(text)
    if args.write:
        write_docs_section(MARK_BEGIN, MARK_END, "## Context parallelism: memory per rank (CPU)\n\n"
                           "Command: `.venv/bin/python bench/context_parallel.py`\n\n" + text)


if __name__ == "__main__":
    main()
