"""The built-in default job (`trex train` with no recipe, `make run`).

A tiny DeepSeek-V4 (every layer type, mHC, hash and score MoE, MTP) learns multi-digit arithmetic
generated at run time:

1. continued pretraining on raw text lines "a+b=c";
2. evaluation: greedy answers to held-out questions asked in the V4 chat format (exact match);
3. SFT on the same kind of problems as V4 chat conversations (loss on assistant tokens);
4. the same evaluation again.

It uses the compact character tokenizer (printable ASCII plus the V4 special tokens) and the same
chat-encoding code as any SFT run. Each stage is an ordinary training run with its own run
directory and recipe (config.toml): SFT starts from the CPT model exported to cpt/model. The job's
own summary.json holds the accuracies before and after SFT.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from trex import atomic, logs
from trex.checkpoint.save import save_pretrained
from trex.data.arithmetic import ArithmeticTask, cpt_records, eval_prompts, generate, sft_records
from trex.data.chat import completion_answer, render_prompt
from trex.data.config import ChatFormat, DataSection
from trex.data.records import write_jsonl
from trex.data.tokenizer import Tokenizer, compact_tokenizer
from trex.models.common.heads import Model
from trex.rollout.generate import greedy_generate
from trex.models import build_model
from trex.parallel.mesh import ParallelSection
from trex.precision import PrecisionSection
from trex.train.config import EvalSection, ModelSection, TrainRecipe, TrainSection
from trex.train.loop import train
from trex.train.optim import OptimSection
from trex.train.schedule import ScheduleSection


@dataclass
class DefaultJob:
    out: str = "runs/default"
    """Job directory: data/, cpt/ and sft/ run directories (cpt/model: the model SFT starts from), model/
    (the final SFT model), summary.json."""
    task: ArithmeticTask = field(default_factory=lambda: ArithmeticTask(digits=2, ops="+-", n_train=6000,
                                                                        n_eval=200, problems_per_text=6))
    """The generated arithmetic task."""
    model: ModelSection = field(default_factory=lambda: ModelSection(overrides={"sliding_window": 32}))
    """The model: the tiny preset, with a window that covers a whole question and answer."""
    chat_format: ChatFormat = "deepseek-v4"
    """How the SFT conversations and the held-out prompts are rendered (``[data] chat_format``): deepseek-v3 or
    deepseek-v3.1 for a model of the DeepSeek-V3 family."""
    seq_len: int = 64
    """Tokens per packed row."""
    micro_batch_size: int = 32
    """Rows per step, across all ranks (each of W ranks reads micro_batch_size / W; W must divide it)."""
    cpt_steps: int = 150
    """Continued-pretraining steps on raw text."""
    sft_steps: int = 400
    """SFT steps on chat conversations. Held-out exact match goes through a sudden transition
    during SFT whose timing varies: at 200 steps one run reached 93% and another, differing only in
    thread count, 22%; at 300-400 steps 66.5-99%; at 400, 97.5% (2 threads) and 99.0% (seed 1)."""
    lr: float = 1e-2
    """Peak learning rate of both stages (warmup 10%, cosine to 10%)."""
    optimizer: str = "muon"
    """muon or adamw."""
    seed: int = 0
    """Seeds the data order and the initialisation."""
    qat: str = "none"
    """Quantisation-aware training in the SFT stage (``[precision] qat``): "none" or "official". The CPT
    stage stands for the pretraining a real post-training run starts from, so it trains unquantised."""
    indexer_loss: float = 0.0
    """Weight of the indexer alignment loss in the SFT stage (``[train] indexer_loss``; > 0 trains the
    indexer)."""
    device: str = ""
    """Device override; empty: the device layer decides."""
    progress: bool = True
    """Live progress bars when the output is a terminal."""
    log_every: int = 10
    """Steps between metric lines (metrics.jsonl, TensorBoard) and, without a terminal, console lines;
    evaluations and each stage's last step are always logged."""

    def scale_steps(self, total: int) -> None:
        """Spread ``total`` steps over the two stages in the default 3:4 proportion."""
        self.cpt_steps = max(1, total * 3 // 7)
        self.sft_steps = max(1, total - self.cpt_steps)


def _stage(job: DefaultJob, name: str, paths: list[str], eval_paths: list[str], mode: str, steps: int,
           model: ModelSection | None = None) -> TrainRecipe:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if job.micro_batch_size % world:
        raise ValueError(f"micro_batch_size = {job.micro_batch_size} rows per step cannot be split over {world} ranks; "
                         "use a world size that divides it or --set micro_batch_size=N")
    return TrainRecipe(
        model=model or job.model,
        data=DataSection(paths=paths, mode=mode, tokenizer="compact", seq_len=job.seq_len, chat_format=job.chat_format,
                        micro_batch_size=job.micro_batch_size // world, seed=job.seed),
        optim=OptimSection(name=job.optimizer, lr=job.lr, weight_decay=0.0),
        schedule=ScheduleSection(warmup_steps=max(1, steps // 10), decay="cosine", min_lr_ratio=0.1),
        train=TrainSection(steps=steps, seed=job.seed, out=os.path.join(job.out, name), device=job.device,
                           overwrite=True,  # the default job replaces its own earlier output
                           eval_every=max(1, steps // 4), log_every=job.log_every, progress=job.progress,
                           indexer_loss=job.indexer_loss if name == "sft" else 0.0,
                           freeze_indexer=not (job.indexer_loss > 0 and name == "sft")),
        eval=EvalSection(paths=eval_paths, batches=2),
        precision=PrecisionSection(qat=job.qat if name == "sft" else "none"),
        parallel=ParallelSection(timeout_s=300, heartbeat_timeout_s=30),  # steps of a tenth of a second
    )


def exact_match(model: Model, tokenizer: Tokenizer, prompts: list[tuple[list[dict], str]],
                max_new_tokens: int = 8, chat_format: str = "deepseek-v4") -> tuple[float, list[dict]]:
    """Greedy answers to questions rendered as ``chat_format``'s generation prompts; the fraction exactly equal
    to the expected answer."""
    encoded = [tokenizer.encode(render_prompt(messages, thinking=False, chat_format=chat_format)).tolist()
               for messages, _ in prompts]
    outputs = greedy_generate(model, encoded, max_new_tokens, stop_id=tokenizer.eos_id, pad_id=tokenizer.pad_id)
    rows = []
    for (messages, expected), ids in zip(prompts, outputs):
        answer = completion_answer(tokenizer.decode(ids), thinking=False).strip()
        rows.append({"question": messages[-1]["content"], "expected": expected, "answer": answer,
                     "correct": answer == expected})
    return sum(r["correct"] for r in rows) / max(1, len(rows)), rows


def export_model(model: Model, path: str) -> str:
    """Write ``model`` to ``path`` in the HF layout (fp32) for recipes to start from (atomically:
    the checkpoint writer fills a temporary directory, then renames it over ``path``). A sharded
    model is gathered to rank 0 (torch's full state dict, on the host), which writes it; every rank
    calls this and returns when the copy is on disk."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        save_pretrained(model, path, layout="hf", dtype="fp32", overwrite=True)
        return path
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        plain = build_model(model.cfg, device="cpu", dtype=torch.float32)
        plain.load_state_dict(full)
        save_pretrained(plain, path, layout="hf", dtype="fp32", overwrite=True)
    dist.barrier()
    return path


def run_default_job(job: DefaultJob) -> dict:
    """Generate the data, run CPT then SFT, measure held-out exact match before and after, export
    the model; rank 0 speaks and writes the job's summary.json (every rank runs the job)."""
    main = int(os.environ.get("RANK", "0")) == 0

    def say(*args, **kwargs) -> None:
        if main:
            print(*args, **kwargs)

    t0 = time.perf_counter()
    data_dir = os.path.join(job.out, "data")
    os.makedirs(data_dir, exist_ok=True)
    train_problems, held_out = generate(dataclasses.replace(job.task, seed=job.seed))
    files = {
        "cpt": os.path.join(data_dir, "cpt.jsonl"), "sft": os.path.join(data_dir, "sft.jsonl"),
        "heldout": os.path.join(data_dir, "heldout.jsonl"),
    }
    write_jsonl(files["cpt"], cpt_records(train_problems, job.task.problems_per_text))
    write_jsonl(files["sft"], sft_records(train_problems))
    write_jsonl(files["heldout"], sft_records(held_out))
    prompts = eval_prompts(held_out)
    tokenizer = compact_tokenizer()

    say(f"[1/4] continued pretraining: {logs.plural(job.cpt_steps, 'step')} on "
        f"{logs.plural(len(train_problems), 'problem')} as text", file=sys.stderr)
    cpt = train(_stage(job, "cpt", [files["cpt"]], [], "cpt", job.cpt_steps), tokenizer=tokenizer)
    say("[2/4] held-out exact match after continued pretraining", file=sys.stderr)
    before, _ = exact_match(cpt.model, tokenizer, prompts, chat_format=job.chat_format)
    say(f"      exact match before SFT: {100 * before:.1f}%", file=sys.stderr)
    say(f"[3/4] SFT: {logs.plural(job.sft_steps, 'step')} on chat conversations", file=sys.stderr)
    # SFT starts from the CPT model on disk, so that sft/config.toml alone reproduces the stage
    cpt_model = export_model(cpt.model, os.path.join(job.out, "cpt", "model"))
    sft = train(_stage(job, "sft", [files["sft"]], [files["heldout"]], "sft", job.sft_steps,
                       ModelSection(path=cpt_model)), tokenizer=tokenizer)
    say("[4/4] held-out exact match after SFT", file=sys.stderr)
    after, rows = exact_match(sft.model, tokenizer, prompts, chat_format=job.chat_format)
    model_dir = export_model(sft.model, os.path.join(job.out, "model"))
    summary = {
        "exact_match_before_sft": before,
        "exact_match_after_sft": after,
        "held_out_problems": len(prompts),
        "cpt": {"run_dir": cpt.run_dir, "final_loss": cpt.summary["final"].get("loss")},
        "sft": {"run_dir": sft.run_dir, "final_loss": sft.summary["final"].get("loss"),
                "eval_loss": sft.summary["eval_loss"].get("final")},
        "model": model_dir,
        "skipped_steps": cpt.summary["skipped_steps"] + sft.summary["skipped_steps"],
        "skipped_records": cpt.summary["data"]["skipped"] + sft.summary["data"]["skipped"],
        "wall_time_s": time.perf_counter() - t0,
        "examples": rows[:10],
    }
    if main:
        atomic.write_json(os.path.join(job.out, "summary.json"), summary)
    say(f"exact match on {len(prompts)} held-out problems: before SFT {100 * before:.1f}%, "
          f"after SFT {100 * after:.1f}%  ({summary['wall_time_s']:.0f}s; {job.out}/summary.json)")
    return summary
