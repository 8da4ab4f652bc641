"""Write this folder's DPO pairs: the exact answer is ``chosen``, one of the default job's SFT
model's own wrong answers is ``rejected`` (on-policy negatives, trex.data.arithmetic.mistake_records).

    .venv/bin/python recipes/dpo_arithmetic_data/make_pairs.py runs/sft200/model

Problems are the default job's task's third split, ``fresh_problems(DefaultJob().task, 4000, seed=1)``
(never trained on, not in its held-out set), the same as recipes/grpo_arithmetic_data/: the first
3000 give ``train.jsonl``; the last 1000 and the default job's 200 held-out problems give
``heldout.jsonl``. The model answers each problem SAMPLES times at temperature 1 (generator seed 0
for train, 1 for held-out); a problem it always answers right gives no pair.
"""

import os
import sys

import torch

from trex.data.arithmetic import fresh_problems, generate, mistake_records, prompt_records
from trex.data.chat import completion_answer, render_prompt
from trex.data.records import write_jsonl
from trex.data.tokenizer import compact_tokenizer
from trex.checkpoint import load_pretrained
from trex.rollout import SamplingParams, sample
from trex.train.default_job import DefaultJob

SAMPLES = 8


def answers(model, problems, seed: int) -> list[list[str]]:
    tok = compact_tokenizer()
    prompts = [tok.encode(render_prompt([{"role": "user", "content": r["prompt"]}], thinking=False)).tolist()
               for r in prompt_records(problems) for _ in range(SAMPLES)]
    out = sample(model, prompts, SamplingParams(temperature=1.0, max_new_tokens=6, stop_ids=(tok.eos_id,)),
                 tok.pad_id, generator=torch.Generator().manual_seed(seed), batch_size=512)
    texts = [completion_answer(tok.decode(c), thinking=False).strip() for c in out.completion_ids]
    return [texts[i:i + SAMPLES] for i in range(0, len(texts), SAMPLES)]


def main(model_dir: str) -> None:
    task = DefaultJob().task
    fresh = fresh_problems(task, 4000, seed=1)
    held = fresh[3000:] + generate(task)[1]
    model = load_pretrained(model_dir, dtype=torch.float32).eval()
    folder = os.path.dirname(os.path.abspath(__file__))
    for name, problems, seed in (("train", fresh[:3000], 0), ("heldout", held, 1)):
        records = mistake_records(problems, answers(model, problems, seed))
        write_jsonl(f"{folder}/{name}.jsonl", records)
        print(f"{name}: {len(records)} pairs from {len(problems)} problems")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "runs/sft200/model")
