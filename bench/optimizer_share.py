"""What a post-training step spends besides the model: the optimizer step (Muon's Newton-Schulz, AdamW)
against forward + backward, at batch 1 and at the tokens a post-training run takes per optimizer step
(0.5 - 4 M: gradient accumulation runs the forward and backward accum times, the optimizer once).

(a) Measured on the CPU at bench/model_step.py's narrow V4 shape (its BENCH_CONFIG): forward + backward
    of one micro-batch of S tokens, and one step of MuonAdamW with fp32 and with bf16 Newton-Schulz
    iterations and of AdamW alone; the optimizer's share at accumulation a is opt / (a * fb + opt).
(b) Computed at released sizes (the V4-Flash, V4-Pro and V3 presets, built on the meta device): the
    Newton-Schulz FLOPs of one step (trex.train.optim.ns_flops over every Muon matrix) against the model's
    training FLOPs (trex.models.flops at S = 4096) for the tokens of one step, per rank on R ranks, when
    every rank orthogonalises every matrix, when experts are local but other matrices redundant, and
    owner-only (trex's MuonAdamW: each matrix on one rank of its FSDP group, experts where they live).

    .venv/bin/python bench/optimizer_share.py --write
    .venv/bin/python bench/optimizer_share.py --seq 256 --steps 2 --presets deepseek-v4-flash   # printed only
"""

from __future__ import annotations

import argparse
import heapq
import os
import platform
import time

from model_step import BENCH_CONFIG, CONFIG_LINES, report

MARKS = ("<!-- optimizer-share-bench:begin -->", "<!-- optimizer-share-bench:end -->")
TOKENS_PER_STEP = (500_000, 1_000_000, 2_000_000, 4_000_000)
PRESETS = ("deepseek-v4-flash", "deepseek-v4-pro", "deepseek-v3")
SEQ_FLOPS = 4096  # the sequence length the model FLOPs per token are counted at (computed part)


def _fastest(fn, steps: int) -> float:
    fn()  # warm-up: allocates optimizer state, first-touch pages
    best = float("inf")
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _share(opt_s: float, fb_s: float, accum: float) -> str:
    return _pct(opt_s / (accum * fb_s + opt_s))


def _pct(x: float) -> str:
    return f"{100 * x:.3g}%"


def measured(seq: int, steps: int, threads: int) -> list[str]:
    import torch

    torch.set_num_threads(threads)  # 2 threads on 2 cores shared with other processes stall each other (seconds)
    from hf_oracle import hf_config

    from trex.models import build_model
    from trex.models.flops import flops_per_token
    from trex.models.registry import config_from_dict
    from trex.train.optim import OptimSection, build_optimizer, classify, ns_flops, orthogonalized_update

    cfg = config_from_dict(hf_config(**BENCH_CONFIG).to_dict())
    model = build_model(cfg, seed=0).train()
    ids = torch.randint(0, cfg.vocab_size, (1, seq), generator=torch.Generator().manual_seed(0))

    def forward_backward():
        model.zero_grad(set_to_none=True)
        model(ids, labels=ids).loss.backward()

    fb_s = _fastest(forward_backward, steps)
    section = OptimSection()
    iterations = sum(section.ns_iterations)
    ns = sum(ns_flops(p.shape, blocks, iterations) for _, p, rule, blocks in classify(model) if rule.muon)
    rows = []
    optimizers = (("Muon, NS fp32", OptimSection(ns_dtype="fp32")), ("Muon, NS bf16", OptimSection(ns_dtype="bf16")),
                  ("AdamW", OptimSection(name="adamw")))
    for label, opt_cfg in optimizers:
        opt_s = _fastest(build_optimizer(model, opt_cfg).step, steps)
        per_s = f"{ns / opt_s / 1e9:.1f}" if opt_cfg.name == "muon" else "-"
        rows.append(f"| {label} | {1e3 * opt_s:.1f} | {per_s} | {_share(opt_s, fb_s, 1)} | "
                    + " | ".join(_share(opt_s, fb_s, t / seq) for t in TOKENS_PER_STEP) + " |")
    fpt = flops_per_token(cfg, seq).total
    n_muon = sum(1 for *_, rule, _ in classify(model) if rule.muon)
    lines = [
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, fp32 parameters; time = the fastest of {steps} after a warm-up.",
        CONFIG_LINES["v4"] + f" {n_muon} Muon tensors, {ns / 1e9:.2f} GFLOP of Newton-Schulz per step (10 iterations).",
        "",
        f"Forward + backward of one micro-batch (batch 1, S = {seq}): {1e3 * fb_s:.0f} ms, {seq / fb_s:.0f} tokens/s, "
        f"{fpt * seq / fb_s / 1e9:.1f} GFLOP/s of model FLOPs.",
        "",
        "| optimizer step | ms | NS GFLOP/s | share at batch 1 | " + " | ".join(
            f"{t / 1e6:g} M tokens ({t // seq} micro-batches)" for t in TOKENS_PER_STEP) + " |",
        "|---|---|---|---|" + "---|" * len(TOKENS_PER_STEP),
        *rows,
    ]
    departures = []  # bf16 against fp32 iterations, each Muon tensor's update from its gradient as direction
    for _, p, rule, blocks in classify(model):
        if rule.muon and p.grad is not None:
            u32, u16 = (orthogonalized_update(p.grad, blocks, section.update_rms, section.ns_schedule(), dtype)
                        for dtype in (torch.float32, torch.bfloat16))
            departures.append(((u16 - u32).norm() / u32.norm()).item())
    lines += ["", f"bf16 iterations against fp32 (each Muon tensor's update, its gradient as direction): relative "
              f"Frobenius departure {min(departures):.2%} to {max(departures):.2%}, median "
              f"{sorted(departures)[len(departures) // 2]:.2%}."]
    return lines


def _lpt_max(costs: list[int], bins: int) -> int:
    """The most loaded of ``bins`` owners after MuonAdamW.owners' rule (largest first, to the least loaded)."""
    heap = [0] * bins
    for c in sorted(costs, reverse=True):
        heapq.heapreplace(heap, heap[0] + c)
    return max(heap)


def computed(presets: list[str], ranks: int, ratio: float) -> list[str]:
    from trex.models import build_model, get_preset
    from trex.models.flops import flops_per_token
    from trex.models.params import count_parameters
    from trex.train.optim import OptimSection, classify, ns_flops

    iterations = sum(OptimSection().ns_iterations)
    summary = []
    lines = [
        f"Per optimizer step, per rank on {ranks} ranks (FSDP over all of them, data split evenly). Model FLOPs: "
        f"trex.models.flops at S = {SEQ_FLOPS} (training, x3), MTP included; Newton-Schulz: {iterations} iterations "
        "of 4 n^2 m + 2 n^3 on every Muon matrix (n <= m), MTP included. Share = NS / (model + NS), both at the "
        f"same rate; fp32 iterations run at the fp32 peak, {ratio:.1f}x slower than bf16 on an H200 (h200-sxm "
        "profile), so their time share is that of ratio x NS.",
        "",
        "| model | active params | Muon matrices | NS TFLOP / step | model TFLOP / M tokens | tokens / step "
        "| every rank all matrices | dense redundant, experts local | owner-only (trex) | owner-only, fp32 NS time |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in presets:
        cfg = get_preset(name)
        model = build_model(cfg, device="meta")
        dense, experts, matrices = [], 0, 0
        for _, p, rule, blocks in classify(model):
            if not rule.muon:
                continue
            cost = ns_flops(p.shape, blocks, iterations)
            matrices += (p.shape[0] if p.dim() == 3 else 1) * max(1, len(blocks))
            if p.dim() == 3:
                experts += cost
            else:
                dense.append(cost)
        total = sum(dense) + experts
        schemes = (total, sum(dense) + experts / ranks, _lpt_max(dense, ranks) + experts / ranks)
        per_token = flops_per_token(cfg, SEQ_FLOPS).total
        active = count_parameters(cfg).active
        for i, tokens in enumerate(TOKENS_PER_STEP):
            model_rank = per_token * tokens / ranks
            shares = [_pct(ns / (model_rank + ns)) for ns in schemes]
            shares.append(_pct(ratio * schemes[2] / (model_rank + ratio * schemes[2])))
            head = (f"{name} | {active / 1e9:.1f} B | {matrices} | {total / 1e12:.0f} | {per_token * 1e6 / 1e12:.0f}"
                    if i == 0 else " | | | |")
            lines.append(f"| {head} | {tokens / 1e6:g} M | " + " | ".join(shares) + " |")
            if tokens == 1_000_000:
                summary.append(f"{name} {shares[2]} ({shares[0]} when every rank does every matrix)")
    lines += ["", "At 1 M tokens per step, owner-only: " + "; ".join(summary) + ". Owner-only, the share is what one "
              "device running the whole model would spend, NS / (FLOPs per token x tokens + NS): it does not grow with "
              "the ranks and halves with each doubling of the tokens per step. Redundant, each rank's model work "
              "shrinks as 1 / R while its Newton-Schulz stays, so the share grows with the ranks toward 100%. Most "
              "of what is left is the routed experts: every expert is orthogonalised every step, at 4 n^2 m + 2 n^3 "
              "per iteration, while its forward and backward see only k / E of the tokens."]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=2048, help="micro-batch length of the measured part")
    parser.add_argument("--steps", type=int, default=3, help="timed repetitions (the fastest counts)")
    parser.add_argument("--threads", type=int, default=1, help="compute threads of the measured part")
    parser.add_argument("--ranks", type=int, default=1024, help="ranks of the computed part")
    parser.add_argument("--presets", nargs="+", default=list(PRESETS))
    parser.add_argument("--write", action="store_true", help="put the tables into docs/benchmarks.md (default: print)")
    args = parser.parse_args()
    from trex.hardware import load_profiles

    h200 = load_profiles()["h200-sxm"].peak_tflops
    lines = ["## Optimizer share of a post-training step",
             "",
             "Command: `.venv/bin/python bench/optimizer_share.py --write`",
             "",
             "A post-training run takes one optimizer step per 0.5 - 4 M tokens: the forward and backward run "
             "once per micro-batch, the optimizer once per step, so the optimizer's share falls as 1 / accum. "
             "What it costs per step is Muon's Newton-Schulz iterations on every matrix; AdamW (and the fp32 "
             "masters' copy) is elementwise and small.",
             "",
             "### Measured on the CPU",
             "",
             *measured(args.seq, args.steps, args.threads),
             "",
             "### Computed at released sizes",
             "",
             *computed(args.presets, args.ranks, h200["bf16"] / h200["fp32"])]
    report(*MARKS, lines, args.write)


if __name__ == "__main__":
    main()
