"""`trex fidelity matrix RECIPE`: the recipe's variants against its fp32 single-process control.

Every variant trains the same tokens (same steps, same global batch = micro-batch x grad_accum x
ranks) and is compared with the control under the profile that states what should hold:

    bf16, fp16 (loss scaling)            precision
    grad-accum split, 2 processes, EP,   layout
    activation checkpointing
    stop-and-resume (SIGTERM, resume)    bitwise

With ``switches`` (``--switches``) it runs the accelerator switches instead, against the bf16 eager
control, under vendor with bounds from the control's own measured spread (`switch_variants`).

A variant this build cannot run (the loop refuses the layout, torchrun fails) is reported as
"not available" with the reason, never as PASS; the matrix passes when every variant that ran
passes. Output: ``<out>/<variant>/`` run directories, ``<out>/reports/<variant>.{json,png}``,
``<out>/matrix.json`` and ``<out>/matrix.md``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

from trex import atomic, logs
from trex.fidelity.compare import compare
from trex.fidelity.profiles import get_profile
from trex.fidelity.report import write_all
from trex.fidelity.runs import load_signals


@dataclass
class Variant:
    name: str
    profile: str
    overrides: list[str] = field(default_factory=list)
    launch: str = "inline"
    """inline (this process), torchrun (2 processes) or resume (stopped by SIGTERM, then resumed)."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment the variant runs with (``TREX_KERNELS``: the kernel set)."""


def variants(micro_batch_size: int, grad_accum: int) -> list[Variant]:
    """The variants of a recipe whose per-rank batch is ``micro_batch_size`` x ``grad_accum`` rows."""
    half = micro_batch_size // 2
    split = [f"data.micro_batch_size={half}", f"train.grad_accum={2 * grad_accum}"] if half else []
    two_ranks = [f"data.micro_batch_size={half}", "parallel.dp_shard=2"] if half else []
    return [
        Variant("bf16", "precision", ['precision.dtype="bf16"']),
        Variant("fp16-loss-scaling", "precision", ['precision.dtype="fp16"']),
        Variant("grad-accum-split", "layout", split),
        Variant("2-processes", "layout", two_ranks, launch="torchrun"),
        Variant("expert-parallel", "layout", [*two_ranks, "parallel.ep=2"], launch="torchrun"),
        Variant("activation-checkpointing", "layout", ['parallel.activation_checkpointing="full"']),
        Variant("stop-and-resume", "bitwise", [], launch="resume"),
    ]


# `--switches`: what an accelerator turns on that the CPU does not, one at a time and together, each
# against the CPU bf16 eager control under `vendor` (what device bf16 vs CPU bf16 is judged by). The
# control's own spread is measured first by correct bf16 op orders that are no accelerator switch
# (NOISE: the batch split into 2, and into 4, accumulated micro-batches, which reorder the gradient
# sums; the pure-PyTorch reference kernels, which the CPU's fast paths equal at identical inputs and
# which reorder the forward's rounding too) and stored per measure, per layer group and, for the per-step
# gradient-norm error, per recorded step (the worst over the noise runs): every switch is judged with each
# bounded by max(vendor threshold, its spread), a group's per-step error step by step against the spread
# at that step (trex.fidelity.compare), so the verdict separates a switch that departs from the noise of
# any correct bf16 reordering, and a chaotic late step is judged against the noise of the late steps.
SWITCHES_CONTROL = ['precision.dtype="bf16"', "train.compile=false", 'optim.ns_dtype="fp32"']
# A few noise runs bound a chaotic spread from below: on the default recipe one correct op order exceeded
# the worst of four others by up to 2.0x in a layer group (measured, docs/fidelity.md), so the bounds are
# max(threshold, SPREAD_MARGIN x spread).
SPREAD_MARGIN = 2.0
NOISE = ("bf16-reorder-2", "bf16-reorder-4", "kernels-reference")


def switch_variants(micro_batch_size: int, grad_accum: int) -> list[Variant]:
    """The accelerator switches (trex.device / TrainSection.compile_on / kernels.get / the optimizer's
    ``ns_dtype``) that can run on the CPU, after the noise runs; FlexAttention has no CPU backward."""
    def split(k: int) -> list[str]:
        return ([f"data.micro_batch_size={micro_batch_size // k}", f"train.grad_accum={k * grad_accum}"]
                if micro_batch_size % k == 0 and micro_batch_size >= k else [])

    return [
        Variant(NOISE[0], "vendor", split(2)),
        Variant(NOISE[1], "vendor", split(4)),
        Variant(NOISE[2], "vendor", [], env={"TREX_KERNELS": "reference"}),
        Variant("compile", "vendor", ["train.compile=true"]),
        Variant("rms-norm-fused", "vendor", [], env={"TREX_KERNELS": "rms_norm=fused"}),
        Variant("muon-ns-bf16", "vendor", ['optim.ns_dtype="bf16"']),
        Variant("grouped-mm-loop", "vendor", [], env={"TREX_KERNELS": "grouped_mm=reference"}),
        Variant("flex-attention", "vendor", [], env={"TREX_KERNELS": "sparse_attention=flex"}),  # no CPU backward
        Variant("accelerator-set", "vendor", ["train.compile=true", 'optim.ns_dtype="bf16"'],
                env={"TREX_KERNELS": "rms_norm=fused"}),
        # what the device check's run turns on against its CPU bf16 reference (Makefile FIDELITY_PINS: the
        # Newton-Schulz dtype, a precision setting rather than an op order, pinned to fp32 on both sides)
        Variant("device-check-set", "vendor", ["train.compile=true"], env={"TREX_KERNELS": "rms_norm=fused"}),
    ]


UNAVAILABLE = "not available in this build"
SPREAD = "spread"  # the noise run of --switches: measured, not judged
CONTROL = ['precision.dtype="fp32"', "parallel.dp_replicate=1", "parallel.dp_shard=-1", "parallel.ep=1",
           'parallel.activation_checkpointing="none"', "checkpoint.save_every=0", 'checkpoint.resume=""',
           "train.progress=false"]


def claim_out(out: str, what: str, overwrite: bool) -> None:
    """Make ``out`` an empty directory for ``what`` ("a matrix"); one that holds files is refused
    (ValueError naming some of them) unless ``overwrite``, which removes it first."""
    if os.path.isdir(out) and os.listdir(out):
        if not overwrite:
            held = ", ".join(sorted(os.listdir(out))[:4])
            raise ValueError(f"{out} already holds {what} ({held}): choose another --out, or --overwrite to replace it")
        shutil.rmtree(out)
    os.makedirs(out, exist_ok=True)


def signal_overrides(recipe) -> list[str]:
    """``fidelity.every`` for at least two gradient/probe records in the recipe's steps, when it
    has fewer (nothing when it has them)."""
    every, steps = recipe.fidelity.every, recipe.train.steps
    return [] if 0 < every <= steps // 2 else [f"fidelity.every={max(1, steps // 4)}"]


def train_args(recipe_path: str, out: str, overrides: list[str]) -> list[str]:
    """The arguments after the interpreter of ``trex train RECIPE --out OUT --set ...``."""
    args = ["-m", "trex", "train", recipe_path, "--out", out]
    for item in overrides:
        args += ["--set", item]
    return args


def failure_line(proc: subprocess.CompletedProcess | subprocess.Popen, stderr: str) -> str:
    """The line of a failed child's stderr that says why (its `trex train:` line, else the last)."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    said = [line for line in lines if "trex train:" in line or "Error" in line]
    return (said or lines or [f"exit code {proc.returncode}"])[-1].strip()[:300]


def _run_inline(recipe_path: str, out: str, overrides: list[str], env: dict[str, str] | None = None) -> None:
    from trex.recipe import load
    from trex.train.config import TrainRecipe
    from trex.train.loop import train

    import torch

    saved = {k: os.environ.get(k) for k in env or {}}
    os.environ.update(env or {})
    torch._dynamo.reset()  # each run compiles its own model: an earlier run's graphs must not count to its recompile limit
    try:
        train(load(TrainRecipe, recipe_path, [*overrides, f"train.out={json.dumps(out)}"]))
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _run_torchrun(recipe_path: str, out: str, overrides: list[str]) -> str | None:
    """None when it trained; else why it could not (the build refuses the layout, a launch failure)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
           *train_args(recipe_path, out, overrides)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    return None if proc.returncode == 0 else failure_line(proc, proc.stderr)


def _run_stop_and_resume(recipe_path: str, out: str, overrides: list[str], steps: int) -> str:
    """Train in a child process, SIGTERM it once it has logged half the steps (it saves a checkpoint
    and exits), then resume to the end. Returns a note saying where it stopped."""
    ckpt = [*overrides, f"checkpoint.save_every={steps}", 'checkpoint.resume="auto"']
    cmd = [sys.executable, *train_args(recipe_path, out, ckpt)]
    metrics = os.path.join(out, "metrics.jsonl")
    child = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    while child.poll() is None:
        if os.path.exists(metrics) and sum(1 for _ in open(metrics)) >= max(1, steps // 2):
            child.send_signal(signal.SIGTERM)
            break
        time.sleep(0.2)
    _, stderr = child.communicate()
    if child.returncode not in (0, 128 + signal.SIGTERM, -signal.SIGTERM):
        raise RuntimeError(f"first leg: {failure_line(child, stderr)}")
    stopped = sum(1 for _ in open(metrics)) if os.path.exists(metrics) else 0
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"resume: {failure_line(proc, proc.stderr)}")
    return f"stopped after step {stopped} of {steps}, resumed"


def run_matrix(recipe_path: str, out: str, steps: int | None = None, only: list[str] | None = None,
               overrides: list[str] | None = None, overwrite: bool = False, switches: bool = False) -> dict:
    """Train the control and each chosen variant under ``out`` and compare them. A non-empty ``out``
    is refused (ValueError) unless ``overwrite``, which removes it first. ``switches``: the
    accelerator switches against the CPU bf16 eager control (see `switch_variants`) instead of the
    precision/layout variants against the fp32 control."""
    from trex.recipe import load
    from trex.train.config import TrainRecipe

    base = list(overrides or [])
    if steps:
        base.append(f"train.steps={steps}")
    recipe = load(TrainRecipe, recipe_path, base)
    base += signal_overrides(recipe)
    steps = recipe.train.steps
    listing = switch_variants if switches else variants
    names = [v.name for v in listing(2, 1)]
    unknown = set(only or []) - set(names)
    if unknown:
        raise ValueError(f"--only {sorted(unknown)}: unknown variant; choose from {names}")
    chosen = [v for v in listing(recipe.data.micro_batch_size, recipe.train.grad_accum)
              if not only or v.name in only or (switches and v.name in NOISE)]
    control_settings = [*CONTROL, *SWITCHES_CONTROL] if switches else CONTROL
    what = "bf16 eager" if switches else "fp32"
    base_env = {"TREX_KERNELS": "auto"} if switches else {}  # switches: against the CPU's own kernel choice

    claim_out(out, "a matrix", overwrite)
    control_dir = os.path.join(out, f"control-{what.replace(' ', '-')}")
    print(f"[control] {what}, one process, {logs.plural(steps, 'step')} -> {control_dir}", file=sys.stderr)
    _run_inline(recipe_path, control_dir, [*base, *control_settings], base_env)
    control = load_signals(control_dir)
    noise: list = []  # --switches: the noise runs' signals so far
    rows = []
    for variant in chosen:
        run_dir = os.path.join(out, variant.name)
        row = {"variant": variant.name, "profile": variant.profile, "overrides": variant.overrides,
               "run_dir": run_dir, "note": ""}
        said = [*variant.overrides, *(f"{k}={v}" for k, v in variant.env.items())]
        print(f"[{variant.name}] {' '.join(said) or '(control settings)'}", file=sys.stderr)
        settings = [*base, *control_settings, *variant.overrides]
        try:
            if not variant.overrides and not variant.env and variant.launch != "resume":
                raise _Unavailable("the recipe's micro-batch size cannot be halved")
            if variant.launch == "torchrun":
                why = _run_torchrun(recipe_path, run_dir, settings)
                if why:
                    raise _Unavailable(why)
            elif variant.launch == "resume":
                row["note"] = _run_stop_and_resume(recipe_path, run_dir, settings, steps)
            else:
                _run_inline(recipe_path, run_dir, settings, {**base_env, **variant.env})
            signals = load_signals(run_dir)
            if switches and variant.name in NOISE:  # the control's own spread, per measure and layer group
                from trex.fidelity.calibrate import envelope

                noise.append(signals)
                control.envelope = _widened(envelope([control, *noise]), SPREAD_MARGIN)
            result = compare(signals, control, get_profile(variant.profile),
                             envelope="widen" if switches and variant.name not in NOISE else "note")
        except _Unavailable as e:
            row.update(verdict=UNAVAILABLE, note=str(e))
        except NotImplementedError as e:  # a kernel this device lacks (FlexAttention's CPU backward)
            row.update(verdict=UNAVAILABLE, note=str(e).split(";")[0][:300])
        except Exception as e:  # a variant that crashes is a finding, reported in its row
            row.update(verdict="ERROR", note=f"{type(e).__name__}: {e}"[:300])
        else:
            paths = write_all(result, os.path.join(out, "reports"), variant.name)
            noise_run = switches and variant.name in NOISE
            failed = [c.measure for c in result.checks if c.status == "FAIL" and not noise_run]
            values = {c.measure: c.value for c in result.checks}
            row.update(verdict=SPREAD if noise_run else result.verdict,
                       report=paths["json"], plot=paths["png"],
                       loss_mean_rel_err=values["loss_mean_rel_err"],
                       layer_grad_norm_rel_err=values["layer_grad_norm_rel_err"],
                       layer_grad_scale_rel_err=values["layer_grad_scale_rel_err"], probe_kl=values["probe_kl"],
                       tokens=load_signals(run_dir).summary.get("tokens"),
                       note="; ".join(filter(None, [row["note"], f"failed: {', '.join(failed)}" if failed else ""])))
        rows.append(row)
        print(f"    -> {row['verdict']} {row['note']}", file=sys.stderr)
    counted = [r for r in rows if r["verdict"] not in (UNAVAILABLE, SPREAD)]
    verdict = "PASS" if counted and all(r["verdict"] == "PASS" for r in counted) else "FAIL"
    report = {"recipe": recipe_path, "steps": steps, "control": control_dir, "control_what": what,
              "control_tokens": control.summary.get("tokens"), "environment": control.environment,
              "verdict": verdict, "variants": rows}
    _write_reports(report, out)
    print(markdown(report))
    return report


def _widened(env: dict, factor: float) -> dict:
    """``env`` (trex.fidelity.calibrate.envelope) with every spread, per measure and per group, x ``factor``."""
    scale = lambda tree: {k: scale(v) if isinstance(v, dict) else v * factor for k, v in tree.items()}  # noqa: E731
    return {**env, "spread": scale(env["spread"]), "group_spread": scale(env["group_spread"]),
            "group_step_spread": scale(env["group_step_spread"])}


class _Unavailable(Exception):
    """This build cannot run the variant."""


def _num(value) -> str:
    return "-" if value is None else f"{value:.2e}"


def markdown(report: dict) -> str:
    lines = [f"# Fidelity matrix: {report['recipe']}", "",
             f"control: {report.get('control_what', 'fp32')}, one process, {logs.plural(report['steps'], 'step')}, "
             f"{report['control_tokens']} tokens "
             f"({report['environment'].get('device', '?')}, torch {report['environment'].get('torch', '?')})", "",
             "| variant | profile | verdict | loss mean rel err | worst layer grad-norm rel err (per step) "
             "| worst layer grad scale rel err | probe KL | tokens | note |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in report["variants"]:
        lines.append(f"| {r['variant']} | {r['profile']} | {r['verdict']} | {_num(r.get('loss_mean_rel_err'))} | "
                     f"{_num(r.get('layer_grad_norm_rel_err'))} | {_num(r.get('layer_grad_scale_rel_err'))} | "
                     f"{_num(r.get('probe_kl'))} | {r.get('tokens', '-')} | "
                     f"{r['note']} |")
    lines += ["", f"matrix verdict: **{report['verdict']}**"]
    return "\n".join(lines)


def _write_reports(report: dict, out: str) -> None:
    os.makedirs(out, exist_ok=True)
    for name, text in (("matrix.json", json.dumps(report, indent=2)), ("matrix.md", markdown(report) + "\n")):
        atomic.write_text(os.path.join(out, name), text)
