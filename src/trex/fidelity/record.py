"""The ladder between two clusters: `trex fidelity record` on the reference's, `trex fidelity ladder
--reference` on the candidate's, each in any layout, with nothing but one directory between them.

`trex fidelity record RECIPE --out REF` (every rank of the reference job) measures what the ladder's
rungs judge (trex.fidelity.ladder) and keeps statistics of each tensor (trex.fidelity.sketch), never
the tensor:

  weights    the initial parameters (the candidate must start from the same weights)
  forward    the step-1 loss and every block's output on the probe batch
  backward   every parameter's step-1 gradient
  optimizer  every parameter's update by the optimizer step on a synthetic gradient, and the step-2 loss
  lr0, run   the lr = 0 run and the recipe's run, as run directories (REF/lr0, REF/run)

with the environment (`trex doctor`'s report), the layout, the recipe and the data's fingerprint.

`trex fidelity ladder RECIPE --reference REF [--set ...]` (every rank of the candidate job)
measures the same in its own layout and climbs the rungs against the record, naming the first
departing block or parameter, as the one-process ladder does. Two things differ from it:

* rung 3 (optimizer): the record does not hold the reference's gradients to load, so both sides step
  their optimizer on the same synthetic gradient (trex.fidelity.sketch.fill_synthetic: generated from
  each element's global index at the RMS of the reference's gradient, identical in every layout
  without being sent). Each side's own gradient would not do: Adam's first step is about
  lr x sign(g), so a rounding-sized gradient difference flips signs;
* cosines are estimated by the sketch (relative error sqrt(2/K) on 1 - cosine) and max-abs errors
  are taken over sampled positions; equal checksums make a tensor exactly equal.

Sharded parameters are matched by name and global element index: every layout describes a tensor's
elements by their row-major index in the full tensor, so the sketch of an FSDP2 or expert-parallel
shard sums into the sketch of the whole. The global batch (rows per step) and the data's fingerprint
must be the record's; the micro-batch split and the world size may differ.

Size: :data:`trex.fidelity.sketch.BYTES_PER_TENSOR` bytes per parameter tensor for each of weights,
gradients and updates, and per block output (:func:`record_bytes`), plus the names in record.json
and the two run directories (a few KB a step). Each rank hashes its own shards (about 40 bytes of host memory an
element of one chunk); one all-reduce of the statistics table combines them, and rank 0 writes.
Under context parallelism a block's output is a sequence shard, described at its row offset.
"""

from __future__ import annotations

import json
import math
import os
import sys

import torch
import torch.distributed as dist

from trex import atomic, logs
from trex import device as device_layer
from trex.fidelity.ladder import (RUNGS, Rung, Side, block_outputs, build_parts, forward_rung, judge_loop, judge_rows,
                                  ladder_overrides, loss_error, optimizer_step, step_two_loss, tapped_blocks, tensor_errors,
                                  train_side, write_reports)
from trex.fidelity.matrix import claim_out
from trex.fidelity.profiles import Profile
from trex.fidelity.sketch import (BYTES_PER_TENSOR, SAMPLES, SKETCH, WIDTH, Piece, Stats, fill_synthetic, piece_of,
                                  stats_of)
from trex.models.common.heads import Model
from trex.parallel.mesh import Parallel, init_parallel
from trex.recipe import load
from trex.train.config import TrainRecipe

FORMAT = 1
SETS = ("weights", "blocks", "grads", "updates")
START_BOUND = 1e-2
"""A starting weight departs when its norm or direction differs by more than this: another checkpoint
or seed (rounding to bf16 changes a weight's norm by about 1e-3 and its direction by about 1e-6)."""


def record_bytes(n_params: int, n_blocks: int) -> int:
    """Bytes of a record's statistics (stats.safetensors less its header) for a model of ``n_params``
    parameter tensors and ``n_blocks`` tapped blocks."""
    return BYTES_PER_TENSOR * (3 * n_params + n_blocks)


def model_counts(model: Model) -> dict:
    """Parameter tensors, elements and tapped blocks of ``model`` (works on the meta device)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return {"parameter_tensors": len(params), "parameters": sum(p.numel() for p in params),
            "blocks": len(tapped_blocks(model)) + 1}  # and the logits


# ---- one side, in any layout ----------------------------------------------------------------------------
def _main() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _say(line: str) -> None:
    if _main():
        print(line, file=sys.stderr)


def _shared(value):
    """Rank 0's ``value`` on every rank (itself with one process)."""
    if not (dist.is_available() and dist.is_initialized()):
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _on_main(call):
    """Run ``call`` on rank 0; a ValueError or OSError it raises is raised on every rank."""
    error = None
    if _main():
        try:
            call()
        except (ValueError, OSError) as e:
            error = e
    error = _shared(error)
    if error is not None:
        raise error


def rows_per_step(recipe: TrainRecipe) -> int:
    """The global batch in rows: data-parallel ranks (torchrun's WORLD_SIZE / cp) x micro-batch x accumulation."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return world // recipe.parallel.cp * recipe.data.micro_batch_size * recipe.train.grad_accum


def grad_rms(grads: Stats, numel: dict[str, int]) -> dict[str, float]:
    """Each gradient's root mean square, from its statistics (the synthetic gradients' scale)."""
    at = grads.index()
    return {n: math.sqrt(max(float(grads.table[k, 0]), 0.0) / max(1, numel[n])) for n, k in at.items()}


def _join(recipe: TrainRecipe) -> None:
    """Join the process group of ``recipe``'s layout (torchrun's environment; nothing for one process)."""
    dev = device_layer.detect(recipe.train.device or None)
    dev.set_current()
    layout = recipe.parallel
    init_parallel(layout.dp_replicate, layout.dp_shard, layout.ep, layout.timeout_s, dev, cp=layout.cp, tp=layout.tp,
                  sequence_parallel=layout.sequence_parallel)


def _probe_piece(output: torch.Tensor, seq: int, par: Parallel) -> Piece:
    """A block's output on the probe batch as a piece of the whole [B, seq, ...] output: under context
    parallelism a rank holds rows cp_rank x seq/cp onwards (counted by the cp group of rank 0);
    otherwise every rank holds all of it (counted by rank 0)."""
    if par.cp == 1 or output.dim() < 2 or output.shape[1] == seq:
        return piece_of(output)
    offset = (0, par.cp_rank * output.shape[1], *[0] * (output.dim() - 2))
    return Piece(output, (output.shape[0], seq, *output.shape[2:]), offset, par.data_rank == 0)


def measure(recipe: TrainRecipe, edit=None, rms: dict[str, float] | None = None) -> tuple[dict, dict[str, Stats], dict]:
    """Rungs 1-3 of ``recipe`` in its layout (every rank calls it): the losses of steps 1 and 2, the
    statistics of each set, and the facts a comparison needs (rows per step, the data's fingerprint,
    the layout, the device). The optimizer step takes synthetic gradients (sketch.fill_synthetic) of
    the RMS ``rms`` gives per parameter (the record's; by default this side's own gradients')."""
    layout = recipe.parallel
    parts = build_parts(Side("side", recipe, edit))
    dev = device_layer.detect(recipe.train.device or None)
    on = dev.torch_device
    seq = parts.probe.input_ids.shape[1]
    sets = {"weights": stats_of(parts.params, on),
            "blocks": stats_of([(n, _probe_piece(t, seq, parts.par))
                                for n, t in block_outputs(parts.model, parts.probe).items()], on)}
    result = parts.objective.step(parts.model, 0, parts.guard.scaler)
    parts.guard.scaler.unscale_([p for _, p in parts.params])
    sets["grads"] = stats_of([(n, p.grad) for n, p in parts.params if p.grad is not None], on)
    numel = {n: p.numel() for n, p in parts.params}
    rms = rms if rms is not None else grad_rms(sets["grads"], numel)
    for name, p in parts.params:  # the optimizer's input: the same on every side, whatever its layout
        if p.grad is not None and name in rms:
            fill_synthetic(name, piece_of(p.grad), rms[name])
    before = {}
    for name, p in parts.params:
        piece = piece_of(p.detach())
        before[name] = Piece(piece.local.float().cpu().clone(), piece.shape, piece.offset, piece.counted)
    optimizer_step(parts, result.moe_stats)
    sets["updates"] = stats_of([(n, Piece(piece_of(p.detach()).local.float().cpu() - before[n].local, before[n].shape,
                                          before[n].offset, before[n].counted)) for n, p in parts.params], on)
    losses = {"step1": float(result.loss), "step2": step_two_loss(parts)}
    world = dist.get_world_size() if dist.is_initialized() else 1
    facts = {"rows_per_step": rows_per_step(recipe), "data": parts.objective.preflight().get("data"), "world_size": world,
             "layout": {k: getattr(layout, k) for k in ("dp_replicate", "dp_shard", "ep", "cp")},
             "micro_batch_size": recipe.data.micro_batch_size, "grad_accum": recipe.train.grad_accum,
             "precision": recipe.precision.dtype, "model": model_counts(parts.model), "numel": numel,
             "environment": device_layer.environment_report(dev)}
    facts["devices"] = device_layer.identity(facts["environment"])
    del parts
    return losses, sets, facts


def _train_run(recipe_path: str, overrides: list[str], out: str, edit=None) -> None:
    recipe = load(TrainRecipe, recipe_path, [*overrides, f"train.out={json.dumps(out)}"])
    _say(f"[{os.path.basename(out)}] {logs.plural(recipe.train.steps, 'step')} -> {out}")
    train_side(Side("side", recipe, edit), recipe)


def _lr0(steps: int) -> list[str]:
    return ["optim.lr=0", "train.bias_gamma=0", f"train.steps={steps}"]


# ---- the record -----------------------------------------------------------------------------------------
def record(recipe_path: str, out: str, overrides: list[str] | None = None, steps: int | None = None,
           lr0_steps: int | None = None, overwrite: bool = False) -> dict:
    """Record the reference side of every rung into ``out`` (every rank calls it; rank 0 writes).
    Returns record.json's content."""
    over = ladder_overrides(recipe_path, overrides or [], steps)
    recipe = load(TrainRecipe, recipe_path, over)
    _join(recipe)
    _on_main(lambda: claim_out(out, "a fidelity record", overwrite))
    _say("[record] rungs 1-3: weights, forward, backward, optimizer")
    losses, sets, facts = measure(recipe)
    lr0 = lr0_steps or recipe.train.steps
    _train_run(recipe_path, [*over, *_lr0(lr0)], os.path.join(out, "lr0"))
    _train_run(recipe_path, over, os.path.join(out, "run"))
    manifest = {"format": FORMAT, "kind": "ladder", "recipe": recipe_path, "overrides": list(overrides or []),
                "sketch": {"buckets": SKETCH, "samples": SAMPLES, "bytes_per_tensor": BYTES_PER_TENSOR},
                "losses": losses, "steps": {"lr0": lr0, "run": recipe.train.steps}, **facts,
                "sets": {k: v.names for k, v in sets.items()}}
    if _main():
        from safetensors.torch import save_file

        tensors = {}
        for k, v in sets.items():
            tensors[f"{k}.table"], tensors[f"{k}.checksums"] = v.table.contiguous(), v.checksums.contiguous()
        with atomic.replacing(os.path.join(out, "stats.safetensors"), suffix=".safetensors") as tmp:
            save_file(tensors, tmp)
        atomic.write_json(os.path.join(out, "record.json"), manifest, indent=1)  # last: a record is complete
    return manifest


def checkpoint_step(checkpoint: str) -> int:
    """The step a trex checkpoint directory was saved at (its manifest's)."""
    from trex.checkpoint.manifest import MANIFEST

    try:
        with open(os.path.join(checkpoint, MANIFEST), encoding="utf-8") as f:
            return int(json.load(f)["step"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"--from-checkpoint {checkpoint}: not a complete trex checkpoint ({e})") from None


def record_continuation(recipe_path: str, checkpoint: str, out: str, overrides: list[str] | None = None,
                        steps: int = 3, overwrite: bool = False) -> dict:
    """A seam's reference (every rank calls it; rank 0 writes): ``recipe_path`` resumed from
    ``checkpoint`` for ``steps`` steps in this job's layout, into ``out``/continuation. Returns
    record.json's content."""
    step = checkpoint_step(checkpoint)
    over = [*(overrides or []), f"checkpoint.resume={json.dumps(os.path.abspath(checkpoint))}",
            f"train.steps={step + steps}", "checkpoint.save_every=0", "train.progress=false", "train.overwrite=true"]
    recipe = load(TrainRecipe, recipe_path, over)
    _join(recipe)
    _on_main(lambda: claim_out(out, "a fidelity record", overwrite))
    _train_run(recipe_path, over, os.path.join(out, "continuation"))
    dev = device_layer.detect(recipe.train.device or None)
    environment = device_layer.environment_report(dev)
    manifest = {"format": FORMAT, "kind": "continuation", "recipe": recipe_path, "overrides": list(overrides or []),
                "checkpoint": os.path.abspath(checkpoint), "step": step, "steps": steps,
                "world_size": dist.get_world_size() if dist.is_initialized() else 1,
                "layout": {k: getattr(recipe.parallel, k) for k in ("dp_replicate", "dp_shard", "ep", "cp")},
                "precision": recipe.precision.dtype, "environment": environment,
                "devices": device_layer.identity(environment)}
    if _main():
        atomic.write_json(os.path.join(out, "record.json"), manifest, indent=1)
    return manifest


class RecordError(ValueError):
    """A record directory that cannot be used: names the file and what was expected."""


def read_manifest(path: str, kind: str) -> dict:
    """A record directory's record.json, checked: the format and the ``kind`` ("ladder": the rungs;
    "continuation": a seam's reference, made with --from-checkpoint)."""
    file = os.path.join(path, "record.json")
    try:
        with open(file, encoding="utf-8") as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise RecordError(f"{file}: not found; expected the --out of `trex fidelity record` (a record is complete "
                          "once record.json is written)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RecordError(f"{file}: unreadable ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise RecordError(f"{file}: record format {manifest.get('format') if isinstance(manifest, dict) else None}; "
                          f"this trex reads format {FORMAT}: record the reference again")
    if manifest.get("kind", "ladder") != kind:
        raise RecordError(f"{file}: a record of {'a continuation (--from-checkpoint)' if kind == 'ladder' else 'the ladder'}"
                          f"; this needs {'the ladder' if kind == 'ladder' else 'a continuation'}: record it "
                          + ("without --from-checkpoint" if kind == "ladder" else "with --from-checkpoint CHECKPOINT"))
    return manifest


def continuation_of(path: str, step: int) -> str:
    """The continuation run directory of record ``path``, which must start at ``step``."""
    manifest = read_manifest(path, "continuation")
    if manifest["step"] != step:
        raise RecordError(f"{os.path.join(path, 'record.json')}: continues the checkpoint of step {manifest['step']} "
                          f"({manifest['checkpoint']}); the move is at step {step}")
    return os.path.join(path, "continuation")


def read_record(path: str) -> tuple[dict, dict[str, Stats]]:
    """record.json and the statistics of a ladder record, checked: the format, and exactly the
    tensors record.json promises (names, dtypes, shapes); nothing else is read."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    manifest = read_manifest(path, "ladder")
    if manifest.get("sketch", {}).get("buckets") != SKETCH or manifest["sketch"].get("samples") != SAMPLES:
        raise RecordError(f"{os.path.join(path, 'record.json')}: sketched with {manifest.get('sketch')}; this trex sketches {SKETCH} buckets and "
                          f"{SAMPLES} samples")
    stats_file = os.path.join(path, "stats.safetensors")
    try:
        tensors = load_file(stats_file)
    except (OSError, SafetensorError) as e:
        raise RecordError(f"{stats_file}: unreadable ({e}); copy the record again") from None
    want = {f"{k}.{part}" for k in SETS for part in ("table", "checksums")}
    if set(tensors) != want:
        raise RecordError(f"{stats_file}: holds {sorted(tensors)}; expected {sorted(want)}")
    sets = {}
    for k in SETS:
        names = manifest["sets"][k]
        table, sums = tensors[f"{k}.table"], tensors[f"{k}.checksums"]
        if table.dtype != torch.float64 or tuple(table.shape) != (len(names), WIDTH) or sums.dtype != torch.int64 \
                or tuple(sums.shape) != (len(names),):
            raise RecordError(f"{stats_file}: {k} is {table.dtype} {tuple(table.shape)}; expected float64 "
                              f"({len(names)}, {WIDTH}) as record.json lists")
        sets[k] = Stats(names, table, sums)
    for tag in ("lr0", "run"):
        if not os.path.isfile(os.path.join(path, tag, "metrics.jsonl")):
            raise RecordError(f"{os.path.join(path, tag, 'metrics.jsonl')}: not found; the record is incomplete")
    return manifest, sets


# ---- the ladder against a record ------------------------------------------------------------------------
def _check_batch(ref: dict, recipe: TrainRecipe, reference: str) -> None:
    if ref["rows_per_step"] != rows_per_step(recipe):
        raise ValueError(f"the record ({reference}) takes {ref['rows_per_step']} rows a step "
                         f"({ref['world_size']} ranks x data.micro_batch_size {ref['micro_batch_size']} x "
                         f"train.grad_accum {ref['grad_accum']}); this layout takes {rows_per_step(recipe)}: "
                         "set data.micro_batch_size or train.grad_accum so the global batch is the same")


def _check_data(ref: dict, facts: dict, reference: str) -> None:
    if ref.get("data") != facts.get("data"):
        raise ValueError(f"the data differ from the record's ({reference}): fingerprint {facts.get('data')}, "
                         f"the record has {ref.get('data')}: point data.paths at a copy of the reference's data")


def _start_departure(weights: Stats, ref_weights: Stats) -> dict | None:
    """The first starting weight that departs by more than START_BOUND, or None."""
    rows = tensor_errors(weights, ref_weights, ref_weights.names, START_BOUND, 0.0)
    bad = next((r for r in rows if r["departs"]), None)
    return None if bad is None else {"start": bad["name"], "norm_rel_err": bad["norm_rel_err"],
                                     "direction_err": bad["direction_err"]}


def climb(recipe_path: str, reference: str, out: str, profile: Profile, variant_overrides: list[str] | None = None,
          edit=None, overwrite: bool = False) -> dict:
    """Climb the ladder against the record in ``reference`` (every rank calls it; rank 0 reads the
    record and writes the report in ``out``). Returns the report on every rank."""
    _join(load(TrainRecipe, recipe_path, variant_overrides or []))
    got = None
    if _main():
        try:
            got = read_record(reference)
        except ValueError as e:
            got = e
    got = _shared(got)
    if isinstance(got, Exception):
        raise got
    ref, ref_sets = got
    over = [*ladder_overrides(recipe_path, variant_overrides or [], ref["steps"]["run"])]
    recipe = load(TrainRecipe, recipe_path, over)
    _check_batch(ref, recipe, reference)
    _on_main(lambda: claim_out(out, "a ladder", overwrite))
    _say(f"[rungs 1-3] against the record {reference}")
    losses, sets, facts = measure(recipe, edit, grad_rms(ref_sets["grads"], ref["numel"]))
    _check_data(ref, facts, reference)
    bounds = profile.ladder
    rungs = [Rung(i + 1, name) for i, name in enumerate(RUNGS)]
    if _main():
        start = _start_departure(sets["weights"], ref_sets["weights"])
        rungs[0] = forward_rung(bounds, ref["losses"]["step1"], losses["step1"], ref_sets["blocks"], sets["blocks"])
        if start:
            rungs[0].status, rungs[0].departure = "FAIL", start
        if rungs[0].status == "PASS":
            order = list(reversed(ref_sets["weights"].names))
            judge_rows(rungs[1], tensor_errors(sets["grads"], ref_sets["grads"],
                                               [n for n in order if n in ref_sets["grads"] or n in sets["grads"]],
                                               bounds.grad, bounds.floor), "parameter")
            rungs[1].status = "FAIL" if rungs[1].departure else "PASS"
        if rungs[1].status == "PASS":
            rung = rungs[2]
            rung.measures = {"loss_reference": ref["losses"]["step2"], "loss_variant": losses["step2"],
                             "loss_err": loss_error(losses["step2"], ref["losses"]["step2"])}
            judge_rows(rung, tensor_errors(sets["updates"], ref_sets["updates"], ref_sets["updates"].names,
                                           bounds.update, bounds.floor), "parameter")
            rung.status = "PASS" if rung.measures["loss_err"] <= bounds.loss and not rung.departure else "FAIL"
    rungs[:3] = _shared(rungs[:3])
    for number, extra in ((4, _lr0(ref["steps"]["lr0"])), (5, [])):
        if all(r.status == "PASS" for r in rungs[:number - 1]):
            tag = "lr0" if number == 4 else "run"
            _train_run(recipe_path, [*over, *extra], os.path.join(out, tag), edit)
            if _main():
                rungs[number - 1] = judge_loop(number, os.path.join(out, tag), os.path.join(reference, tag), profile, out)
            rungs[number - 1] = _shared(rungs[number - 1])
    first_failed = next((r for r in rungs if r.status == "FAIL"), None)
    report = {"recipe": recipe_path, "profile": profile.name, "bounds": vars(bounds),
              "reference_overrides": [f"record {reference}"] + ref["overrides"],
              "variant_overrides": list(variant_overrides or []),
              "edit": getattr(edit, "__name__", None) if edit else None,
              "verdict": "PASS" if first_failed is None else "FAIL",
              "first_failing_rung": first_failed.number if first_failed else None,
              "devices": {"reference": ref["devices"], "run": facts["devices"]},
              "layouts": {"reference": {**ref["layout"], "world_size": ref["world_size"]},
                          "run": {**facts["layout"], "world_size": facts["world_size"]}},
              "reference": os.path.abspath(reference),
              "rungs": [vars(r) for r in rungs]}
    if _main():
        write_reports(report, out)
    return report
