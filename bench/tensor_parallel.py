"""Tensor parallelism on the CPU: tokens/s, peak memory per rank and the TP traffic per layer at tp = 1 and 2 (with
sequence parallelism, the default, and without), and that traffic against the planner's prediction
(trex.plan.timing.tp_traffic).

A DeepSeek-V3 family model (MLA; a dense first layer, then MoE; no MTP) at two sizes, one sequence of S tokens,
fp32, gloo; each rank one thread. Every layout runs in its own torchrun (tp = 1: one process), split by
trex.parallel.tensor_parallel as `[parallel] tp` does. Time: the slowest rank's forward + backward, the median of
the timed steps. Memory: the bytes autograd saves for backward in one step (unique storages; weights, their
local shards and FSDP2's unsharded copies left out), and the weights' local shards, the worst rank; the bytes the
blocks' inputs hold (what a block checkpointed under full recompute keeps for backward: the whole rows without
sequence parallelism, 1 / tp of them with it); and Linux VmHWM during the timed steps minus VmRSS before them,
which also holds what the allocator and gloo keep (at these sizes it says little). On a machine with fewer cores
than ranks the ranks share cores, so there the times say nothing about speed-up.

Traffic: every collective of the tp group one rank takes part in during one forward + backward, counted as the
planner counts (ring-collective buffer bytes: an all-reduce of B bytes is a reduce-scatter plus an all-gather of
B, 2 B; an all-gather its output, a reduce-scatter its input), against the planner's figure for the same layout
(recompute "none"): docs/distributed.md.

    .venv/bin/python bench/tensor_parallel.py            # printed
    .venv/bin/python bench/tensor_parallel.py --write    # into docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from model_step import _status_kib, run_on_ranks, write_docs_section  # noqa: E402

MARK_BEGIN, MARK_END = "<!-- tensor-parallel-bench:begin -->", "<!-- tensor-parallel-bench:end -->"
# name -> overrides of the tiny-v3 preset (no MTP: the planner's per-block figure is for the main blocks)
SIZES = {
    "small": {"num_nextn_predict_layers": 0},
    "wider": {"num_nextn_predict_layers": 0, "hidden_size": 512, "num_attention_heads": 8, "q_lora_rank": 192,
              "kv_lora_rank": 128, "intermediate_size": 1024, "moe_intermediate_size": 256, "vocab_size": 4096},
}


def config(size: str):
    from trex.models.registry import get_preset, with_overrides

    return with_overrides(get_preset("tiny-v3"), SIZES[size])


def child(size: str, seq: int, steps: int, out: str, sequence_parallel: bool) -> None:
    """One rank: build the model, split it over the tp group under torchrun, time forward + backward, count the
    tp group's collective bytes of one step."""
    import torch
    import torch.distributed as dist

    from trex import device as device_layer
    from trex.models import build_model
    from trex.models.common.context import shift_labels
    from trex.parallel import tensor_parallel
    from trex.parallel.mesh import init_parallel, shutdown_distributed
    from trex.parallel.plan import apply_parallelism
    from trex.precision import PrecisionPolicy

    torch.set_num_threads(1)
    cfg = config(size)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    dev = device_layer.Device("cpu")
    par = init_parallel(1, 1, 1, 600, dev, tp=world, sequence_parallel=sequence_parallel)
    model = build_model(cfg, seed=0).train()
    apply_parallelism(model, par, PrecisionPolicy.resolve("fp32", dev))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (1, seq), generator=g)
    docs = torch.zeros_like(ids)
    targets = [shift_labels(ids, 1, docs)]
    counted = {"bytes": 0, "calls": 0, "inputs_kib": 0.0}
    real = {name: getattr(tensor_parallel, name) for name in ("_all_reduce", "_all_gather", "_reduce_scatter")}

    def counting(name: str, ring: int, buffer):
        def collective(x, *args):
            out = real[name](x, *args)
            counted["bytes"] += ring * buffer(x, out).numel() * x.element_size()
            counted["calls"] += 1
            return out
        return collective

    counters = {"_all_reduce": counting("_all_reduce", 2, lambda x, out: x),  # reduce-scatter + all-gather
                "_all_gather": counting("_all_gather", 1, lambda x, out: out),
                "_reduce_scatter": counting("_reduce_scatter", 1, lambda x, out: x)}
    for block in model.layers:  # what a checkpointed block keeps: its input
        block.register_forward_pre_hook(
            lambda m, args: counted.__setitem__("inputs_kib", counted["inputs_kib"] + args[0].nbytes / 1024))

    def step() -> float:
        t0 = time.perf_counter()
        out = model(ids, doc_ids=docs, targets=targets, return_logits=False)
        out.token_nll[0].sum().backward()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    step()  # warm-up: the first step allocates the gradients
    local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
    weights = {t.untyped_storage().data_ptr() for t in local}
    saved: dict[int, int] = {}

    def pack(t):
        # weights are not activations: a parameter's storage or a view of a leaf that requires grad (FSDP2's
        # unsharded copies over its 1-rank mesh here), or a split weight's local shard (its to_local view)
        base = t._base if t._base is not None else t
        weight = (t.untyped_storage().data_ptr() in weights or (base.is_leaf and base.requires_grad)
                  or type(base.grad_fn).__name__ == "_ToTorchTensorBackward")
        if not weight:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    for name, fn in counters.items():
        setattr(tensor_parallel, name, fn)
    counted["inputs_kib"] = 0.0
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    for name, fn in real.items():
        setattr(tensor_parallel, name, fn)
    inputs_kib = counted["inputs_kib"]
    counted["saved_kib"] = sum(saved.values()) / 1024
    counted["weights_kib"] = sum(t.numel() * t.element_size() for t in local) / 1024
    before = _status_kib("VmRSS")
    times = sorted(step() for _ in range(steps))
    result = {"peak_step_kib": _status_kib("VmHWM") - before, "step_s": times[len(times) // 2], **counted,
              "inputs_kib": inputs_kib}
    if world > 1:
        gathered = [None] * world
        dist.all_gather_object(gathered, result)
        result = {**result, **{k: max(r[k] for r in gathered) for k in ("peak_step_kib", "step_s", "saved_kib")}}
    shutdown_distributed()
    if int(os.environ.get("RANK", "0")) == 0:
        with open(out, "w") as f:
            json.dump(result, f)


def run(size: str, tp: int, sp: bool, seq: int, steps: int) -> dict:
    out = os.path.join(ROOT, f".bench_tp_{size}_{tp}_{int(sp)}.json")
    me = [os.path.abspath(__file__), "--child", size, str(seq), str(steps), out, str(int(sp))]
    run_on_ranks(tp, me, f"{size} at tp = {tp}" + (" with sequence parallelism" if sp else ""))
    with open(out) as f:
        result = json.load(f)
    os.remove(out)
    return result


def predicted(size: str, seq: int, tp: int, sp: bool) -> float:
    """The planner's TP bytes of one forward + backward (trex.plan.timing.tp_traffic, fp32, recompute none)."""
    from trex.plan.layout import Layout
    from trex.plan.timing import tp_traffic

    return tp_traffic(config(size), Layout(dp_shard=1, tp=tp, sequence_parallel=sp), seq, 4)


def table(seq: int, results: dict[tuple[str, int, bool], dict]) -> str:
    lines = [f"S = {seq} tokens, batch 1, fp32, DeepSeek-V3 family (tiny-v3 without MTP, and wider), "
             f"{os.cpu_count()} CPU cores; TP traffic of one rank in one forward + backward",
             "",
             "| size | tp | sequence parallel | tokens/s | weights MiB per rank | saved activations MiB per rank | "
             "vs tp = 1 | blocks' inputs MiB per rank (full recompute keeps) | vs tp = 1 | peak step MiB per rank "
             "(RSS) | collectives | TP MiB, measured | planned | measured / planned |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for (size, tp, sp), r in results.items():
        base = results[(size, 1, False)]
        measured = r["bytes"] / 2**20
        planned = predicted(size, seq, tp, sp) / 2**20 if tp > 1 else 0.0
        ratio = f"{measured / planned:.2f}" if planned else "-"
        lines.append(f"| {size} | {tp} | {'yes' if sp else '-'} | {seq / r['step_s']:.0f} | "
                     f"{r['weights_kib'] / 1024:.1f} | {r['saved_kib'] / 1024:.1f} | "
                     f"{r['saved_kib'] / base['saved_kib']:.2f} | {r['inputs_kib'] / 1024:.1f} | "
                     f"{r['inputs_kib'] / base['inputs_kib']:.2f} | {r['peak_step_kib'] / 1024:.0f} | {r['calls']} | "
                     f"{measured:.2f} | {planned:.2f} | {ratio} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq", type=int, default=2048, help="tokens of the one sequence (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps; the median counts (default: %(default)s)")
    parser.add_argument("--write", action="store_true", help="put the table into docs/benchmarks.md (default: print)")
    parser.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        size, seq, steps, out, sp = args.child
        child(size, int(seq), int(steps), out, sp == "1")
        return
    layouts = [(1, False), (2, False), (2, True)]
    results = {(size, tp, sp): run(size, tp, sp, args.seq, args.steps) for size in SIZES for tp, sp in layouts}
    text = table(args.seq, results)
    print(text)
    if args.write:
        write_docs_section(MARK_BEGIN, MARK_END, "## Tensor parallelism: throughput, memory and traffic (CPU)\n\n"
                           "Command: `.venv/bin/python bench/tensor_parallel.py`\n\n" + text)


if __name__ == "__main__":
    main()
