"""How a ``[drafter]`` re-fit step's time and memory grow with the prompt and the continuation, against the
main SFT step of the same model on rows of the same length (the reference, measured in the same run).

Both drafters (trex.train.drafter_refit): DeepSeek-V4.1's DSpark stages (the target continues the prompts
through its decode cache, one step per new token, then the stages draft every anchor's block) and DeepSeek-V4's
MTP module (the same continuation, then one teacher-forced forward of the whole model with only the module
trained). Each measurement is a process of its own: the fastest of 3 steps after a warm-up one, and the
growth of the resident set during them (the peak, reset before the steps). Rows: ``--rows`` prompts per
step, each prompt P tokens continued G; the main step trains on the same number of rows of P + G tokens.

    .venv/bin/python bench/drafter_refit.py --write
    .venv/bin/python bench/drafter_refit.py --prompts 64 --new 16      # one point, printed only
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from model_step import _status_kib, report  # noqa: E402

MARK_BEGIN, MARK_END = "<!-- drafter-refit-bench:begin -->", "<!-- drafter-refit-bench:end -->"
VOCAB = 1024


def _model(kind: str):
    import torch

    from trex.models.build import build_model

    if kind == "mtp":
        from trex.models.deepseek_v4.config import tiny

        cfg = tiny(vocab_size=VOCAB, hidden_size=128, num_nextn_predict_layers=1)
    else:
        from trex.models.deepseek_v4.config_v41 import tiny_v41

        cfg = tiny_v41(vocab_size=VOCAB, num_nextn_predict_layers=2, dspark_target_layer_ids=[4, 5],
                       dspark_block_size=3, dspark_markov_rank=16, dspark_n_routed_experts=4,
                       dspark_num_experts_per_tok=2, dspark_noise_token_id=3, engram_compressed_vocab_size=VOCAB,
                       hc_sinkhorn_iters=3)
    torch.manual_seed(0)
    model = build_model(cfg, device="cpu")
    model.init_weights(0)
    if kind == "dspark":
        model.set_engram_token_map(list(range(VOCAB)), VOCAB)
    return model


def _timed(step, steps: int) -> tuple[float, int]:
    """(the fastest of ``steps`` calls of ``step`` after a warm-up one, the resident set's growth in bytes)."""
    step()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak to the current resident set
    base, times = _status_kib("VmRSS"), []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return min(times), (_status_kib("VmHWM") - base) * 1024


def run_one(kind: str, what: str, prompt: int, new: int, rows: int, steps: int) -> dict:
    """Runs in a subprocess: one (drafter, step kind, P, G) point."""
    import torch

    from trex import device as device_layer
    from trex.checkpoint.training import CheckpointSection
    from trex.parallel.mesh import Parallel
    from trex.train.drafter_refit import DrafterRefit, DrafterSection, trainable
    from trex.train.drafters.mtp import MTPDrafter

    torch.set_num_threads(1)
    model = _model(kind)
    gen = torch.Generator().manual_seed(0)
    if what == "main":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        ids = torch.randint(4, VOCAB, (rows, prompt + new), generator=gen)

        def step():
            out = model(ids, labels=ids)
            (out.loss + 0.1 * out.mtp_loss if out.mtp_loss is not None else out.loss).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    else:
        from trex.models.common.heads import init_parameters
        from trex.models.deepseek_v4.dspark import DSparkDrafter

        if kind == "mtp":
            drafter = MTPDrafter(model)
        else:
            drafter = DSparkDrafter(model.cfg)
            init_parameters(drafter, model.cfg.initializer_range, 0)
        prompts = torch.randint(4, VOCAB, (2 * rows, prompt), generator=gen).tolist()
        section = DrafterSection(enabled=True, steps=steps + 1, new_tokens=new, prompts_per_step=rows, held_out=1)
        refit = DrafterRefit(section, drafter, prompts + [prompts[0]], Parallel(), device_layer.detect("cpu"), 0, (),
                             CheckpointSection(), tempfile.mkdtemp())
        model.requires_grad_(False)
        k = iter(range(steps + 1))

        def step():
            with trainable(refit.params):
                refit._step(model, next(k))["loss"].item()
    step_s, peak = _timed(step, steps)
    return {"kind": kind, "what": what, "prompt": prompt, "new": new, "step_s": step_s, "peak_bytes": peak}


def measure(kind: str, what: str, prompt: int, new: int, rows: int, steps: int) -> dict:
    cmd = [sys.executable, __file__, "--child", json.dumps([kind, what, prompt, new, rows, steps])]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode != 0:
        raise SystemExit(f"{kind} {what} P={prompt} G={new}: {proc.stderr.strip().splitlines()[-1]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def table(results: list[dict], rows: int, steps: int) -> list[str]:
    import torch

    lines = ["## Drafter re-fit step against the main step (bench/drafter_refit.py)", "",
             f"Command: `.venv/bin/python bench/drafter_refit.py --write`", "",
             f"Machine: {os.uname().machine}, {os.cpu_count()} cores, torch {torch.__version__}, one thread, fp32; "
             f"{rows} prompts per step; time = the fastest of {steps} steps after a warm-up; memory = the resident "
             "set's growth during them. DSpark: tiny V4.1 (hidden 64, 2 stages, blocks of 3); MTP: tiny V4 (hidden "
             f"128, one module); vocabulary {VOCAB}. Main step: SFT (+ MTP loss) on rows of P + G tokens.", "",
             "| drafter | prompt P | new G | re-fit step s | main step s | time ratio | re-fit MiB | main MiB | "
             "memory ratio |", "|---|---|---|---|---|---|---|---|---|"]
    by = {(r["kind"], r["what"], r["prompt"], r["new"]): r for r in results}
    for kind, _, prompt, new in sorted({(r["kind"], "", r["prompt"], r["new"]) for r in results}):
        a, m = by[(kind, "refit", prompt, new)], by[(kind, "main", prompt, new)]
        lines.append(f"| {kind} | {prompt} | {new} | {a['step_s']:.3f} | {m['step_s']:.3f} | "
                     f"{a['step_s'] / m['step_s']:.2f} | {a['peak_bytes'] / 2**20:.0f} | {m['peak_bytes'] / 2**20:.0f} | "
                     f"{a['peak_bytes'] / max(m['peak_bytes'], 1):.2f} |")
    return lines


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        print(json.dumps(run_one(*json.loads(sys.argv[2]))))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kinds", nargs="+", default=["dspark", "mtp"], choices=["dspark", "mtp"],
                    help="the drafters to measure (default: both)")
    ap.add_argument("--prompts", type=int, nargs="+", default=[64, 256, 1024], help="prompt lengths P (default: "
                                                                                   "64 256 1024)")
    ap.add_argument("--new", type=int, nargs="+", default=[16, 64], help="continuation lengths G (default: 16 64)")
    ap.add_argument("--rows", type=int, default=4, help="prompts per step (default: 4)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per point (default: 3)")
    ap.add_argument("--write", action="store_true", help="write the table to docs/benchmarks.md")
    args = ap.parse_args()
    results = []
    for kind in args.kinds:
        for prompt in args.prompts:
            for new in args.new:
                for what in ("refit", "main"):
                    results.append(measure(kind, what, prompt, new, args.rows, args.steps))
                    print(json.dumps(results[-1]), file=sys.stderr)
    report(MARK_BEGIN, MARK_END, table(results, args.rows, args.steps), args.write)


if __name__ == "__main__":
    main()
