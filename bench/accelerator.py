"""The accelerator figures of bench/accelerator.sh: a V4-Flash-shaped training step, eager vs compiled,
with MFU, and the report that writes every figure of the script into docs/benchmarks.md.

    python bench/accelerator.py step --device cuda --out runs/accelerator/step.json
    python bench/accelerator.py report runs/accelerator          # -> docs/benchmarks.md
    python bench/accelerator.py step --device cpu --smoke --backend eager --out /tmp/step.json   # CPU check

The stack has V4-Flash's real widths (hidden 4096, 64 query heads x 512, q rank 1024, 8 output groups
of rank 1024, expert width 2048, the 129,280-token vocabulary, mHC with 4 streams) and few layers
(sliding, CSA, HCA, CSA) and experts (8, top 6) so that it fits one device with AdamW state. The step
is the training loop's (trex.train.step.train_step: SFT objective on a fixed packed batch, clipping,
the guard, Muon + AdamW, router-bias update), in the policy's compute dtype with fp32 masters. MFU is
model FLOPs (trex.models.flops) per second over the hardware profile's peak for that dtype.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MARK_BEGIN, MARK_END = "<!-- accelerator-bench:begin -->", "<!-- accelerator-bench:end -->"


def flash_stack(smoke: bool):
    """V4-Flash widths with 4 layers and 8 experts (smoke: the tiny preset, for the CPU check)."""
    from trex.models.config import CSA, HASH_MOE, HCA, MOE, SLIDING, get_preset, tiny

    if smoke:
        return tiny(sliding_window=16)
    return dataclasses.replace(get_preset("deepseek-v4-flash"), num_hidden_layers=4,
                               layer_types=[SLIDING, CSA, HCA, CSA], mlp_layer_types=[HASH_MOE, MOE, MOE, MOE],
                               n_routed_experts=8, num_experts_per_tok=6)


class _FixedBatch:
    """An SFT objective over one fixed packed batch: the loop's step without a data pipeline."""

    def __init__(self, batch, cfg_train, par):
        self.batch, self.cfg_train, self.par = batch, cfg_train, par

    def step(self, model, step, scaler):
        from trex.posttrain.objective import StepResult
        from trex.posttrain.sft import accumulate_gradients

        lm, mtp, aux = accumulate_gradients(model, [self.batch], self.cfg_train, scaler, self.par)
        return StepResult(loss=lm, tokens=self.batch.n_tokens, metrics={"mtp_loss": mtp}, moe_stats=aux.moe_stats)


def measure_step(device: str, dtype: str, seq: int, compiled: bool, steps: int, smoke: bool, backend: str) -> dict:
    """Build the stack on ``device``, run ``steps`` timed training steps after the warm-up (which
    compiles), and return tokens/s, MFU, peak memory and, compiled, the compile time."""
    import torch

    from trex import device as device_layer
    from trex.data import Batch
    from trex.hardware import profile_for_device_name
    from trex.models import build_model
    from trex.models.flops import flops_per_token
    from trex.parallel.mesh import Parallel
    from trex.parallel.plan import apply_compile, cast_for_compute
    from trex.syncs import SyncCounter
    from trex.train.config import TrainSection
    from trex.train.optim import OptimSection, build_optimizer
    from trex.precision import PrecisionPolicy, StepGuard
    from trex.train.step import train_step

    dev = device_layer.detect(device)
    dev.set_current()
    policy = PrecisionPolicy.resolve(dtype, dev)
    cfg = flash_stack(smoke)
    torch.manual_seed(0)
    model = build_model(cfg, device=dev.torch_device, dtype=torch.float32, seed=0).train()
    cast_for_compute(model, policy.compute_dtype)
    if compiled:
        apply_compile(model, backend=backend)  # "eager" (the CPU check): the graphs without code generation
    optimizer = build_optimizer(model, OptimSection(lr=1e-4), dev)
    params = [p for p in model.parameters() if p.requires_grad]
    guard = StepGuard(3)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (1, seq), generator=gen)
    docs = torch.zeros_like(ids)
    docs[0, seq // 3:] = 1  # two packed documents
    batch = Batch(ids, ids.clone(), docs, seq - 2, seq, torch.ones_like(ids, dtype=torch.bool)).to(dev.torch_device)
    objective = _FixedBatch(batch, TrainSection(), Parallel())

    def one(step: int):
        out = train_step(model, objective, optimizer, params, guard, step, grad_clip=1.0, bias_gamma=1e-3,
                         par=Parallel())
        return out.result.loss.item()  # the loop's one read

    t0 = time.perf_counter()
    one(0)
    warm_s = time.perf_counter() - t0
    # host syncs of step 1, eager only: the counter's dispatch modes and compiled graphs do not mix
    syncs = SyncCounter() if not compiled else contextlib.nullcontext()
    with syncs:
        train_step(model, objective, optimizer, params, guard, 1, grad_clip=1.0, bias_gamma=1e-3, par=Parallel())
    dev.synchronize()
    dev.reset_peak_memory()
    times = []
    for step in range(2, 2 + steps):
        t0 = time.perf_counter()
        loss = one(step)
        times.append(time.perf_counter() - t0)
    best = min(times)
    flops = flops_per_token(cfg, seq).total
    short = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}[str(policy.compute_dtype).split(".")[-1]]
    name = device_layer.environment_report(dev).get("device_name", dev.type)
    profile = profile_for_device_name(name) if dev.is_accelerator else None
    peak = profile.peak_flops(short) if profile else None
    result = {"device": name, "dtype": short, "seq": seq, "compiled": compiled, "step_s": best,
              "tokens_per_s": seq / best, "model_tflops_per_s": seq / best * flops / 1e12,
              "mfu": seq / best * flops / peak if peak else None, "peak_flops_source": profile.name if profile else None,
              "peak_memory_gib": dev.max_memory_allocated() / 2**30, "warmup_s": warm_s,
              "syncs_per_step": None if compiled else syncs.count, "loss": loss,
              "params_billion": sum(p.numel() for p in model.parameters()) / 1e9}
    if compiled:
        from torch._dynamo.utils import counters

        result["graphs"] = counters["stats"]["unique_graphs"]
    return result


def step_main(args) -> None:
    results = [measure_step(args.device, args.dtype, args.seq, compiled, args.steps, args.smoke, args.backend)
               for compiled in (False, True)]
    for r in results:
        print(json.dumps(r), flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    tmp = args.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(results, f, indent=1)
    os.replace(tmp, args.out)


def _step_table(results: list[dict]) -> list[str]:
    lines = ["| | tokens/s | model TFLOP/s | MFU | peak memory GiB | warm-up s | graphs | host syncs per step |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        mfu = f"{100 * r['mfu']:.1f}% of {r['peak_flops_source']} {r['dtype']}" if r.get("mfu") else "-"
        lines.append(f"| {'compiled' if r['compiled'] else 'eager'} | {r['tokens_per_s']:.0f} | "
                     f"{r['model_tflops_per_s']:.1f} | {mfu} | {r['peak_memory_gib']:.1f} | {r['warmup_s']:.0f} | "
                     f"{r.get('graphs', '-')} | {'-' if r['syncs_per_step'] is None else r['syncs_per_step']} |")
    return lines


def report_main(args) -> None:
    """Assemble the script's outputs under ``args.dir`` into docs/benchmarks.md (or print them)."""
    d = args.dir
    parts = [f"{MARK_BEGIN}", "## Accelerator check (`bench/accelerator.sh`)", ""]
    env_path = os.path.join(d, "env.json")
    if os.path.exists(env_path):
        env = json.load(open(env_path))
        parts.append(f"Device: {env.get('device_name', env.get('device'))}, torch {env.get('torch')}, "
                     f"backend {env.get('backend')}.")
        parts.append("")
    tests = os.path.join(d, "tests.txt")
    if os.path.exists(tests):
        last = [line for line in open(tests).read().splitlines() if line.strip()][-1:]
        parts += [f"(a) test suite with the device selected: `{last[0] if last else 'no output'}`", ""]
    flex = os.path.join(d, "flex.txt")
    if os.path.exists(flex):
        parts += ["FlexAttention backward against the reference (max abs error, relative):", "", "```",
                  *open(flex).read().strip().splitlines()[-12:], "```", ""]
    step = os.path.join(d, "step.json")
    if os.path.exists(step):
        results = json.load(open(step))
        r0 = results[0]
        parts += [f"(b) V4-Flash-shaped step (hidden 4096, 64 x 512 heads, expert width 2048, vocab 129,280; "
                  f"4 layers, 8 experts top 6; {r0['params_billion']:.2f} B parameters), {r0['dtype']}, S = "
                  f"{r0['seq']}, batch 1, Muon + AdamW, the fastest of the timed steps:", "", *_step_table(results), ""]
    for name, what in (("fidelity.txt", "device bf16 vs the CPU fp32 golden file"),
                       ("fidelity-same-precision.txt", "device bf16 vs CPU bf16 (the device alone)")):
        path = os.path.join(d, name)
        if os.path.exists(path):
            parts += [f"(c) `recipes/fidelity_default.toml`, {what}, profile `vendor`:", "", "```",
                      *open(path).read().strip().splitlines()[-30:], "```", ""]
    parts.append(MARK_END)
    section = "\n".join(parts)
    if not args.write:
        print(section)
        return
    path = os.path.join(ROOT, "docs", "benchmarks.md")
    doc = open(path).read()
    if MARK_BEGIN in doc:
        doc = doc[: doc.index(MARK_BEGIN)] + section + doc[doc.index(MARK_END) + len(MARK_END):]
    else:
        doc = doc.rstrip("\n") + "\n\n" + section + "\n"
    with open(path + ".tmp", "w") as f:
        f.write(doc)
    os.replace(path + ".tmp", path)
    print(section)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    step = sub.add_parser("step", help="eager vs compiled training step on one device")
    step.add_argument("--device", default="")
    step.add_argument("--dtype", default="bf16")
    step.add_argument("--seq", type=int, default=4096)
    step.add_argument("--steps", type=int, default=3)
    step.add_argument("--smoke", action="store_true", help="the tiny preset (CPU check of the script)")
    step.add_argument("--backend", default="inductor", help="torch.compile backend (eager: no code generation)")
    step.add_argument("--out", required=True)
    report = sub.add_parser("report", help="write the figures of a bench/accelerator.sh output folder")
    report.add_argument("dir")
    report.add_argument("--write", action="store_true", help="put the figures into docs/benchmarks.md (default: print them)")
    args = parser.parse_args()
    sys.path.insert(0, os.path.join(ROOT, "src"))
    (step_main if args.cmd == "step" else report_main)(args)


if __name__ == "__main__":
    main()
