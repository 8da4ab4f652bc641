"""`trex fidelity ladder RECIPE --variant KEY=VALUE`: where a variant departs from its reference.

Five rungs between the reference configuration (the recipe, plus ``reference_overrides``) and the
variant (the recipe plus ``variant_overrides``), each isolating one part of training (the MindSpore
migration ladder), taken in order and stopping at the first that fails:

  1 forward    the step-1 loss at the initial weights, and every block's output on the probe batch
               (hooks on both sides: embed, layers.N, hc_head, norm, logits, mtp.N), by cosine and
               max-abs error; names the first block, in forward order, whose output departs
  2 backward   the step-1 gradient of every parameter (norm and direction); names the first parameter,
               in the order the backward reaches them (MTP and head first, layer 0 and embed last),
               whose gradient departs, with its layer group
  3 optimizer  both sides load the reference's step-1 gradients, take their own optimizer step and
               router-bias update, and compute the step-2 loss; names the first parameter whose
               update departs
  4 lr = 0     ``lr0_steps`` steps of the training loop at learning rate 0 and no router-bias update:
               forward/backward error accumulated over many batches without weight drift, judged by
               `trex.fidelity.compare` under the profile (loss, gradient norms per layer group, probe)
  5 long run   the recipe's steps, judged by `compare` under the profile

Rungs 1-3 are judged by the profile's ``ladder`` bounds (trex.fidelity.profiles.LadderBounds), rungs
4-5 by its thresholds. Both sides run in this process, one after the other: a variant is anything a
recipe override expresses in one process (precision, device, kernels, compile, activation
checkpointing, the grad-accum split, QAT, optimizer settings); layouts over several processes are
compared by `trex fidelity matrix`. ``edit`` (a function of the built model) plants a change the
recipe cannot express, for tests and for bisecting a local patch.

Output in ``out``: ``ladder.json``, ``ladder.md`` (the table) and ``ladder.png`` (per-block and
per-parameter errors against the bounds), and ``<side>/lr0`` and ``<side>/run`` run directories.
Rungs 1-3 hold each side's step-1 gradients and the probe batch's block outputs in host memory
(fp32): the ladder is for models that fit one process.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from trex import atomic, logs
from trex import device as device_layer
from trex.fidelity.compare import compare
from trex.fidelity.matrix import claim_out, signal_overrides
from trex.fidelity.profiles import LadderBounds, Profile
from trex.fidelity.report import write_all
from trex.fidelity.runs import load_signals
from trex.fidelity.sketch import Stats
from trex.fidelity.sketch import agreement as sketch_agreement
from trex.models import evaluating
from trex.models.common.heads import Model
from trex.parallel.load import load_sharded
from trex.parallel.mesh import Parallel, init_parallel, resolve_layout
from trex.posttrain import TrainContext, build_objective
from trex.precision import DynamicLossScaler, PrecisionPolicy, StepGuard
from trex.recipe import load
from trex.train.config import TrainRecipe
from trex.train.loop import fidelity_recorder, model_for, prepare_model, tokenizer_for, train
from trex.train.moe_balance import sum_expert_counts, update_router_bias
from trex.train.optim import build_optimizer, clip_grad_norm
from trex.train.schedule import build_scheduler
from trex.train.signals import layer_group

RUNGS = ("forward", "backward", "optimizer", "lr0", "long run")
_TINY = 1e-30


@dataclass
class Side:
    """One configuration of the ladder: a recipe and an optional edit of its built model."""

    name: str
    recipe: TrainRecipe
    edit: Callable[[Model], None] | None = None

    def model(self, recipe: TrainRecipe, dev: device_layer.Device, policy: PrecisionPolicy, tokenizer):
        model = model_for(recipe, tokenizer, dev, policy)
        if self.edit is not None:
            self.edit(model)
        return model


@dataclass
class Parts:
    """A side's student at its initial weights with what one step needs (in its layout)."""

    recipe: TrainRecipe
    model: Model
    params: list[tuple[str, torch.Tensor]]
    optimizer: torch.optim.Optimizer
    objective: object
    guard: StepGuard
    probe: object
    par: Parallel


def build_parts(side: Side) -> Parts:
    recipe = side.recipe
    dev = device_layer.detect(recipe.train.device or None)
    dev.set_current()
    layout = recipe.parallel
    par = init_parallel(layout.dp_replicate, layout.dp_shard, layout.ep, layout.timeout_s, dev, cp=layout.cp,
                        tp=layout.tp, sequence_parallel=layout.sequence_parallel)
    dev.manual_seed(recipe.train.seed)
    policy = PrecisionPolicy.resolve(recipe.precision.dtype, dev)
    tokenizer = tokenizer_for(recipe.data.tokenizer)
    compile_backend = recipe.train.compile_with(dev)
    if par.distributed and recipe.model.path and side.edit is None:  # each rank reads its shards
        model = load_sharded(recipe.model.path, lambda m: prepare_model(m, recipe, par, policy, compile_backend),
                             dev.torch_device, overrides=recipe.model.overrides)
    else:
        model = side.model(recipe, dev, policy, tokenizer)
        prepare_model(model, recipe, par, policy, compile_backend)
    optimizer = build_optimizer(model, recipe.optim, dev)
    build_scheduler(optimizer, recipe.schedule, recipe.train.steps)  # sets step 1's learning rate
    guard = StepGuard(recipe.precision.max_consecutive_skips, DynamicLossScaler.from_config(recipe.precision, policy))
    objective = build_objective(recipe.train.mode, TrainContext(recipe, par, dev, policy, tokenizer, model))
    probe = fidelity_recorder(recipe, objective, "", tokenizer, dev.torch_device, first=0, last=None).probe
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return Parts(recipe, model, params, optimizer, objective, guard, probe, par)


# ---- measurements ------------------------------------------------------------------------------------
def tapped_blocks(model: Model) -> list[tuple[str, torch.nn.Module]]:
    """The modules whose outputs the ladder compares, in forward order: embed, each layer, the mHC head
    (V4; V4.1's single-pass mHC has none), norm, each MTP block."""
    head = [("hc_head", model.hc_head)] if hasattr(model, "hc_head") else []
    return [("embed", model.embed), *((f"layers.{i}", m) for i, m in enumerate(model.layers)), *head,
            ("norm", model.norm), *((f"mtp.{j}", m) for j, m in enumerate(model.mtp))]


def block_outputs(model: Model, batch) -> dict[str, torch.Tensor]:
    """Forward order -> output (fp32, host) of every block on ``batch`` (no gradient): embed, each
    layer's mHC residual [B, S, hc, d], hc_head, norm, logits [B, S, V], each MTP block's hidden."""
    taps = tapped_blocks(model)
    seen: dict[str, torch.Tensor] = {}

    def tap(name: str):
        def hook(module, args, output):
            if name not in seen:  # the first call: embed also embeds MTP's look-ahead tokens
                if isinstance(output, tuple):  # an MTP block's normalised hidden; a V4.1 block's streams
                    output = output[-1] if name.startswith("mtp.") else output[0]
                seen[name] = output.detach()
        return hook

    handles = [m.register_forward_hook(tap(n)) for n, m in taps]
    try:
        with torch.no_grad(), evaluating(model):
            seen["logits"] = model(batch.input_ids, doc_ids=batch.doc_ids).logits.detach()
    finally:
        for h in handles:
            h.remove()
    order = [n for n, _ in taps if n in seen]
    order.insert(order.index("norm") + 1, "logits")
    return {n: seen[n].float().cpu() for n in order}


def agreement(a: torch.Tensor, b: torch.Tensor) -> dict[str, float]:
    """cosine (fp64; exactly 1 for equal tensors), max_abs = max |a - b|, max_abs_rel = max_abs /
    max |b|, and the norms of a and b."""
    if a.shape != b.shape:
        return {"cosine": -1.0, "max_abs": math.inf, "max_abs_rel": math.inf, "norm": math.nan, "ref_norm": math.nan}
    a64, b64 = a.double().flatten(), b.double().flatten()
    na, nb = float(a64.norm()), float(b64.norm())
    equal = bool(torch.equal(a64, b64))
    cosine = 1.0 if equal else float(a64 @ b64) / max(na * nb, _TINY)
    max_abs = 0.0 if equal else float((a64 - b64).abs().max())
    return {"cosine": cosine, "max_abs": max_abs, "max_abs_rel": max_abs / max(float(b64.abs().max()), _TINY),
            "norm": na, "ref_norm": nb}


def loss_error(a: float, b: float) -> float:
    """|a - b| / max(|b|, 1), the MindSpore first-step form; inf when a is not finite."""
    return abs(a - b) / max(abs(b), 1.0) if math.isfinite(a) else math.inf


Tensors = dict[str, torch.Tensor] | Stats  # the tensors themselves, or their statistics (one process or a record)


def agree(run: Tensors, ref: Tensors, name: str) -> dict[str, float]:
    """:func:`agreement` of tensor ``name`` of ``run`` with ``ref``'s (estimated from statistics when
    they are trex.fidelity.sketch.Stats); the measures of a shape mismatch when ``run`` lacks it."""
    if name not in run:
        return agreement(torch.zeros(0), torch.ones(1))
    return sketch_agreement(run, ref, name) if isinstance(ref, Stats) else agreement(run[name], ref[name])


def tensor_errors(run: Tensors, ref: Tensors, order: list[str], bound: float, floor: float) -> list[dict]:
    """Per name in ``order``: norm relative error (divided by max(reference norm, floor x the
    reference's global norm)) and 1 - cosine (judged only above that floor); ``departs`` when either
    exceeds ``bound``, or the tensor is missing on one side."""
    global_norm = (ref.global_norm() if isinstance(ref, Stats)
                   else math.sqrt(sum(float(t.double().norm()) ** 2 for t in ref.values())))
    rows = []
    for name in order:
        if name not in run or name not in ref:
            rows.append({"name": name, "group": layer_group(name), "norm_rel_err": math.inf, "direction_err": math.inf,
                         "departs": True, "note": "only in the " + ("reference" if name in ref else "variant")})
            continue
        m = agree(run, ref, name)
        scale = max(m["ref_norm"], floor * global_norm, _TINY)
        norm_err = abs(m["norm"] - m["ref_norm"]) / scale if math.isfinite(m["norm"]) else math.inf
        direction = 1.0 - m["cosine"] if m["ref_norm"] >= floor * global_norm else 0.0
        rows.append({"name": name, "group": layer_group(name), "norm_rel_err": norm_err, "direction_err": direction,
                     "departs": not (norm_err <= bound and direction <= bound)})
    return rows


def _host(tensors) -> dict[str, torch.Tensor]:
    return {n: t.detach().float().cpu().clone() for n, t in tensors}


def step_one(parts: Parts) -> tuple[float, dict[str, torch.Tensor], list]:
    """Forward and backward of step 1: (loss, unscaled gradients on the host, MoE stats)."""
    result = parts.objective.step(parts.model, 0, parts.guard.scaler)
    parts.guard.scaler.unscale_([p for _, p in parts.params])
    grads = _host((n, p.grad) for n, p in parts.params if p.grad is not None)
    return float(result.loss), grads, result.moe_stats


def optimizer_step(parts: Parts, moe_stats: list) -> None:
    """The optimizer step of step 1 on the gradients in .grad: clipping, update, router bias."""
    params = [p for _, p in parts.params]
    clip_grad_norm(params, parts.recipe.optim.grad_clip)
    apply = torch.ones((), dtype=torch.bool, device=params[0].device)
    parts.optimizer.step(apply=apply)
    gamma = parts.recipe.train.router_bias_gamma()
    if gamma:
        reduce = parts.par.all_reduce_sum if parts.par.distributed else None  # every rank the same update
        update_router_bias(parts.model, moe_stats, gamma, reduce, apply=apply)
    else:
        sum_expert_counts(moe_stats)
    parts.optimizer.zero_grad(set_to_none=True)


def step_two_loss(parts: Parts) -> float:
    """The loss of step 2's forward and backward (the gradients are dropped)."""
    result = parts.objective.step(parts.model, 1, parts.guard.scaler)
    parts.optimizer.zero_grad(set_to_none=True)
    return float(result.loss)


def step_two_with(parts: Parts, grads: dict[str, torch.Tensor], moe_stats: list) -> tuple[float, dict]:
    """Load ``grads`` (the reference's step-1 gradients), take this side's optimizer step (clipping,
    update, router bias), then the step-2 forward: (step-2 loss, per-parameter update on the host)."""
    before = _host(parts.params)
    for name, p in parts.params:
        p.grad = grads[name].to(device=p.device, dtype=p.dtype, copy=True) if name in grads else None
    optimizer_step(parts, moe_stats)
    update = {n: p.detach().float().cpu() - before[n] for n, p in parts.params}
    return step_two_loss(parts), update


# ---- the ladder --------------------------------------------------------------------------------------
@dataclass
class Rung:
    number: int
    name: str
    status: str = "not run"
    """PASS, FAIL or not run (an earlier rung failed)."""
    measures: dict = field(default_factory=dict)
    departure: dict | None = None
    """The first block / parameter / layer group that departs, with its errors."""
    rows: list[dict] = field(default_factory=list)
    """Per block (rung 1) or parameter (rungs 2, 3), in order."""
    report: str | None = None
    """Rungs 4-5: the compare report's JSON."""


def judge_rows(rung: Rung, rows: list[dict], what: str) -> None:
    rung.rows = rows
    departed = [r for r in rows if r["departs"]]
    if departed:
        rung.departure = {what: departed[0]["name"], "group": departed[0].get("group"),
                          **{k: v for k, v in departed[0].items() if k not in ("name", "group", "departs")}}
    worst = max(rows, key=lambda r: max(r["norm_rel_err"], r["direction_err"])) if rows else None
    rung.measures[f"worst_{what}"] = worst["name"] if worst else None
    rung.measures[f"worst_{what}_err"] = max(worst["norm_rel_err"], worst["direction_err"]) if worst else None


def forward_rung(bounds: LadderBounds, loss_ref: float, loss_var: float, out_ref: Tensors, out_var: Tensors) -> Rung:
    rung = Rung(1, RUNGS[0])
    rung.measures = {"loss_reference": loss_ref, "loss_variant": loss_var, "loss_err": loss_error(loss_var, loss_ref)}
    rows = []
    for name in (out_ref.names if isinstance(out_ref, Stats) else out_ref):
        m = agree(out_var, out_ref, name)
        rows.append({"name": name, "cosine": m["cosine"], "max_abs": m["max_abs"], "max_abs_rel": m["max_abs_rel"],
                     "departs": not (m["cosine"] >= bounds.cosine and m["max_abs_rel"] <= bounds.max_abs_rel)})
    rung.rows = rows
    departed = [r for r in rows if r["departs"]]
    if departed:
        rung.departure = {"block": departed[0]["name"], "cosine": departed[0]["cosine"],
                          "max_abs": departed[0]["max_abs"], "max_abs_rel": departed[0]["max_abs_rel"]}
    rung.measures["min_block_cosine"] = min(r["cosine"] for r in rows)
    rung.measures["max_block_abs_rel"] = max(r["max_abs_rel"] for r in rows)
    rung.status = "PASS" if rung.measures["loss_err"] <= bounds.loss and not departed else "FAIL"
    return rung


def train_side(side: Side, recipe: TrainRecipe) -> None:
    """Train ``recipe`` with the training loop, the side's edit applied to its model."""
    if side.edit is None:
        train(recipe)
        return
    dev = device_layer.detect(recipe.train.device or None)
    policy = PrecisionPolicy.resolve(recipe.precision.dtype, dev)
    tokenizer = tokenizer_for(recipe.data.tokenizer)
    train(recipe, model=side.model(recipe, dev, policy, tokenizer), tokenizer=tokenizer)


def judge_loop(number: int, run_dir: str, ref_dir: str, profile: Profile, out: str) -> Rung:
    """Rung 4 or 5: the run in ``run_dir`` against the reference's in ``ref_dir``, by `compare` under
    ``profile``; the compare report goes to ``out``/reports."""
    rung = Rung(number, RUNGS[number - 1])
    result = compare(load_signals(run_dir), load_signals(ref_dir), profile)
    rung.report = write_all(result, os.path.join(out, "reports"), f"rung{number}_{'lr0' if number == 4 else 'run'}")["json"]
    failed = [c for c in result.checks if c.status == "FAIL"]
    rung.measures = {c.measure: c.value for c in result.checks if c.status not in ("off", "n/a")}
    rung.status = result.verdict
    if failed:
        worst_group = max(result.layer_errors, key=result.layer_errors.get) if result.layer_errors else None
        rung.departure = {"failed": [c.measure for c in failed], "layer_group": worst_group,
                          "first_step_outside_band": result.first_step_outside_band}
    return rung


def _loop_rung(number: int, ref: Side, var: Side, profile: Profile, out: str, overrides: list[str],
               recipe_path: str, ref_overrides: list[str], var_overrides: list[str]) -> Rung:
    tag = "lr0" if number == 4 else "run"
    dirs = {}
    for side, side_overrides in ((ref, ref_overrides), (var, var_overrides)):
        run_dir = os.path.join(out, side.name, tag)
        recipe = load(TrainRecipe, recipe_path, [*side_overrides, *overrides, f"train.out={json.dumps(run_dir)}"])
        print(f"[rung {number}: {RUNGS[number - 1]}] {side.name}: {logs.plural(recipe.train.steps, 'step')} -> "
              f"{run_dir}", file=sys.stderr)
        train_side(side, recipe)
        dirs[side.name] = run_dir
    return judge_loop(number, dirs[var.name], dirs[ref.name], profile, out)


def ladder_overrides(recipe_path: str, overrides: list[str], steps: int | None) -> list[str]:
    """``overrides`` and what every side of a ladder adds: ``steps`` (train.steps), enough fidelity
    records, no checkpoints, no resume, no progress bar."""
    over = [*([f"train.steps={steps}"] if steps else []), *overrides]
    return [*over, *signal_overrides(load(TrainRecipe, recipe_path, over)), "checkpoint.save_every=0",
            'checkpoint.resume=""', "train.progress=false"]


def lr0_overrides(recipe_path: str, side_overrides: list[str], lr0_steps: int | None) -> list[str]:
    """What rung 4 adds to a side's overrides: lr = 0, no router-bias update, ``lr0_steps`` steps (default:
    the long run's) and the gradient/probe records that length needs (a rung shorter than the long run's
    ``fidelity.every`` would have none to judge)."""
    steps = [f"train.steps={lr0_steps}"] if lr0_steps else []
    over = ["optim.lr=0", "train.bias_gamma=0", *steps]
    return [*over, *signal_overrides(load(TrainRecipe, recipe_path, [*side_overrides, *over]))]


def run_ladder(recipe_path: str, variant_overrides: list[str], out: str, profile: Profile,
               reference_overrides: list[str] | None = None, lr0_steps: int | None = None,
               steps: int | None = None, edit: Callable[[Model], None] | None = None,
               overwrite: bool = False) -> dict:
    """Climb the ladder; returns the report (also written to ``out``). A non-empty ``out`` is refused
    (ValueError) unless ``overwrite``."""
    if not variant_overrides and edit is None:
        raise ValueError("the ladder needs a variant: --variant SECTION.KEY=VALUE (repeatable)")
    ref_over = ladder_overrides(recipe_path, reference_overrides or [], steps)
    var_over = ladder_overrides(recipe_path, variant_overrides, steps)
    ref_recipe, var_recipe = load(TrainRecipe, recipe_path, ref_over), load(TrainRecipe, recipe_path, var_over)
    for side, recipe in (("reference", ref_recipe), ("variant", var_recipe)):
        layout = recipe.parallel
        try:
            resolve_layout(layout.dp_replicate, layout.dp_shard, layout.ep, 1, layout.cp, layout.tp)
        except ValueError as e:
            raise ValueError(f"the {side}'s layout needs several processes ({e}); the ladder runs both sides in one "
                             "process: compare layouts across processes with `trex fidelity matrix`") from None
    claim_out(out, "a ladder", overwrite)
    ref, var = Side("reference", ref_recipe), Side("variant", var_recipe, edit)
    bounds = profile.ladder
    rungs = [Rung(i + 1, name) for i, name in enumerate(RUNGS)]

    print("[rungs 1-3] forward, backward, optimizer: reference, then variant", file=sys.stderr)
    ref_parts = build_parts(ref)
    out_ref = block_outputs(ref_parts.model, ref_parts.probe)
    loss_ref, grads_ref, stats_ref = step_one(ref_parts)
    loss2_ref, update_ref = step_two_with(ref_parts, grads_ref, stats_ref)
    del ref_parts
    var_parts = build_parts(var)
    out_var = block_outputs(var_parts.model, var_parts.probe)
    loss_var, grads_var, stats_var = step_one(var_parts)

    rungs[0] = forward_rung(bounds, loss_ref, loss_var, out_ref, out_var)
    if rungs[0].status == "PASS":
        backward_order = [n for n, _ in reversed(var_parts.params) if n in grads_ref or n in grads_var]
        judge_rows(rungs[1], tensor_errors(grads_var, grads_ref, backward_order, bounds.grad, bounds.floor),
                    "parameter")
        rungs[1].status = "FAIL" if rungs[1].departure else "PASS"
    if rungs[1].status == "PASS":
        loss2_var, update_var = step_two_with(var_parts, grads_ref, stats_var)
        rung = rungs[2]
        rung.measures = {"loss_reference": loss2_ref, "loss_variant": loss2_var,
                         "loss_err": loss_error(loss2_var, loss2_ref)}
        judge_rows(rung, tensor_errors(update_var, update_ref, [n for n, _ in var_parts.params], bounds.update,
                                        bounds.floor), "parameter")
        rung.status = "PASS" if rung.measures["loss_err"] <= bounds.loss and not rung.departure else "FAIL"
    del var_parts

    for number, overrides in ((4, lr0_overrides(recipe_path, ref_over, lr0_steps)), (5, [])):
        if all(r.status == "PASS" for r in rungs[:number - 1]):
            rungs[number - 1] = _loop_rung(number, ref, var, profile, out, overrides, recipe_path, ref_over, var_over)
    first_failed = next((r for r in rungs if r.status == "FAIL"), None)
    report = {"recipe": recipe_path, "profile": profile.name, "bounds": vars(bounds),
              "reference_overrides": reference_overrides or [], "variant_overrides": variant_overrides,
              "edit": getattr(edit, "__name__", None) if edit else None,
              "verdict": "PASS" if first_failed is None else "FAIL",
              "first_failing_rung": first_failed.number if first_failed else None,
              "devices": {side: device_layer.identity(device_layer.environment_report(device_layer.detect(r.train.device or None)))
                          for side, r in (("reference", ref_recipe), ("run", var_recipe))},
              "rungs": [vars(r) for r in rungs]}
    write_reports(report, out)
    return report


# ---- reports -----------------------------------------------------------------------------------------
def _finite(value):
    """JSON without Infinity/NaN: a non-finite number becomes the string "inf" / "nan"."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def _num(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    return f"{value:.3g}" if abs(value) >= 1e-3 or value == 0 else f"{value:.2e}"


def _said(rung: dict) -> str:
    m = rung["measures"]
    if rung["status"] == "not run":
        return ""
    if rung["number"] == 1:
        return (f"loss err {_num(m['loss_err'])}; worst block 1 - cosine {_num(1 - m['min_block_cosine'])}, "
                f"max-abs err {_num(m['max_block_abs_rel'])} x max|ref|")
    if rung["number"] in (2, 3):
        loss = f"step-2 loss err {_num(m['loss_err'])}; " if "loss_err" in m else ""
        if not m.get("worst_parameter_err"):
            return f"{loss}every parameter's {'gradient' if rung['number'] == 2 else 'update'} exact"
        return f"{loss}worst parameter {m.get('worst_parameter')} ({_num(m.get('worst_parameter_err'))})"
    keys = ("loss_mean_rel_err", "grad_norm_mean_rel_err", "layer_grad_norm_rel_err", "probe_kl")
    return "; ".join(f"{k} {_num(m[k])}" for k in keys if k in m)


def _where(rung: dict) -> str:
    d = rung.get("departure")
    if not d:
        return ""
    if "block" in d:
        return f"block {d['block']} (1 - cosine {_num(1 - d['cosine'])}, max-abs {_num(d['max_abs_rel'])} x max|ref|)"
    if "parameter" in d:
        return (f"parameter {d['parameter']} (group {d['group']}; norm err {_num(d['norm_rel_err'])}, "
                f"1 - cosine {_num(d['direction_err'])})")
    if "start" in d:
        return (f"the starting weight {d['start']} differs from the reference's (norm err {_num(d['norm_rel_err'])}, "
                f"1 - cosine {_num(d['direction_err'])}): another checkpoint or seed")
    return (f"failed {', '.join(d['failed'])}; worst layer group {d['layer_group']}; "
            f"first step outside the band {d['first_step_outside_band']}")


def markdown(report: dict) -> str:
    b = report["bounds"]
    lines = [f"# Fidelity ladder: {report['recipe']}", "",
             f"reference: {' '.join(report['reference_overrides']) or '(the recipe)'}; variant: "
             f"{' '.join(report['variant_overrides']) or '(the recipe)'}"
             + (f" + edit {report['edit']}" if report["edit"] else "") + f"; profile {report['profile']}", "",
             f"bounds of rungs 1-3: loss {b['loss']:g}, block cosine >= {b['cosine']:g}, block max-abs <= "
             f"{b['max_abs_rel']:g} x max|ref|, gradient {b['grad']:g}, update {b['update']:g} (floor {b['floor']:g} "
             "x global norm); rungs 4-5: the profile's thresholds", "",
             "| rung | status | measured | departs at |", "|---|---|---|---|"]
    for r in report["rungs"]:
        lines.append(f"| {r['number']} {r['name']} | {r['status']} | {_said(r)} | {_where(r)} |")
    first = report["first_failing_rung"]
    lines += ["", f"ladder verdict: **{report['verdict']}**"
              + (f" (first failing rung: {first} {RUNGS[first - 1]})" if first else "")]
    return "\n".join(lines)


def plot(report: dict, path: str) -> None:
    """Rung 1: per block, 1 - cosine and the max-abs error against their bounds; rungs 2 and 3: per
    parameter, the larger of its norm and direction errors against the bound (log scales)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rungs = [r for r in report["rungs"][:3] if r["rows"]]
    fig, axes = plt.subplots(max(1, len(rungs)), 1, figsize=(9, 2.8 * max(1, len(rungs))), squeeze=False)
    b = report["bounds"]
    for ax, r in zip(axes[:, 0], rungs):
        rows = r["rows"]
        x = range(len(rows))
        if r["number"] == 1:
            ax.semilogy(x, [max(1 - row["cosine"], 1e-18) for row in rows], "o-", ms=3, label="1 - cosine")
            ax.semilogy(x, [max(row["max_abs_rel"], 1e-18) for row in rows], "s-", ms=3, label="max-abs / max|ref|")
            ax.axhline(max(1 - b["cosine"], 1e-18), color="tab:blue", ls="--", lw=0.8)
            ax.axhline(max(b["max_abs_rel"], 1e-18), color="tab:orange", ls="--", lw=0.8)
            ax.set_xticks(list(x), [row["name"] for row in rows], rotation=90, fontsize=6)
        else:
            errors = [max(row["norm_rel_err"], row["direction_err"]) for row in rows]
            ax.semilogy(x, [min(max(e, 1e-18), 1e6) for e in errors], ".", ms=3, label="max(norm err, 1 - cosine)")
            ax.axhline(max(b["grad" if r["number"] == 2 else "update"], 1e-18), color="tab:red", ls="--", lw=0.8)
            ax.set_xlabel("parameter (" + ("backward order" if r["number"] == 2 else "model order") + ")")
        departed = r["departure"] and (r["departure"].get("block") or r["departure"].get("parameter"))
        if departed:
            ax.axvline([row["name"] for row in rows].index(departed), color="tab:red", lw=1, label="first departure")
        ax.set_title(f"rung {r['number']} {r['name']}: {r['status']}", fontsize=9)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    with atomic.replacing(path, suffix=".png") as tmp:
        fig.savefig(tmp, dpi=100)
    plt.close(fig)


def write_reports(report: dict, out: str) -> dict[str, str]:
    paths = {k: os.path.join(out, f"ladder.{k}") for k in ("json", "md", "png")}
    atomic.write_text(paths["json"], json.dumps(_finite(report), indent=1))
    atomic.write_text(paths["md"], markdown(report) + "\n")
    plot(report, paths["png"])
    return paths
