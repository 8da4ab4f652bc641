"""One training step (forward + backward + AdamW) of trex vs transformers' DeepseekV4ForCausalLM and
DeepseekV3ForCausalLM, and trex eager vs trex compiled (trex.parallel.plan.apply_compile: each block,
the mHC head and the fused LM head + loss).

Same tiny config, same weights, CPU, fp32, batch 1, at several sequence lengths. Each
(implementation, length) runs in a fresh subprocess so peak memory (Linux VmHWM) is its own. For
trex it also counts the host syncs of one step (trex.syncs.SyncCounter) and, compiled, the graphs
torch.compile built. Prints markdown tables; --write puts them between markers in docs/benchmarks.md.

    .venv/bin/python bench/model_step.py --write         # V4 and V3, S = 512 ... 8192, compiled at 512/2048/4096
    .venv/bin/python bench/model_step.py --family v3 --seqs 512 1024 2048 4096 --compiled-seqs --write
    .venv/bin/python bench/model_step.py --seqs 256 --compiled-seqs 256   # printed only
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

S_, C_, H_ = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
# V4 proportions at toy width: query heads x head_dim = 8 x hidden (Flash: 64 x 512 = 8 x 4096).
BENCH_CONFIG = dict(
    vocab_size=1024, hidden_size=128, num_hidden_layers=4, num_attention_heads=8, head_dim=128,
    partial_rotary_factor=0.25, q_lora_rank=128, o_groups=4, o_lora_rank=64, sliding_window=128,
    layer_types=[S_, C_, H_, C_], compress_rates={C_: 4, H_: 128},
    mlp_layer_types=["hash_moe", "moe", "moe", "moe"], index_n_heads=4, index_head_dim=32, index_topk=64,
    n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=128, hc_mult=4,
    max_position_embeddings=16384, num_nextn_predict_layers=0,
    rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096,
                  "beta_fast": 32, "beta_slow": 1},
)
# V3 proportions at toy width: MLA with a latent of hidden/2 + a rope key of 32, 8 heads of 64 + 32 (query/key)
# and 64 (value), a dense first layer, 8 experts in 4 groups (top 2 groups) top-2, YaRN with mscale
BENCH_V3_CONFIG = dict(
    vocab_size=1024, hidden_size=128, intermediate_size=256, moe_intermediate_size=128, num_hidden_layers=4,
    num_attention_heads=8, q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=64, qk_rope_head_dim=32,
    v_head_dim=64, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=4, topk_group=2,
    first_k_dense_replace=1, routed_scaling_factor=2.5, num_nextn_predict_layers=0,
    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 4096,
                     "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
)
# transformers materialises [S, S + S/m] scores per layer; above this it would not fit in 24 GiB.
REFERENCE_MAX_SEQ = 4096
MARKS = {"v4": ("<!-- model-step-bench:begin -->", "<!-- model-step-bench:end -->"),
         "v3": ("<!-- model-step-v3-bench:begin -->", "<!-- model-step-v3-bench:end -->")}
MARK_BEGIN, MARK_END = MARKS["v4"]


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(field)


def run_one(impl: str, seq: int, ckpt: str, steps: int, family: str = "v4") -> dict:
    """Runs in a subprocess: load, warm up (compiling, for trex-compiled), time `steps` training steps,
    report peak memory, and for trex the host syncs of one step and the compiled graphs."""
    import torch

    torch.manual_seed(0)
    if impl.startswith("trex"):
        from trex.checkpoint import load_pretrained

        model = load_pretrained(ckpt, dtype=torch.float32, device="cpu")
        if impl == "trex-compiled":
            from trex.parallel.plan import apply_compile

            apply_compile(model)
    else:
        from transformers import DeepseekV3ForCausalLM, DeepseekV4ForCausalLM

        reference = DeepseekV3ForCausalLM if family == "v3" else DeepseekV4ForCausalLM
        model = reference.from_pretrained(ckpt, dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 1024, (1, seq))  # both families' vocab

    def forward_backward():
        loss = model(ids, labels=ids).loss
        loss.backward()
        return loss

    def step():
        loss = forward_backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    t_warm = time.perf_counter()
    step().item()  # warm-up (allocates optimizer state; compiles)
    warm_s = time.perf_counter() - t_warm
    extra = {}
    if impl == "trex":
        from trex.syncs import SyncCounter

        with SyncCounter() as syncs:  # the model's forward + backward (torch's AdamW reads its step count)
            forward_backward()
        opt.zero_grad(set_to_none=True)
        extra["syncs_per_step"] = syncs.count
    if impl == "trex-compiled":
        from torch._dynamo.utils import counters

        extra.update(graphs=counters["stats"]["unique_graphs"], compile_s=warm_s)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak to the current resident set
    base = _status_kib("VmRSS")
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step().item()
        times.append(time.perf_counter() - t0)
    peak = _status_kib("VmHWM")
    return {"impl": impl, "seq": seq, "step_s": min(times), "tokens_per_s": seq / min(times),
            "peak_step_bytes": (peak - base) * 1024, **extra}


def measure(impl: str, seq: int, ckpt: str, steps: int, family: str = "v4") -> dict:
    cmd = [sys.executable, __file__, "--child", impl, str(seq), ckpt, str(steps), family]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        return {"impl": impl, "seq": seq, "error": proc.stderr.strip().splitlines()[-1] if proc.stderr else "failed"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


CONFIG_LINES = {
    "v4": "Config: hidden 128, 4 layers (sliding, CSA, HCA, CSA), 8 heads x 128 (V4's heads x head_dim = 8 x hidden), "
          "window 128, CSA m=4 top-64, HCA m=128, 8 experts top-2, hc_mult 4, vocab 1024.",
    "v3": "Config: hidden 128, 4 layers (1 dense, 3 MoE), MLA with q/kv latents of 64 and 8 heads of 64 + 32 rope "
          "(value 64), 8 experts in 4 groups (top 2 groups) top-2 + 1 shared, YaRN 4x, vocab 1024.",
}


def table(results: dict, seqs: list[int], steps: int, family: str = "v4") -> str:
    import torch

    lines = [
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch "
        f"{torch.__version__}, {torch.get_num_threads()} threads, fp32, batch 1, AdamW step included; "
        f"time = the fastest of {steps} steps after one warm-up step.",
        CONFIG_LINES[family] + " Peak = resident-set growth during a step.",
        "",
        "| S | trex tok/s | reference tok/s | speed ratio | trex peak MiB | reference peak MiB | memory ratio "
        "| trex s/token vs S=1024 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    base = results.get(("trex", 1024), {}).get("step_s")
    for s in seqs:
        t, r = results.get(("trex", s), {}), results.get(("hf", s), {})
        per_tok = f"{(t['step_s'] / s) / (base / 1024):.2f}x" if base and "step_s" in t else "-"
        speed = f"{t['tokens_per_s'] / r['tokens_per_s']:.1f}x" if "tokens_per_s" in r and "tokens_per_s" in t else "-"
        mem = (f"{r['peak_step_bytes'] / max(t['peak_step_bytes'], 1):.1f}x less"
               if "peak_step_bytes" in r and "peak_step_bytes" in t else "-")
        ref_tok = f"{r['tokens_per_s']:.0f}" if "tokens_per_s" in r else r.get("error", "not run (does not fit)")
        ref_mem = f"{r['peak_step_bytes'] / 2**20:.0f}" if "peak_step_bytes" in r else "-"
        lines.append(f"| {s} | {t.get('tokens_per_s', 0):.0f} | {ref_tok} | {speed} | "
                     f"{t.get('peak_step_bytes', 0) / 2**20:.0f} | {ref_mem} | {mem} | {per_tok} |")
    return "\n".join(lines)


def compiled_table(results: dict, seqs: list[int]) -> str:
    lines = [
        "Same config and machine, the same run. Compiled: torch.compile (Inductor) of each block, the mHC "
        "head and the fused LM head + loss; compile time is the warm-up step's. Syncs: host reads in one eager "
        "forward + backward, counted by trex.syncs.SyncCounter (the whole trex step, its optimizer included, "
        "is counted by tests/test_syncs.py).",
        "",
        "| S | eager tok/s | compiled tok/s | compiled / eager | eager peak MiB | compiled peak MiB | graphs "
        "| compile s | host syncs, forward + backward |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for s in seqs:
        e, c = results.get(("trex", s), {}), results.get(("trex-compiled", s), {})
        if "tokens_per_s" not in e or "tokens_per_s" not in c:
            lines.append(f"| {s} | {e.get('tokens_per_s', 0):.0f} | {c.get('error', '-')} | - | - | - | - | - | "
                         f"{e.get('syncs_per_step', '-')} |")
            continue
        lines.append(f"| {s} | {e['tokens_per_s']:.0f} | {c['tokens_per_s']:.0f} | "
                     f"{c['tokens_per_s'] / e['tokens_per_s']:.2f}x | {e['peak_step_bytes'] / 2**20:.0f} | "
                     f"{c['peak_step_bytes'] / 2**20:.0f} | {c['graphs']} | {c['compile_s']:.0f} | "
                     f"{e['syncs_per_step']} |")
    return "\n".join(lines)


def write_section(text: str, family: str = "v4") -> None:
    if family == "v3":
        write_docs_section(*MARKS["v3"], "## Model training step, DeepSeek-V3: trex vs transformers (CPU)\n\n"
                           "Command: `.venv/bin/python bench/model_step.py --family v3 --seqs 512 1024 2048 4096 "
                           f"--compiled-seqs --write`\n\n{text}")
        return
    targets = ("Targets (issue: foundation): >= 10x the reference's tokens/s at S=4096, not slower at S=512, "
               "time per token at S=8192 within 1.5x of S=1024, peak memory at S=4096 <= 1/4 of the reference.")
    write_docs_section(MARK_BEGIN, MARK_END, "## Model training step: trex vs transformers (CPU)\n\n"
                       f"Command: `.venv/bin/python bench/model_step.py`\n\n{text}\n\n{targets}")


def report(begin: str, end: str, lines: list[str], write: bool) -> None:
    """Print a benchmark's markdown ``lines``; with ``write`` also put them in docs/benchmarks.md."""
    body = "\n".join(lines)
    print(body)
    if write:
        write_docs_section(begin, end, body)


def run_on_ranks(ranks: int, argv: list[str], what: str) -> None:
    """Run ``argv`` (a script and its arguments) in one process (``ranks`` 1) or under torchrun on ``ranks``
    processes (a free port), one thread each, from the repository root; a failure is a SystemExit naming ``what``
    with the end of its stderr."""
    import socket
    import subprocess

    if ranks == 1:
        cmd = [sys.executable, *argv]
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}", f"--master-port={port}",
               *argv]
    proc = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{what} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")


def write_docs_section(begin: str, end: str, body: str) -> None:
    """Put ``body`` between the markers ``begin`` and ``end`` of docs/benchmarks.md (appended the first
    time), written atomically."""
    from trex.atomic import write_text

    path = os.path.join(ROOT, "docs", "benchmarks.md")
    doc = open(path).read() if os.path.exists(path) else "# Benchmarks\n"
    section = f"{begin}\n{body}\n{end}"
    if begin in doc:
        doc = doc[: doc.index(begin)] + section + doc[doc.index(end) + len(end):]
    else:
        doc = doc.rstrip("\n") + "\n\n" + section + "\n"
    write_text(path, doc)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seqs", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192])
    parser.add_argument("--compiled-seqs", type=int, nargs="*", default=[512, 2048, 4096])
    # steady state: the first steps of a fresh process page-fault their freshly mapped tensors (glibc
    # raises its mmap threshold as blocks are freed); the minimum over 4 timed steps, for both models
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--write", action="store_true", help="put the tables into docs/benchmarks.md (default: print)")
    parser.add_argument("--family", choices=("v4", "v3", "both"), default="both",
                        help="DeepSeek-V4 (against DeepseekV4ForCausalLM), V3 (against DeepseekV3ForCausalLM) or both "
                             "(default: %(default)s)")
    parser.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        impl, seq, ckpt, steps, family = args.child
        print(json.dumps(run_one(impl, int(seq), ckpt, int(steps), family)))
        return
    for family in ("v4", "v3") if args.family == "both" else (args.family,):
        text = bench_family(family, args.seqs, args.compiled_seqs, args.steps)
        print(text)
        if args.write:
            write_section(text, family)


def bench_family(family: str, seqs: list[int], compiled_seqs: list[int], steps: int) -> str:
    """The tables of one family: trex vs transformers over ``seqs``, eager vs compiled over ``compiled_seqs``."""
    if family == "v3":
        from hf_oracle_v3 import hf_config, random_hf_model
        config = BENCH_V3_CONFIG
    else:
        from hf_oracle import hf_config, random_hf_model
        config = BENCH_CONFIG
    with tempfile.TemporaryDirectory() as ckpt:
        random_hf_model(hf_config(**config), seed=0).save_pretrained(ckpt)
        results = {}
        for seq in sorted(set(seqs) | set(compiled_seqs)):
            for impl in ("trex", "trex-compiled", "hf"):
                if (impl == "hf" and (seq > REFERENCE_MAX_SEQ or seq not in seqs)
                        or impl == "trex-compiled" and seq not in compiled_seqs):
                    continue
                results[(impl, seq)] = r = measure(impl, seq, ckpt, steps, family)
                print(json.dumps({"family": family, **r}), flush=True)
    text = table(results, seqs, steps, family)
    if compiled_seqs:
        text += "\n\n### Eager vs compiled\n\n" + compiled_table(results, compiled_seqs)
    return text


if __name__ == "__main__":
    main()
