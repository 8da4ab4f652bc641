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
    from trex.models.common.config import HASH_MOE, MOE
    from trex.models.deepseek_v4.config import CSA, HCA, SLIDING, get_preset, tiny

    if smoke:
        return tiny(sliding_window=16)
    return dataclasses.replace(get_preset("deepseek-v4-flash"), num_hidden_layers=4,
                               layer_types=[SLIDING, CSA, HCA, CSA], mlp_layer_types=[HASH_MOE, MOE, MOE, MOE],
                               n_routed_experts=8, num_experts_per_tok=6)


def measure_step(device: str, dtype: str, seq: int, compiled: bool, steps: int, smoke: bool, backend: str) -> dict:
    """Build the stack on ``device``, run ``steps`` timed training steps after the warm-up (which
    compiles), and return tokens/s, MFU, peak memory and, compiled, the compile time."""
    import torch

    from trex import device as device_layer
    from trex import kernels
    from trex.hardware import profile_for_device_name
    from trex.models import build_model
    from trex.models.flops import flops_per_token
    from trex.parallel.mesh import Parallel
    from trex.parallel.plan import apply_compile, cast_for_compute
    from trex.precision import PrecisionPolicy, StepGuard
    from trex.profile.meta import FixedBatches, packed_batch
    from trex.syncs import SyncCounter
    from trex.train.config import TrainSection
    from trex.train.optim import OptimSection, build_optimizer
    from trex.train.step import train_step

    dev = device_layer.detect(device)
    dev.set_current()
    kernels.prepare(dev.type)
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
    objective = FixedBatches([packed_batch(cfg.vocab_size, 1, seq, dev.torch_device)], TrainSection(), Parallel())

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


def _write_json(path: str, obj) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(path + ".tmp", path)


def step_main(args) -> None:
    """The step in each of ``--forms``; ``--out`` rewritten after each (a time limit keeps what ran)."""
    results = []
    for form in args.forms.split(","):
        if form not in ("eager", "compiled"):
            raise SystemExit(f"--forms {args.forms}: expected eager and/or compiled")
        results.append(measure_step(args.device, args.dtype, args.seq, form == "compiled", args.steps, args.smoke,
                                    args.backend))
        print(json.dumps(results[-1]), flush=True)
        _write_json(args.out, results)


def profile_table(args) -> None:
    """A device's `trex profile --format json` report as text, with each class measured against the
    roofline estimate of the same ops on the device's own hardware profile (estimated / measured)."""
    sys.path.insert(0, os.path.join(ROOT, "src"))
    from trex.hardware import profile_for_device_name
    from trex.profile.report import format_report

    r = json.load(open(args.report))
    print(format_report(r))
    env = json.load(open(os.path.join(os.path.dirname(os.path.abspath(args.report)), "env.json"))) \
        if os.path.exists(os.path.join(os.path.dirname(os.path.abspath(args.report)), "env.json")) else {}
    hw = profile_for_device_name(str(env.get("device_name", r["device"])))
    est = next((e for e in r.get("estimates", []) if hw and e["hardware"] == hw.name), None)
    if est is None:
        print("\nno hardware profile matches this device: no estimate against the measurement")
        return
    print(f"\nestimate (eager) on {hw.name} against the measurement, per class:\n")
    print(f"{'class':<20} {'measured ms':>12} {'estimated ms':>13} {'est / meas':>11}")
    for c in r["classes"]:
        e = est["classes"].get(c["class"])
        if e:
            print(f"{c['class']:<20} {c['time_s'] * 1e3:>12.2f} {e['eager_s'] * 1e3:>13.2f} "
                  f"{e['eager_s'] / c['time_s'] if c['time_s'] else float('nan'):>11.2f}")
    print(f"{'step':<20} {r['step_s'] * 1e3:>12.2f} {est['eager_s'] * 1e3:>13.2f} {est['eager_s'] / r['step_s']:>11.2f}")


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
    parts_json = os.path.join(d, "parts.json")
    if os.path.exists(parts_json):
        rows = json.load(open(parts_json))
        parts += ["Parts (bench/accelerator.sh, in the order they ran; time in seconds of the script's budget):", "",
                  "| part | status | s | limit s |", "|---|---|---|---|",
                  *(f"| {p['part']} | {p['status']} | {p['seconds']} | {p.get('limit', '-')} |" for p in rows), ""]
    results = [r for name in ("step-eager.json", "step-compiled.json", "step.json")
               if os.path.exists(os.path.join(d, name)) for r in json.load(open(os.path.join(d, name)))]
    if results:
        r0 = results[0]
        parts += [f"(1) V4-Flash-shaped step (hidden 4096, 64 x 512 heads, expert width 2048, vocab 129,280; "
                  f"4 layers, 8 experts top 6; {r0['params_billion']:.2f} B parameters), {r0['dtype']}, S = "
                  f"{r0['seq']}, batch 1, Muon + AdamW, the fastest of the timed steps:", "", *_step_table(results), ""]
    for name, what in (("profile.txt", "(2) `trex profile` of that step on the device, eager, and the estimate of "
                                       "the same ops on the device's hardware profile"),
                       ("fidelity-eager.txt", "(3) `recipes/fidelity_default.toml`, device bf16 vs CPU bf16, eager, "
                                              "profile `vendor`"),
                       ("tests.txt", "(4) the device's tests (TREX_DEVICE set)"),
                       ("flex.txt", "(4) FlexAttention backward against the reference (max abs error, relative)"),
                       ("fidelity-compiled.txt", "(7) the fidelity recipe compiled, device bf16 vs CPU bf16 "
                                                 "(eager), profile `vendor`")):
        path = os.path.join(d, name)
        if os.path.exists(path):
            lines = open(path).read().strip().splitlines()
            parts += [f"{what}:", "", "```", *(lines[-45:] if name != "tests.txt" else lines[-3:]), "```", ""]
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
    step.add_argument("--forms", default="eager,compiled", help="eager, compiled or both (default: %(default)s)")
    step.add_argument("--out", required=True)
    table = sub.add_parser("profile-table", help="a device's trex profile JSON against its own estimate")
    table.add_argument("report")
    report = sub.add_parser("report", help="write the figures of a bench/accelerator.sh output folder")
    report.add_argument("dir")
    report.add_argument("--write", action="store_true", help="put the figures into docs/benchmarks.md (default: print them)")
    args = parser.parse_args()
    sys.path.insert(0, os.path.join(ROOT, "src"))
    {"step": step_main, "report": report_main, "profile-table": profile_table}[args.cmd](args)


if __name__ == "__main__":
    main()
