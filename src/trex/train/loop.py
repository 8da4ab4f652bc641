"""The training loop: full-parameter training of a DeepSeek-V4 model in any `[train] mode`.

One loop serves every mode; what differs is the mode's Objective (trex.posttrain): SFT/CPT
next-token loss, DPO, GRPO, distillation. One step, as in the algorithm (trex.train.step):

    objective.step: forward and backward of the step's micro-batches (gradients in .grad, scaled)
    unscale (fp16), measure and clip the global grad norm
    if loss and norm are finite: optimizer step, then the aux-loss-free router bias update
    else: leave every state unchanged (decided on the device, no host wait)
    one host read of the step's scalars; count a skipped step (N consecutive skips stop the run)
    advance the LR schedule; log; objective.evaluate now and then

Everything a run writes lands in its run directory (see trex.train.run_dir).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import tomllib
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from trex import device as device_layer
from trex import kernels
from trex import logs
from trex import recipe as recipe_io
from trex.checkpoint import load_pretrained
from trex.checkpoint.manifest import TRAINER_STATE
from trex.checkpoint.migration import configuration, migration
from trex.checkpoint.migration import describe as describe_move
from trex.checkpoint.migration import record as record_moves
from trex.checkpoint.training import Checkpointer, RunState
from trex.data import load_tokenizer
from trex.data.tokenizer import Tokenizer, compact_tokenizer
from trex.hardware import profile_for_device_name
from trex.models import build_model, get_preset
from trex.models.common.heads import Model
from trex.models.flops import flops_per_token
from trex.models.registry import architecture, check_shardable, with_overrides
from trex.parallel.load import load_sharded
from trex.parallel.mesh import Parallel, init_parallel
from trex.parallel.plan import apply_parallelism
from trex.parallel.preflight import preflight
from trex.parallel.watchdog import Heartbeat
from trex.posttrain import Objective, TrainContext, build_objective
from trex.posttrain.objective import reshard
from trex.posttrain.sft import accumulate_gradients
from trex.precision import DynamicLossScaler, NonFiniteError, PrecisionPolicy, StepGuard
from trex.rollout.engine import EngineDied
from trex.train.config import TrainRecipe
from trex.train.drafter_refit import JobRefit
from trex.train.drafters.mtp import hold_mtp
from trex.train.dry_run import model_config
from trex.train.moe_balance import freeze_for_post_training
from trex.train.optim import build_optimizer
from trex.train.progress import StepProgress
from trex.train.run_dir import METRICS_FILE, RunDir
from trex.train.schedule import build_scheduler
from trex.train.signals import SIGNAL_FILES, FidelityRecorder
from trex.train.step import read_scalars, train_step
from trex.train.trackers import Trackers, flatten

__all__ = ["TrainResult", "train", "accumulate_gradients", "model_for", "prepare_model", "tokenizer_for"]

log = logging.getLogger(__name__)


class Terminated(SystemExit):
    """A run stopped by SIGTERM after its step: the checkpoint, summary.json and loss.png written, it exits
    128 + SIGTERM as the signal would. ``step``: the main steps completed; ``saved``: the checkpoint the stop
    wrote (the main loop's, or the drafter re-fit phase's it interrupted); ``run_dir``: the run directory."""

    def __init__(self, step: int, saved: str, run_dir: str):
        super().__init__(128 + signal.SIGTERM)
        self.step, self.saved, self.run_dir = step, saved, run_dir


@dataclass
class TrainResult:
    model: Model
    tokenizer: Tokenizer
    summary: dict
    run_dir: str


# ---- set-up -----------------------------------------------------------------------------------------
def tokenizer_for(spec: str) -> Tokenizer:
    return compact_tokenizer() if spec == "compact" else load_tokenizer(spec)


def model_for(recipe: TrainRecipe, tokenizer: Tokenizer, dev: device_layer.Device,
              policy: PrecisionPolicy) -> Model:
    section = recipe.model
    if section.path:
        model = load_pretrained(section.path, dtype=policy.param_dtype, device=dev.name, overrides=section.overrides)
    else:
        cfg = get_preset(section.preset)
        overrides = dict(section.overrides)
        overrides.setdefault("vocab_size", -(-tokenizer.vocab_size // 8) * 8)  # a preset fits its tokenizer
        hook = architecture(cfg).load("tokenizer_map")
        token_map = hook(cfg, tokenizer.backend) if hook else None
        if token_map:  # the model hashes token ids through this tokenizer's compressed ids (V4.1's Engram)
            for field, value in token_map.overrides.items():
                overrides.setdefault(field, value)
        cfg = with_overrides(cfg, overrides)
        model = build_model(cfg, device=dev.torch_device, dtype=policy.param_dtype, seed=section.init_seed)
        if token_map:
            model.set_engram_token_map(token_map.token_map, token_map.compressed_vocab)
    check_vocab(model, tokenizer)
    return model


def keep_recorded_packing(recipe: TrainRecipe) -> TrainRecipe:
    """``data.packing = "auto"`` resolved: a run that resumes keeps the packing its checkpoint's recipe
    (``checkpoint.resume = PATH``) or its run directory's config.toml (``auto``) recorded, so its
    loader position counts the rows it was trained on; anything else gets best_fit."""
    if recipe.data.packing != "auto":
        return recipe
    spec, recorded = recipe.checkpoint.resume, None
    try:
        if spec and spec != "auto":
            with open(os.path.join(spec, TRAINER_STATE)) as f:
                recorded = ((json.load(f).get("config") or {}).get("data") or {}).get("packing")
        elif spec:
            with open(os.path.join(recipe.train.out, "config.toml"), "rb") as f:
                recorded = tomllib.load(f).get("data", {}).get("packing")
    except (OSError, ValueError):  # nothing recorded (a fresh run directory): the checkpoint check speaks
        recorded = None
    packing = recorded if recorded in ("next_fit", "best_fit") else "best_fit"
    if recorded == "next_fit":
        log.info("data.packing = auto: next_fit, as the resumed run recorded (a new run packs best_fit)")
    return dataclasses.replace(recipe, data=dataclasses.replace(recipe.data, packing=packing))


def check_vocab(model: Model, tokenizer: Tokenizer) -> None:
    if model.cfg.vocab_size < tokenizer.vocab_size:
        raise ValueError(f"tokenizer {tokenizer.source} has {tokenizer.vocab_size} ids but the model's vocab_size "
                         f"is {model.cfg.vocab_size}")


def peak_flops(dev: device_layer.Device, policy: PrecisionPolicy) -> tuple[float | None, str]:
    """The MFU denominator: from the hardware profiles on accelerators; on CPU the best matmul rate
    this machine has shown (`trex.device.cached_peak_flops`), rank 0's value on every rank."""
    dtype = str(policy.compute_dtype).replace("torch.", "").replace("bfloat16", "bf16").replace(
        "float16", "fp16").replace("float32", "fp32")
    if not dev.is_accelerator:
        found = [device_layer.cached_peak_flops(dev, policy.compute_dtype)]
        if dist.is_initialized():
            dist.broadcast_object_list(found, src=0)
        return found[0]
    name = device_layer.environment_report(dev).get("device_name", dev.type)
    profile = profile_for_device_name(name)
    if profile is None:
        log.warning("no hardware profile matches %r: MFU is not reported (add one, see docs/mfu.md)", name)
        return None, "unknown device"
    return profile.peak_flops(dtype), f"{profile.name} {dtype} per {profile.unit}"


def fidelity_recorder(recipe: TrainRecipe, objective: Objective, run_path: str, tokenizer: Tokenizer,
                      device: torch.device, first: int, last: int | None = -1) -> FidelityRecorder:
    """The recorder of steps ``first + 1`` to ``last`` (-1: ``train.steps``; None: any step). The probe batch comes from [fidelity]
    probe_paths or the SFT/CPT data; other modes' data are not next-token rows, so without
    probe_paths their objective supplies it. It is made only if one of those steps records it."""
    section = recipe.fidelity
    last = recipe.train.steps if last == -1 else last
    if recipe.train.mode == "sft" or section.probe_paths:
        return FidelityRecorder.for_recipe(recipe, run_path, tokenizer, device, first, last)
    return FidelityRecorder(section, run_path, lambda: objective.probe_batch(section.probe_rows), device, first, last)


class CompiledGraphs:
    """How many graphs torch.compile built (blocks of one kind share one): after the first step of the
    run and in all. A recompile-free run has the same count from the first step on, whatever the
    packing of later micro-batches."""

    def __init__(self, backend: str | None):
        self.backend = backend
        self.enabled = backend is not None
        self.start = self._count() if self.enabled else 0
        self.first_step: int | None = None

    @staticmethod
    def _count() -> int:
        from torch._dynamo.utils import counters

        return counters["stats"]["unique_graphs"]

    def after_step(self) -> None:
        if self.enabled and self.first_step is None:
            self.first_step = self._count() - self.start

    def summary(self) -> dict:
        if not self.enabled:
            return {"enabled": False}
        return {"enabled": True, "backend": self.backend, "graphs_after_first_step": self.first_step,
                "graphs": self._count() - self.start}


def check_indexer_stage(m: Model, recipe: TrainRecipe) -> None:
    """ValueError unless ``m`` (built, or on the meta device before the run directory is made) has what
    ``train.indexer_warmup`` and ``train.indexer_loss`` train: a dense warm-up stage (DeepSeek-V3.2), a lightning
    indexer alignment (V4's CSA layers, V3.2's attention)."""
    if recipe.train.indexer_warmup and not hasattr(m, "dense_warmup"):
        raise ValueError(f"train.indexer_warmup: {m.cfg.architecture} has no dense warm-up stage (DeepSeek-V3.2 has)")
    if recipe.train.indexer_loss > 0 and not (hasattr(m, "align_indexer")
                                              and any(n.endswith(".indexer") for n, _ in m.named_modules())):
        raise ValueError(f"train.indexer_loss: {m.cfg.architecture} has no lightning indexer alignment to train "
                         "(DeepSeek-V4's CSA layers and V3.2's attention have one); set it to 0")


def prepare_model(m: Model, recipe: TrainRecipe, par: Parallel, policy: PrecisionPolicy,
                  compile_backend: str | None) -> list[str]:
    """Make a built (or loaded) model the run's student: cast, indexer frozen or aligned, QAT
    simulation set, the parallel plan applied; returns the names of the frozen parameters. One
    process holds parameters in the policy's dtype; sharded runs keep fp32 shards (the master
    weights) and let FSDP cast to the compute dtype."""
    m.to(dtype=torch.float32 if par.distributed else policy.param_dtype).train()
    check_indexer_stage(m, recipe)
    warmup = recipe.train.indexer_warmup
    frozen = freeze_for_post_training(m, recipe.train.freeze_indexer, recipe.train.engram, recipe.train.router_frozen(),
                                      only_indexer=warmup)
    frozen += hold_mtp(m, recipe)  # [drafter] on MTP modules in DPO / GRPO / distillation: only the re-fit moves them
    m.set_quant(recipe.precision.quant_sim())
    m.align_indexer = recipe.train.indexer_loss > 0
    if warmup:
        m.dense_warmup = True  # DeepSeek-V3.2's dense warm-up: dense attention, the indexer fitted to it
    layout = recipe.parallel
    apply_parallelism(m, par, policy, layout.activation_checkpointing, layout.reduce_every_micro_batch,
                      compile=compile_backend)
    return frozen


# ---- the loop ---------------------------------------------------------------------------------------
class StepObserver(Protocol):
    """Watches a run from outside (``trex profile``): ``started`` once set-up is done, before step 1;
    ``stepped`` after each step with that step's metrics line (``metrics.jsonl``'s fields)."""

    def started(self, model: nn.Module, dev: device_layer.Device) -> None: ...

    def stepped(self, step: int, metrics: dict) -> None: ...


def train(recipe: TrainRecipe, model: Model | None = None, tokenizer: Tokenizer | None = None,
          observer: StepObserver | None = None) -> TrainResult:
    """Run ``recipe``; ``model``/``tokenizer`` continue from a previous stage instead of [model]/[data].
    Set-up, the steps, the summary; the status becomes the exception a CLI maps to its exit code."""
    with Heartbeat(recipe.parallel.heartbeat_timeout_s) as heartbeat, logs.Recorded() as recorded:
        t_start = time.perf_counter()
        r = _set_up(recipe, model, tokenizer, heartbeat)
        r.warnings, r.observer = recorded, observer
        if observer is not None:
            observer.started(r.model, r.dev)
        try:
            _run_steps(r)
        except Exception as e:  # the run directory says how the run ended, the CLI says it in one line
            _record_failure(r, e, time.perf_counter() - t_start)
            raise
        _warn_at_end(r)
        summary = _summary(r, time.perf_counter() - t_start)
        r.run_dir.write_summary(summary)
        summary["trackers"] = r.run_dir.trackers.finish(_tracker_tags(summary), r.run_dir.file("summary.json"))
        if summary["trackers"]:  # the trackers' own record: what each holds and the steps it missed
            r.run_dir.write_summary(summary)
        r.run_dir.plot_loss()
        r.run_dir.close()
        if r.status.startswith("stopped"):
            raise NonFiniteError(r.status)
        if r.status == "interrupted":
            raise KeyboardInterrupt
        if r.status == "terminated":
            stoppers = [r.ckpt] + ([r.refit.refit.ckpt] if r.refit is not None else [])
            raise Terminated(r.scheduler.last_epoch, next((c.stop_checkpoint for c in stoppers if c.stop_checkpoint),
                                                          ""), str(r.run_dir.path))
        return TrainResult(model=r.model, tokenizer=r.tokenizer, summary=summary, run_dir=r.run_dir.path)


@dataclass
class _Run:
    """What a run holds from set-up to summary, and what the steps accumulate."""

    recipe: TrainRecipe
    dev: device_layer.Device
    par: Parallel
    policy: PrecisionPolicy
    run_dir: RunDir
    heartbeat: Heartbeat
    tokenizer: Tokenizer
    model: Model
    frozen: list[str]
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    guard: StepGuard
    objective: Objective
    fidelity: FidelityRecorder
    ckpt: Checkpointer
    resumed: Any
    graphs: CompiledGraphs
    flops: float  # model FLOPs per token (trex.models.flops)
    peak: float | None  # the MFU denominator per rank, FLOP/s
    peak_source: str
    tokens: int = 0
    status: str = "completed"
    events: list = field(default_factory=list)  # why steps were skipped
    last: dict = field(default_factory=dict)  # the last step's metrics
    evals: dict = field(default_factory=dict)  # held-out metrics by step ("final" at the end)
    mfu_warned: bool = False
    moves: list = field(default_factory=list)  # migrations.jsonl: where the run changed device, precision, layout
    refit: JobRefit | None = None  # [drafter]: the drafter's re-fit
    warnings: logs.Recorded | None = None  # every warning the run logged (summary.json's "warnings")
    observer: StepObserver | None = None


def _set_up(recipe: TrainRecipe, model: Model | None, tokenizer: Tokenizer | None,
            heartbeat: Heartbeat) -> _Run:
    """Device, process group, model (built, loaded or loaded into shards) under the parallel plan,
    optimizer, schedule, step guard, objective, fidelity recorder, checkpointer (resumed if asked),
    and the run directory, checked for room before step 1."""
    recipe = keep_recorded_packing(recipe)
    cfg_train = recipe.train
    if recipe.model.path and not os.path.isfile(os.path.join(recipe.model.path, "config.json")):
        raise ValueError(f"model.path = {recipe.model.path!r}: no model there (expected config.json and safetensors: "
                         "the model/ of an earlier trex train job, or `trex ckpt export` output); if the recipe "
                         "starts from another run's model, its header says which command makes it")
    layout = recipe.parallel
    cfg_model = (model.cfg if model is not None else model_config(recipe)) if layout.cp > 1 else None
    dev = device_layer.detect(cfg_train.device or None)
    dev.set_current()
    kernels.prepare(dev.type)  # the fast paths' probes, before step 1
    par = init_parallel(layout.dp_replicate, layout.dp_shard, layout.ep, layout.timeout_s, dev,
                        trace_dir=os.path.join(cfg_train.out, "flight_recorder"), cp=layout.cp, tp=layout.tp,
                        sequence_parallel=layout.sequence_parallel)
    heartbeat.start()
    dev.manual_seed(cfg_train.seed)  # the same on every rank: identical initial weights
    compile_backend = cfg_train.compile_with(dev)
    policy = PrecisionPolicy.resolve(recipe.precision.dtype, dev)
    if cfg_train.indexer_loss > 0 or cfg_train.indexer_warmup:  # refused before the run directory exists
        check_indexer_stage(model if model is not None else build_model(model_config(recipe), "meta"), recipe)
    run_dir = RunDir(cfg_train.out, enabled=par.is_main)
    heartbeat.on_lost = lambda message: run_dir.write_summary({"status": f"stopped: {message}", "steps_completed": 0})

    tokenizer = tokenizer or tokenizer_for(recipe.data.tokenizer)
    frozen: list[str] = []

    def prepare(m: Model) -> None:
        frozen.extend(prepare_model(m, recipe, par, policy, compile_backend))

    if layout.cp > 1:  # every row of SFT/CPT and DPO is data.seq_len long
        try:
            check_shardable(cfg_model, recipe.data.seq_len, layout.cp)
        except ValueError as e:
            raise ValueError(f"data.seq_len = {recipe.data.seq_len} with parallel.cp = {layout.cp}: {e}") from None
    if model is None and recipe.model.path and par.distributed:
        model = load_sharded(recipe.model.path, prepare, dev.torch_device,  # each rank reads its shards
                             overrides=recipe.model.overrides)
        check_vocab(model, tokenizer)
    else:
        model = model if model is not None else model_for(recipe, tokenizer, dev, policy)
        prepare(model)
    optimizer = build_optimizer(model, recipe.optim, dev)
    head, _, groups = optimizer.describe_groups().partition("\n")
    log.info("%s (the groups: train.log, or TREX_LOG_LEVEL=DEBUG)", head)
    log.debug("optimizer groups:\n%s", groups)
    scheduler = build_scheduler(optimizer, recipe.schedule, cfg_train.steps)
    heartbeat.on_lost = lambda message: run_dir.write_summary({"status": f"stopped: {message}",
                                                               "steps_completed": scheduler.last_epoch})
    guard = StepGuard(recipe.precision.max_consecutive_skips, DynamicLossScaler.from_config(recipe.precision, policy))
    # built before resume: a reference taken from the student is the initial policy
    objective = build_objective(cfg_train.mode, TrainContext(recipe, par, dev, policy, tokenizer, model))
    preflight(par, {"mode": cfg_train.mode, "steps": cfg_train.steps, "grad_accum": cfg_train.grad_accum,
                    **objective.preflight()})
    peak, peak_source = peak_flops(dev, policy)

    ckpt = Checkpointer(recipe.checkpoint, cfg_train.out, RunState(model, optimizer, scheduler, guard, objective, dev),
                        config=recipe_io.to_dict(recipe), precision=policy.to_dict(),
                        tokenizer=tokenizer.backend.to_str())  # an export writes it with the model
    ckpt.check_writable()  # a run that will save finds out now, not at its first save
    resumed = ckpt.resume()
    # --resume auto before the run's first save continues it from step 0: what it logged is trained again
    start = resumed.step if resumed else (0 if recipe.checkpoint.resume == "auto" else None)
    fidelity = fidelity_recorder(recipe, objective, run_dir.path, tokenizer, dev.torch_device, start or 0)  # rank 0 writes
    run_dir.check_room(cfg_train.steps)
    run_dir.begin(start, cfg_train.overwrite, [METRICS_FILE, *SIGNAL_FILES], ckpt.directory)
    run_dir.save_config(recipe)
    moves = _record_move(resumed, run_dir, cfg_train.out, configuration(
        dev.type, policy.name, par.world_size, recipe_io.to_dict(recipe)))
    refit = None
    if recipe.drafter.enabled:  # after the resume (the re-fit's own follows it) and the run directory's start
        refit = JobRefit(recipe, model, tokenizer, par, dev, policy, cfg_train.out, recipe_io.to_dict(recipe))
        refit.start(model, resumed.step if resumed else None)
        reshard(model)
    run_dir.trackers = Trackers(recipe.logging, run_dir.path, par.is_main)
    run_dir.trackers.start(start is not None, {**flatten(recipe_io.to_dict(recipe)), "run_dir": os.path.abspath(
        run_dir.path), **flatten(device_layer.environment_report(dev), "env.")})
    return _Run(recipe, dev, par, policy, run_dir, heartbeat, tokenizer, model, frozen, optimizer, scheduler, guard,
                objective, fidelity, ckpt, resumed, CompiledGraphs(compile_backend),
                flops_per_token(model.cfg, recipe.data.seq_len).total, peak, peak_source,
                tokens=resumed.loop.get("tokens", 0) if resumed else 0, moves=moves, refit=refit)


def _record_move(resumed, run_dir: RunDir, out: str, here: dict) -> list[dict]:
    """Log and record (migrations.jsonl) a resume under another device, precision or layout than the
    checkpoint was written under; returns the run's moves (rank 0; [] elsewhere)."""
    move = migration(resumed.saved, here, resumed.step, resumed.path, resumed.versions) if resumed else None
    if move:
        log.warning("the run moves: %s; judge the seam with `trex fidelity seam %s` (profile %s)",
                    describe_move(move), out, move["profile"])
    return record_moves(run_dir.path, resumed.step if resumed else 0, move) if run_dir.enabled else []


def _run_steps(r: _Run) -> None:
    """Steps from the resumed one to the last, each as trex.train.step runs it, then the log line,
    evaluation, fidelity probe and checkpoint. A stop signal, Ctrl-C or too many skipped steps end
    the loop with their status in ``r.status``."""
    cfg_train = r.recipe.train
    if cfg_train.eval_at_start and not r.resumed:
        r.evals[0] = r.objective.evaluate(r.model)
        reshard(r.model)
        if r.evals[0]:
            r.run_dir.log(0, r.evals[0], {})
    params = [p for p in r.model.parameters() if p.requires_grad]
    progress = StepProgress(cfg_train.steps, enabled=cfg_train.progress and r.par.is_main, every=cfg_train.log_every)
    with r.ckpt.signals():  # until the summary is written; after a stop signal, until exit
        try:
            if r.refit is not None and r.resumed:  # resumed inside a periodic re-fit phase: it finishes first
                r.status = r.refit.catch_up(r.model, r.resumed.step)
            for step in range(r.resumed.step if r.resumed else 0, cfg_train.steps if r.status == "completed" else 0):
                r.heartbeat.at(step + 1, "step")
                t0 = time.perf_counter()  # the previous step ended with a host read: the device is idle
                r.dev.reset_peak_memory()
                out = train_step(r.model, r.objective, r.optimizer, params, r.guard, step,
                                 grad_clip=r.recipe.optim.grad_clip, bias_gamma=cfg_train.router_bias_gamma(), par=r.par,
                                 fidelity=r.fidelity)
                lr = r.optimizer.param_groups[0]["lr"]
                with warnings.catch_warnings():  # a skipped step still advances the schedule
                    warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step\\(\\)`")
                    r.scheduler.step()
                imbalance = {f"expert_imbalance/{k}": v.max() / v.mean().clamp(min=1e-9) for k, v in out.loads.items()}
                result = out.result
                if result.indexer_loss is not None:  # a rank's mean -> the mean over ranks
                    result.metrics["indexer_loss"] = r.par.all_reduce_sum(result.indexer_loss) / r.par.summed_ranks
                read = read_scalars({"loss": result.loss, **result.metrics, "grad_norm": out.grad_norm,
                                     "tokens": result.tokens, "loss_ok": out.finite[0], "norm_ok": out.finite[1],
                                     **imbalance})  # the step's one host read: it waits for the step to finish
                dt = time.perf_counter() - t0
                if not r.guard.record(bool(read.pop("loss_ok")), bool(read.pop("norm_ok")), step + 1):
                    r.events.append(r.guard.last_reason)
                imbalance = {k.split("/", 1)[1]: read.pop(k) for k in imbalance}
                r.last = _step_metrics(r, step + 1, read, imbalance, lr, dt)
                due = cfg_train.eval_every and (step + 1) % cfg_train.eval_every == 0
                r.heartbeat.at(step + 1, "evaluate")
                held_out = r.objective.evaluate(r.model) if due else {}
                if held_out:
                    r.last.update(held_out)
                    r.evals[step + 1] = held_out
                if (step + 1) % cfg_train.log_every == 0 or step + 1 == cfg_train.steps or held_out:
                    r.run_dir.log(step + 1, r.last, {f"expert_imbalance/{k}": v for k, v in imbalance.items()})
                r.fidelity.record_probe(step + 1, r.model)  # the fixed probe batch after the update
                reshard(r.model)  # after no-grad forwards (evaluation, probe): FSDP's root must not stay gathered
                r.graphs.after_step()
                progress.update(step + 1, r.last, evaluated=bool(held_out))
                if r.observer is not None:
                    r.observer.stepped(step + 1, r.last)
                r.heartbeat.at(step + 1, "checkpoint")
                stop = r.ckpt.after_step(step + 1, {"tokens": r.tokens})  # saves when due, or on SIGTERM/SIGINT
                if stop:
                    r.status = "terminated" if stop == signal.SIGTERM else "interrupted"
                    break
                if r.refit is not None:  # GRPO / distillation: a re-fit phase every drafter.every_n steps
                    r.refit.main_time_s += dt
                    r.heartbeat.at(step + 1, "drafter re-fit")
                    r.status = r.refit.after_step(r.model, step + 1)
                    if r.status != "completed":
                        break
            if r.status == "completed":
                r.heartbeat.at(r.scheduler.last_epoch, "checkpoint")
                r.ckpt.finish(r.scheduler.last_epoch, {"tokens": r.tokens})
            if r.status == "completed" and r.refit is not None:  # the target frozen: the drafter re-fits to it
                r.heartbeat.at(r.scheduler.last_epoch, "drafter re-fit")
                r.status = r.refit.finish(r.model)
        except KeyboardInterrupt:
            r.status = "interrupted"
        except NonFiniteError as e:
            r.events.append(r.guard.last_reason)
            r.status = f"stopped: {e}"
        finally:
            progress.close()
            r.ckpt.close()
            r.objective.close()
        r.heartbeat.at(r.scheduler.last_epoch, "summary")
        if r.status == "completed":
            held_out = r.objective.evaluate(r.model)
            if held_out:
                r.evals["final"] = held_out


def _step_metrics(r: _Run, step: int, read: dict, imbalance: dict, lr: float, dt: float) -> dict:
    """The metrics line of ``step`` from its scalars (``read``, one host read), its wall time ``dt``
    in seconds and the per-layer expert imbalance; counts the step's tokens into the run."""
    step_tokens = int(read.pop("tokens")) // r.par.cp  # a context-parallel group's ranks each count its rows
    r.tokens += step_tokens
    mfu = step_tokens / dt * r.flops / (r.peak * r.par.world_size) if r.peak else None
    if (mfu or 0) > 1 and not r.mfu_warned:
        r.mfu_warned = True
        log.warning("step %d: MFU %.0f%% is above 100%%: the peak (%.3g FLOP/s, %s) is too low for "
                    "this machine; MFU is not meaningful here", step, 100 * mfu, r.peak, r.peak_source)
    return {
        **read, "lr": lr, "tokens_per_s": step_tokens / dt, "mfu": mfu,
        "mem_peak_bytes": r.dev.max_memory_allocated(), "loss_scale": r.guard.scaler.scale_value,
        "skipped_steps": r.guard.skipped_total, "expert_imbalance_max": max(imbalance.values(), default=1.0),
        "step_time_s": dt, "tokens": r.tokens,
    }


def _tracker_tags(summary: dict) -> dict:
    """What the trackers record at the end: the status (and why a failed run failed), the health statement,
    and each migration (seam)."""
    tags = {"status": summary["status"], **({"reason": summary["reason"]} if "reason" in summary else {}),
            **flatten(summary.get("health", {}), "health.")}
    for i, move in enumerate(summary.get("migrations", [])):
        tags.update(flatten(move, f"migration.{i}."))
    return tags


def failure_line(e: BaseException) -> str:
    """An error as one line (summary.json's ``reason``): trex's own errors (ValueError, EngineDied) and OSErrors
    as they say it, anything else after its type."""
    if isinstance(e, OSError):
        text = logs.os_error_line(e)
    elif isinstance(e, (ValueError, EngineDied)):
        text = str(e)
    else:
        text = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    return " ".join(line.strip() for line in text.splitlines() if line.strip())


def _record_failure(r: _Run, e: Exception, wall_time_s: float) -> None:
    """A run that ends in an error after set-up: summary.json (rank 0, atomically) says ``"status": "failed"``
    and the ``reason`` in one line, with what the run did until then; each tracker's run ends as failed
    (trex.train.trackers); train.log keeps the traceback. A dead rollout engine's error gets the step. The
    error itself goes on to the caller (the CLI's one line and exit code)."""
    step, phase = r.heartbeat.place
    if isinstance(e, EngineDied) and e.step is None:
        e.step = step or None
    reason = failure_line(e)
    log.debug("the run failed at step %d (%s): %s", step, phase, reason, exc_info=e)
    r.status = "failed"
    try:
        _warn_at_end(r)
        summary = _summary(r, wall_time_s)
    except Exception:  # what the run holds may be what broke: the status and the reason still
        summary = {"status": r.status, "steps_completed": r.scheduler.last_epoch}
    summary = {"status": "failed", "reason": reason, **summary}
    try:
        r.run_dir.write_summary(summary)
        trackers = r.run_dir.trackers
        if trackers is not None:
            summary["trackers"] = trackers.finish(_tracker_tags(summary), r.run_dir.file("summary.json"), failed=reason)
            if summary["trackers"]:
                r.run_dir.write_summary(summary)
    except Exception as record_error:  # the run's own error is the one to report
        log.warning("could not record the failure in %s: %s", r.run_dir.path, failure_line(record_error))
    finally:
        r.run_dir.close()


def _warn_at_end(r: _Run) -> None:
    """Log (rank 0) what the objective and the drafter's re-fit warn of at the end of a run (e.g. GRPO steps that
    taught nothing): with every warning logged during the run, summary.json's ``warnings``."""
    found = r.objective.warnings() + (r.refit.warnings() if r.refit is not None else [])
    for warning in found if r.par.is_main else ():
        log.warning("%s", warning)


def _summary(r: _Run, wall_time_s: float) -> dict:
    """summary.json: how the run ended, its last metrics and evaluations, and what it ran on."""
    layout = r.recipe.parallel
    return {
        "status": r.status,
        "mode": r.recipe.train.mode,
        "steps_completed": r.scheduler.last_epoch,
        "tokens": r.tokens,
        "wall_time_s": wall_time_s,
        "final": r.last,
        "eval": r.evals,
        "eval_loss": {at: m["eval_loss"] for at, m in r.evals.items() if "eval_loss" in m},
        "skipped_steps": r.guard.skipped_total,
        "health": r.guard.health(r.scheduler.last_epoch),
        "migrations": r.moves,
        "nonfinite_events": r.events,
        "data": r.objective.summary(),
        "warnings": r.warnings.lines() if r.warnings is not None else [],
        "precision": r.policy.to_dict(),
        "device": device_layer.environment_report(r.dev),
        "frozen_parameters": len(r.frozen),
        "compile": r.graphs.summary(),
        "flops_per_token": r.flops,
        "peak_flops": r.peak,
        "peak_flops_source": r.peak_source,
        **({"drafter": r.refit.summary()} if r.refit is not None else {}),
        "parallel": {"world_size": r.par.world_size, "dp_replicate": r.par.dp_replicate, "dp_shard": r.par.dp_shard,
                     "ep": r.par.ep, "cp": r.par.cp, "tp": r.par.tp,
                     "sequence_parallel": r.par.tp > 1 and r.par.sequence_parallel,
                     "activation_checkpointing": layout.activation_checkpointing},
    }
