"""The calculator demonstration: GRPO with and without a tool, from the same tiny random model.

    python -m trex.train.tool_demo --out runs/tool_demo

1. data (trex.data.arithmetic): 3-digit additions of fixed width (operands and sums all 3 digits, so the
   call copies the question from a constant distance); ``demonstrations`` of them as calculator calls
   (``tool_call_records``) and the same problems answered directly (``sft_records``); ``prompts`` others
   as GRPO prompts (``prompt_records``);
2. per arm, from the same random init: the SFT warm-up (``recipes/calculator_warmup.toml``) on its
   demonstrations, then GRPO (``recipes/grpo_calculator.toml``; the no-tool arm with
   ``environment.name = ""``: single-turn, the model answers alone) with the exact-answer reward;
3. ``DIR/tool_demo.png`` (reward per step of both arms; the tool arm's calls, parse errors, tool errors
   and answered share per trajectory), ``DIR/tool_demo.md`` (the table) and ``DIR/tool_demo.json``.

Each stage is an ordinary training run with its own run directory (``DIR/warmup_<arm>``,
``DIR/grpo_<arm>``) and config.toml; GRPO starts from the warm-up's model exported to
``DIR/warmup_<arm>/model``. ``--set`` changes both arms' GRPO recipe (e.g. ``train.steps=10``),
``--warmup-set`` both warm-ups.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

from trex import atomic
from trex.data.arithmetic import ArithmeticTask, generate, prompt_records, sft_records, tool_call_records
from trex.data.records import write_jsonl
from trex.recipe import load
from trex.train.config import TrainRecipe
from trex.train.default_job import export_model
from trex.train.loop import train

ARMS = ("tools", "no_tools")
ENV_METRICS = ("env/tool_calls", "env/parse_errors", "env/tool_errors", "env/answered")


@dataclasses.dataclass
class ToolDemo:
    out: str = "runs/tool_demo"
    warmup_recipe: str = "recipes/calculator_warmup.toml"
    grpo_recipe: str = "recipes/grpo_calculator.toml"
    digits: int = 3
    """Operands and sums of exactly this many digits (ArithmeticTask.fixed_width)."""
    demonstrations: int = 256
    """Warm-up conversations per arm (the same problems in both)."""
    prompts: int = 512
    """GRPO prompts (problems in no demonstration)."""
    seed: int = 0
    warmup_set: list[str] = dataclasses.field(default_factory=list)
    grpo_set: list[str] = dataclasses.field(default_factory=list)


def write_data(demo: ToolDemo) -> dict[str, str]:
    """The demonstration's data files under ``DIR/data``: tool_calls.jsonl, answers.jsonl, prompts.jsonl."""
    task = ArithmeticTask(digits=demo.digits, ops="+", n_train=demo.demonstrations + demo.prompts, n_eval=0,
                          seed=demo.seed, fixed_width=True)
    problems, _ = generate(task)
    shown, asked = problems[:demo.demonstrations], problems[demo.demonstrations:]
    data = os.path.join(demo.out, "data")
    os.makedirs(data, exist_ok=True)
    files = {name: os.path.join(data, f"{name}.jsonl") for name in ("tool_calls", "answers", "prompts")}
    write_jsonl(files["tool_calls"], tool_call_records(shown))
    write_jsonl(files["answers"], sft_records(shown))
    write_jsonl(files["prompts"], prompt_records(asked))
    return files


def run_arm(demo: ToolDemo, arm: str, files: dict[str, str]) -> str:
    """The warm-up and GRPO of one arm; the GRPO run directory."""
    warm_dir, grpo_dir = os.path.join(demo.out, f"warmup_{arm}"), os.path.join(demo.out, f"grpo_{arm}")
    shown = files["tool_calls"] if arm == "tools" else files["answers"]
    common = ["train.progress=false", "train.overwrite=true"]
    warm = load(TrainRecipe, demo.warmup_recipe, [f"data.paths=[{json.dumps(shown)}]", f"train.out={json.dumps(warm_dir)}",
                                                  f"model.init_seed={demo.seed}", *common, *demo.warmup_set])
    result = train(warm)
    model = export_model(result.model, os.path.join(warm_dir, "model"))
    grpo = load(TrainRecipe, demo.grpo_recipe, [
        f"model.path={json.dumps(model)}", f"grpo.prompts=[{json.dumps(files['prompts'])}]",
        f"train.out={json.dumps(grpo_dir)}", f"grpo.seed={demo.seed}", *common,
        *([] if arm == "tools" else ['environment.name=""']), *demo.grpo_set])
    train(grpo)
    return grpo_dir


def read_metrics(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [row for row in map(json.loads, f) if "reward_mean" in row]


def report(out: str, runs: dict[str, list[dict]]) -> dict:
    """tool_demo.{png,md,json} under ``out`` from each arm's GRPO metrics; the summary."""
    def mean(rows, key, part):
        n = max(1, len(rows) // 4)
        pick = rows[:n] if part == "first" else rows[-n:]
        return sum(r.get(key, 0.0) for r in pick) / len(pick)

    summary = {arm: {"steps": len(rows), "reward_first_quarter": mean(rows, "reward_mean", "first"),
                     "reward_last_quarter": mean(rows, "reward_mean", "last"),
                     **{f"{k}_last_quarter": mean(rows, k, "last") for k in ENV_METRICS if arm == "tools"}}
               for arm, rows in runs.items()}
    lines = ["| arm | steps | reward, first quarter | reward, last quarter | tool calls | parse errors | "
             "tool errors | answered |", "|---|---|---|---|---|---|---|---|"]
    for arm, s in summary.items():
        env = [f"{s[f'{k}_last_quarter']:.2f}" if f"{k}_last_quarter" in s else "-" for k in ENV_METRICS]
        lines.append(f"| {arm.replace('_', '-')} | {s['steps']} | {s['reward_first_quarter']:.3f} | "
                     f"{s['reward_last_quarter']:.3f} | " + " | ".join(env) + " |")
    table = "\n".join(lines) + "\n\nPer trajectory, last quarter of the steps; reward: exact answer (0/1).\n"
    atomic.write_text(os.path.join(out, "tool_demo.md"), table)
    atomic.write_text(os.path.join(out, "tool_demo.json"), json.dumps(summary, indent=2) + "\n")
    _plot(os.path.join(out, "tool_demo.png"), runs)
    return summary


def _plot(path: str, runs: dict[str, list[dict]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    for (arm, rows), color in zip(runs.items(), ("tab:blue", "tab:orange")):
        steps, reward = [r["step"] for r in rows], [r["reward_mean"] for r in rows]
        left.plot(steps, reward, "o", markersize=2.5, color=color, alpha=0.35)
        w = max(1, len(rows) // 10)  # a trailing mean over a tenth of the steps: 32 trajectories a step are noisy
        left.plot(steps[w - 1:], [sum(reward[i - w + 1:i + 1]) / w for i in range(w - 1, len(reward))], "-",
                  color=color, label=f"{'with the calculator' if arm == 'tools' else 'without tools'} ({w}-step mean)")
    left.set(xlabel="GRPO step", ylabel="reward (exact answer)", ylim=(-0.03, 1.03), title="reward")
    left.legend()
    rows = runs.get("tools", [])
    for key in ENV_METRICS:
        right.plot([r["step"] for r in rows], [r.get(key, 0.0) for r in rows], "o-", markersize=3,
                   label=key.removeprefix("env/"))
    right.set(xlabel="GRPO step", ylabel="per trajectory", title="tool arm: calls and errors")
    right.legend()
    for ax in (left, right):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    with atomic.replacing(path, suffix=".png") as tmp:
        fig.savefig(tmp, dpi=100)
    plt.close(fig)


def run(demo: ToolDemo) -> dict:
    files = write_data(demo)
    runs = {}
    for arm in ARMS:
        print(f"tool demo: {arm.replace('_', '-')} arm", file=sys.stderr, flush=True)
        runs[arm] = read_metrics(run_arm(demo, arm, files))
    return report(demo.out, runs)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trex.train.tool_demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=ToolDemo.out, help="directory of data, runs and figures (default: %(default)s)")
    p.add_argument("--warmup-recipe", default=ToolDemo.warmup_recipe,
                   help="the warm-up SFT recipe (default: %(default)s)")
    p.add_argument("--recipe", default=ToolDemo.grpo_recipe, help="the GRPO recipe (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="the data's and both arms' seed (default: %(default)s)")
    p.add_argument("--set", dest="grpo_set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override the GRPO recipe of both arms (repeatable; default: none)")
    p.add_argument("--warmup-set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override the warm-up recipe of both arms (repeatable; default: none)")
    args = p.parse_args(argv)
    demo = ToolDemo(out=args.out, warmup_recipe=args.warmup_recipe, grpo_recipe=args.recipe, seed=args.seed,
                    warmup_set=args.warmup_set, grpo_set=args.grpo_set)
    try:
        summary = run(demo)
    except (OSError, ValueError) as e:
        print(f"trex tool demo: {e}", file=sys.stderr)
        return 2
    for arm, s in summary.items():
        print(f"{arm}: reward {s['reward_first_quarter']:.3f} -> {s['reward_last_quarter']:.3f}")
    print(f"figure: {os.path.join(args.out, 'tool_demo.png')}  table: {os.path.join(args.out, 'tool_demo.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
