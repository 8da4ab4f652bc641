"""Profile a recipe: its first steps run as ``trex train`` runs them, the last ones under
``torch.profiler``, and the step's time split by class (trex.profile.classes).

The run is the recipe's own (device, precision, layout, compile), shortened to ``warmup + steps``
steps, with no checkpoint, evaluation, fidelity probe or drafter re-fit (they would land in a step's
time) and its learning-rate warm-up cut to that length (a rate does not change a step's time), in a
run directory of its own. Written there, atomically: ``profile.json`` (the report) and ``trace.json``
(Chrome trace of the profiled steps, chrome://tracing or Perfetto).
"""

from __future__ import annotations

import dataclasses
import os
import time

import torch

from trex import atomic
from trex import device as device_layer
from trex.checkpoint.training import CheckpointSection
from trex.hardware import HardwareProfile
from trex.models.flops import flops_per_token
from trex.profile.classes import CLASSES, StepProfile, classify
from trex.profile.estimate import estimate
from trex.profile.scopes import Labels, label_model
from trex.train.config import EvalSection, TrainRecipe
from trex.train.loop import train

SUM_TOLERANCE = 0.05  # the classes must add up to the measured step within this share


class Profiling:
    """The StepObserver that labels the model and records the profiled steps (trex.train.loop)."""

    def __init__(self, warmup: int, steps: int, seq_len: int):
        self.warmup, self.steps, self.seq_len = warmup, steps, seq_len
        self.flops_per_token = 0.0
        self.prof: torch.profiler.profile | None = None
        self.labels: Labels | None = None
        self.dev: device_layer.Device | None = None
        self.wall: list[float] = []  # seconds between step ends, profiled steps only
        self.metrics: list[dict] = []
        self._last = 0.0

    def started(self, model, dev: device_layer.Device) -> None:
        self.dev = dev
        self.flops_per_token = flops_per_token(model.cfg, self.seq_len).total
        self.labels = label_model(model)
        self.prof = torch.profiler.profile(
            activities=dev.profiler_activities(), record_shapes=True,
            schedule=torch.profiler.schedule(wait=0, warmup=self.warmup, active=self.steps, repeat=1),
            on_trace_ready=lambda prof: None)  # read after the run, not printed
        self.prof.start()
        self._last = time.perf_counter()

    def stepped(self, step: int, metrics: dict) -> None:
        now = time.perf_counter()
        if step > self.warmup:
            self.wall.append(now - self._last)
            self.metrics.append(dict(metrics))
        self._last = now
        self.prof.step()

    def close(self) -> None:
        if self.labels is not None:
            self.labels.remove()
        if self.prof is not None and self.prof.profiler is not None:
            self.prof.stop()


def profile_recipe(recipe: TrainRecipe, out: str, steps: int = 2, warmup: int = 1) -> tuple[dict, StepProfile]:
    """Run ``warmup + steps`` steps of ``recipe`` into ``out``, profile the last ``steps``; the report
    and the classed steps (their units: what trex.profile.estimate prices). The caller writes
    ``profile.json`` (trex.profile.cli, with the estimates).

    Report fields: step_s (the profiled steps' mean wall time), classes
    (per class: time_s, share, launches, flops, bytes, tflops_per_s, gb_per_s; per step), classes_sum_s,
    tokens_per_step, tokens_per_s, mfu (model FLOPs over the step's wall time; None without a
    peak), optimizer_share, peak_memory_bytes, device, dtype, trace (the Chrome trace's path)."""
    if steps < 1 or warmup < 0:
        raise ValueError(f"--steps {steps} --warmup {warmup}: expected steps >= 1 and warmup >= 0")
    short = dataclasses.replace(
        recipe, eval=EvalSection(), schedule=dataclasses.replace(
            recipe.schedule, warmup_steps=min(recipe.schedule.warmup_steps, warmup + steps)), checkpoint=CheckpointSection(),
        fidelity=dataclasses.replace(recipe.fidelity, every=0), drafter=dataclasses.replace(recipe.drafter,
                                                                                              enabled=False),
        train=dataclasses.replace(recipe.train, steps=warmup + steps, out=out, overwrite=True, progress=False,
                                  eval_every=0, eval_at_start=False, log_every=1))
    watch = Profiling(warmup, steps, recipe.data.seq_len)
    try:
        result = train(short, observer=watch)
    finally:
        watch.close()
    events = watch.prof.events()
    # timed by the device's kernels where the profiler recorded them (a plugin may record none: host ops then)
    on_device = watch.dev.is_accelerator and any(e.self_device_time_total > 0 for e in events)
    measured = classify(events, on_device)
    trace = os.path.join(result.run_dir, "trace.json")
    with atomic.replacing(trace) as tmp:
        watch.prof.export_chrome_trace(tmp)
    report = {**build_report(measured, watch.wall, watch.metrics, watch.dev, recipe), "trace": trace,
              "run_dir": result.run_dir, "model_flops_per_token": watch.flops_per_token}
    return report, measured


def build_report(measured: StepProfile, wall: list[float], metrics: list[dict], dev: device_layer.Device,
                 recipe: TrainRecipe) -> dict:
    """The report of one profile: the classes per step against the step's measured wall time."""
    step_s = sum(wall) / len(wall)
    classes = []
    for name in [*CLASSES, *sorted(set(measured.classes) - set(CLASSES))]:
        c = measured.classes.get(name)
        if c is None:
            continue
        classes.append({"class": name, "what": CLASSES.get(name, ""), "time_s": c.time_s,
                        "share": c.time_s / step_s, "launches": c.launches, "flops": c.flops or None,
                        "bytes": c.bytes or None,
                        "tflops_per_s": c.flops / c.time_s / 1e12 if c.flops and c.time_s else None,
                        "gb_per_s": c.bytes / c.time_s / 1e9 if c.bytes and c.time_s else None})
    tokens = [m["tokens_per_s"] * m["step_time_s"] for m in metrics]
    tokens_per_step = sum(tokens) / len(tokens)
    mfus = [m["mfu"] * m["step_time_s"] / w for m, w in zip(metrics, wall) if m.get("mfu") is not None]
    optimizer = sum(c["time_s"] for c in classes if c["class"].startswith("optimizer/"))
    return {
        "recipe_model": recipe.model.preset or recipe.model.path, "device": dev.name,
        "dtype": recipe.precision.dtype, "compiled": bool(recipe.train.compile_with(dev)),
        "steps_profiled": len(wall), "step_s": step_s, "classes_sum_s": measured.total_s(),
        "sum_vs_step": measured.total_s() / step_s, "timing": "device kernels" if measured.on_device else "host ops",
        "tokens_per_step": tokens_per_step, "tokens_per_s": tokens_per_step / step_s,
        "mfu": sum(mfus) / len(mfus) if mfus else None, "optimizer_share": optimizer / step_s,
        "peak_memory_bytes": max(m["mem_peak_bytes"] for m in metrics), "classes": classes,
    }


def profile_with_estimates(recipe: TrainRecipe, out: str, steps: int, warmup: int, hardware: list[HardwareProfile],
                           as_dtype: str | None = None) -> dict:
    """`trex profile`: the measured report, and the step estimated on each of ``hardware`` (eager and
    compiled seconds, MFU); written to ``<out>/profile.json``. An estimate needs an eager trace (a
    compiled region's fused kernels are not ops the trace can price): a compiled run gets none."""
    report, measured = profile_recipe(recipe, out, steps, warmup)
    if report["compiled"]:
        report["estimates"] = []
        report["estimate_note"] = "no device estimate from a compiled run: profile with --set train.compile=false"
    else:
        report["estimates"] = estimates(measured, report, hardware, as_dtype or recipe.precision.dtype)
    atomic.write_json(os.path.join(report["run_dir"], "profile.json"), report)
    return report


def estimates(measured: StepProfile, report: dict, hardware: list[HardwareProfile], dtype: str,
              micro_batches: int = 1) -> list[dict]:
    """The step priced on each hardware profile (trex.profile.estimate), with the MFU each would give:
    the report's model FLOPs per step over the estimated time at the profile's ``dtype`` peak, and the
    forward + backward's alone (the optimizer's classes left out)."""
    model_flops = report["model_flops_per_token"] * report["tokens_per_step"]
    found = []
    for hw in hardware:
        est = estimate(measured.units, hw, measured.steps, dtype if dtype != report["dtype"] else None, micro_batches)
        peak = hw.peak_tflops.get(dtype, 0.0) * 1e12
        for form in ("eager", "compiled"):
            optimizer = sum(c[f"{form}_s"] for k, c in est["classes"].items() if k.startswith("optimizer/"))
            est[f"mfu_{form}"] = model_flops / (est[f"{form}_s"] * peak) if peak else None
            est[f"mfu_{form}_forward_backward"] = model_flops / ((est[f"{form}_s"] - optimizer) * peak) if peak else None
            est[f"optimizer_share_{form}"] = optimizer / est[f"{form}_s"]
        found.append(est)
    return found


def estimate_on_meta(recipe: TrainRecipe, out: str, hardware: list[HardwareProfile],
                     as_dtype: str | None = None) -> dict:
    """`trex profile --meta`: the recipe's step recorded on the meta device (trex.profile.meta) and
    estimated on each of ``hardware``; ``<out>/profile.json``. One rank's step: no collectives. One
    micro-batch is recorded and priced ``train.grad_accum`` times, the optimizer once."""
    from trex.profile.meta import trace_on_meta
    from trex.train.dry_run import model_config

    cfg = model_config(recipe)
    d = recipe.data
    dtype = as_dtype or recipe.precision.dtype
    measured = trace_on_meta(cfg, d.seq_len, d.micro_batch_size, 1, dtype, recipe.optim)  # x grad_accum below
    tokens = d.seq_len * d.micro_batch_size * recipe.train.grad_accum
    classes = [{"class": name, "what": CLASSES.get(name, ""), "launches": c.launches, "flops": c.flops or None,
                "bytes": c.bytes or None} for name in CLASSES
               if (c := measured.classes.get(name)) is not None and (c.flops or c.bytes)]
    report = {"recipe_model": recipe.model.preset or recipe.model.path, "device": "meta", "dtype": dtype,
              "compiled": False, "tokens_per_step": tokens, "timing": "none (meta device)",
              "model_flops_per_token": flops_per_token(cfg, d.seq_len).total, "classes": classes, "run_dir": out}
    report["estimates"] = estimates(measured, report, hardware, dtype, recipe.train.grad_accum)
    os.makedirs(out, exist_ok=True)
    atomic.write_json(os.path.join(out, "profile.json"), report)
    return report
