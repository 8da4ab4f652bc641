"""The training loop: full-parameter continued pretraining and SFT of a DeepSeek-V4 model.

One step, as in the algorithm:

    take grad_accum micro-batches; count their loss targets (the global batch's denominator)
    for each micro-batch: forward; loss = CE_sum / targets + w_mtp * MTP + alpha * balance; backward
    unscale (fp16), measure and clip the global grad norm
    if loss and norm are finite: optimizer step, then the aux-loss-free router bias update
    else: skip the step and count it (N consecutive skips stop the run)
    advance the LR schedule; log; evaluate now and then

Everything a run writes lands in its run directory (see trex.train.run_dir).
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import sys
import time
import warnings
from dataclasses import dataclass

import torch
from torch.distributed.fsdp import FSDPModule

from trex import device as device_layer
from trex import recipe as recipe_io
from trex.data import build_loader, load_tokenizer
from trex.data.tokenizer import Tokenizer, compact_tokenizer
from trex.fidelity.signals import FidelityRecorder
from trex.hardware import profile_for_device_name
from trex.models import DeepseekV4, build_model, get_preset, load_pretrained
from trex.models.deepseek_v4 import IGNORE_INDEX, shift_labels
from trex.models.flops import flops_per_token
from trex.parallel.load import load_sharded
from trex.parallel.mesh import Parallel, init_parallel
from trex.parallel.plan import apply_parallelism
from trex.parallel.preflight import collective_context, preflight
from trex.train.checkpointing import Checkpointer, RunState
from trex.train.config import TrainRecipe
from trex.train.moe_balance import freeze_indexer, sum_expert_counts, update_router_bias
from trex.train.optim import build_optimizer, clip_grad_norm
from trex.train.precision import DynamicLossScaler, NonFiniteError, PrecisionPolicy, StepGuard
from trex.train.progress import StepProgress
from trex.train.run_dir import RunDir
from trex.train.schedule import build_scheduler

log = logging.getLogger(__name__)


@dataclass
class TrainResult:
    model: DeepseekV4
    tokenizer: Tokenizer
    summary: dict
    run_dir: str


# ---- losses -----------------------------------------------------------------------------------------
def targets_for(labels: torch.Tensor, doc_ids: torch.Tensor, shift: int) -> torch.Tensor:
    """Targets ``shift`` tokens ahead, IGNORE_INDEX across documents and past the end."""
    return shift_labels(labels, shift, doc_ids)


def loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy (fp32) over targets != IGNORE_INDEX."""
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten(),
                                             ignore_index=IGNORE_INDEX, reduction="sum")


def _count(targets: torch.Tensor) -> int:
    return int((targets != IGNORE_INDEX).sum())


# ---- set-up -----------------------------------------------------------------------------------------
def tokenizer_for(spec: str) -> Tokenizer:
    return compact_tokenizer() if spec == "compact" else load_tokenizer(spec)


def model_for(recipe: TrainRecipe, tokenizer: Tokenizer, dev: device_layer.Device,
              policy: PrecisionPolicy) -> DeepseekV4:
    section = recipe.model
    if section.path:
        model = load_pretrained(section.path, dtype=policy.param_dtype, device=dev.name)
    else:
        cfg = get_preset(section.preset)
        overrides = dict(section.overrides)
        overrides.setdefault("vocab_size", -(-tokenizer.vocab_size // 8) * 8)  # a preset fits its tokenizer
        try:
            cfg = dataclasses.replace(cfg, **overrides)
        except TypeError as e:
            raise ValueError(f"model.overrides: {e}") from None
        model = build_model(cfg, device=dev.torch_device, dtype=policy.param_dtype, seed=section.init_seed)
    check_vocab(model, tokenizer)
    return model


def check_vocab(model: DeepseekV4, tokenizer: Tokenizer) -> None:
    if model.cfg.vocab_size < tokenizer.vocab_size:
        raise ValueError(f"tokenizer {tokenizer.source} has {tokenizer.vocab_size} ids but the model's vocab_size "
                         f"is {model.cfg.vocab_size}")


def peak_flops(dev: device_layer.Device, policy: PrecisionPolicy) -> tuple[float | None, str]:
    """The MFU denominator: measured on CPU, from the hardware profiles on accelerators."""
    dtype = str(policy.compute_dtype).replace("torch.", "").replace("bfloat16", "bf16").replace(
        "float16", "fp16").replace("float32", "fp32")
    if not dev.is_accelerator:
        return device_layer.measure_matmul_flops(dev, policy.compute_dtype, n=512), f"measured {dtype} matmul"
    name = device_layer.environment_report(dev).get("device_name", dev.type)
    profile = profile_for_device_name(name)
    if profile is None:
        log.warning("no hardware profile matches %r: MFU is not reported (add one, see docs/mfu.md)", name)
        return None, "unknown device"
    return profile.peak_flops(dtype), f"{profile.name} {dtype} per {profile.unit}"


@torch.no_grad()
def evaluate_loss(model: DeepseekV4, loader, batches: int, dev: device_layer.Device,
                  par: Parallel | None = None) -> float:
    """Token-weighted next-token loss over ``batches`` held-out micro-batches (of every rank)."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for _ in range(batches):
        b = next(loader).to(dev.torch_device)
        targets = targets_for(b.labels, b.doc_ids, 1)
        total += loss_sum(model(b.input_ids, doc_ids=b.doc_ids).logits, targets).item()
        count += _count(targets)
    model.train(was_training)
    if par is not None and par.distributed:
        total, count = par.all_reduce_sum(torch.tensor([total, float(count)], dtype=torch.float64)).tolist()
    return total / max(count, 1)


def accumulate_gradients(model: DeepseekV4, micro: list, cfg_train, scaler: DynamicLossScaler,
                         par: Parallel | None = None):
    """Forward and backward over the micro-batches of one step; gradients accumulate in .grad.

    The LM and MTP cross-entropies are summed over tokens and divided by the number of targets in
    the whole step (all micro-batches of all ranks; ranks sum their gradients), so any split of a
    batch gives the same gradient. The balance loss is averaged over micro-batches and ranks.
    Returns this rank's share of the (lm loss, mtp loss) and its MoE stats.
    """
    world = par.world_size if par is not None else 1
    shifts = [1] + [j + 2 for j in range(model.cfg.num_nextn_predict_layers)]
    targets = [[targets_for(b.labels, b.doc_ids, s) for s in shifts] for b in micro]
    counts = torch.tensor([sum(_count(t[i]) for t in targets) for i in range(len(shifts))])
    if par is not None:
        counts = par.all_reduce_sum(counts)
    counts = counts.clamp(min=1).tolist()
    device = micro[0].input_ids.device
    lm_total = torch.zeros((), device=device)
    mtp_total = torch.zeros((), device=device)
    stats = []
    for i, (b, tgt) in enumerate(zip(micro, targets)):
        if isinstance(model, FSDPModule):  # reduce-scatter gradients once, after the last micro-batch
            model.set_requires_gradient_sync(i == len(micro) - 1)
        out = model(b.input_ids, doc_ids=b.doc_ids)
        lm = loss_sum(out.logits, tgt[0]) / counts[0]
        mtp = sum((loss_sum(lg, t) / c for lg, t, c in zip(out.mtp_logits, tgt[1:], counts[1:])),
                  torch.zeros((), device=device)) / max(1, len(out.mtp_logits))
        loss = lm + cfg_train.mtp_weight * mtp
        balance = [s.balance_loss for s in out.moe_stats if s.balance_loss is not None]
        if balance:
            loss = loss + cfg_train.balance_alpha * torch.stack(balance).sum() / (len(micro) * world)
        scaler.scale(loss).backward()
        lm_total += lm.detach()
        mtp_total += mtp.detach()
        stats.extend(out.moe_stats)
    return lm_total, mtp_total, stats


# ---- the loop ---------------------------------------------------------------------------------------
def train(recipe: TrainRecipe, model: DeepseekV4 | None = None, tokenizer: Tokenizer | None = None) -> TrainResult:
    """Run ``recipe``; ``model``/``tokenizer`` continue from a previous stage instead of [model]/[data]."""
    t_start = time.perf_counter()
    cfg_train = recipe.train
    dev = device_layer.detect(cfg_train.device or None)
    dev.set_current()
    layout = recipe.parallel
    par = init_parallel(layout.dp_replicate, layout.dp_shard, layout.ep, layout.timeout_s, dev)
    dev.manual_seed(cfg_train.seed)  # the same on every rank: identical initial weights
    policy = PrecisionPolicy.resolve(recipe.precision.dtype, dev)
    run = RunDir(cfg_train.out, enabled=par.is_main)
    run.save_config(recipe)

    tokenizer = tokenizer or tokenizer_for(recipe.data.tokenizer)
    frozen: list[str] = []

    def prepare(m: DeepseekV4) -> None:
        # one process holds parameters in the policy's dtype; sharded runs keep fp32 shards (the
        # master weights) and let FSDP cast to the compute dtype
        m.to(dtype=torch.float32 if par.distributed else policy.param_dtype).train()
        frozen.extend(freeze_indexer(m) if cfg_train.freeze_indexer else [])
        apply_parallelism(m, par, policy, layout.activation_checkpointing)

    if model is None and recipe.model.path and par.distributed:
        model = load_sharded(recipe.model.path, prepare, dev.torch_device)  # each rank reads its shards
        check_vocab(model, tokenizer)
    else:
        model = model if model is not None else model_for(recipe, tokenizer, dev, policy)
        prepare(model)
    optimizer = build_optimizer(model, recipe.optim, dev)
    if par.is_main:
        print(optimizer.describe_groups(), file=sys.stderr)
    scheduler = build_scheduler(optimizer, recipe.schedule, cfg_train.steps)
    guard = StepGuard(recipe.precision.max_consecutive_skips, DynamicLossScaler.from_config(recipe.precision, policy))
    loader = build_loader(recipe.data, rank=par.rank, world_size=par.world_size, tokenizer=tokenizer)
    eval_loader = None
    if recipe.eval.paths:
        eval_loader = build_loader(dataclasses.replace(recipe.data, paths=list(recipe.eval.paths), shuffle=False),
                                   rank=par.rank, world_size=par.world_size, tokenizer=tokenizer)
    preflight(par, {"steps": cfg_train.steps, "grad_accum": cfg_train.grad_accum,
                    "micro_batches_per_epoch": loader.micro_batches_per_epoch, "data": loader.fingerprint,
                    "eval_micro_batches": eval_loader.micro_batches_per_epoch if eval_loader else 0})
    params = [p for p in model.parameters() if p.requires_grad]
    flops = flops_per_token(model.cfg, recipe.data.seq_len).total
    peak, peak_source = peak_flops(dev, policy)
    fidelity = FidelityRecorder.for_recipe(recipe, run.path, tokenizer, dev.torch_device)  # rank 0 writes

    ckpt = Checkpointer(recipe.checkpoint, cfg_train.out, RunState(model, optimizer, scheduler, guard, loader, dev,
                                                                   eval_loader), config=recipe_io.to_dict(recipe),
                        precision=policy.to_dict())
    resumed = ckpt.resume()

    status, events, last, evals = "completed", [], {}, {}
    tokens_seen = resumed.loop.get("tokens", 0) if resumed else 0
    progress = StepProgress(cfg_train.steps, enabled=cfg_train.progress and par.is_main)
    ckpt.install_signal_handlers()
    try:
        for step in range(resumed.step if resumed else 0, cfg_train.steps):
            dev.synchronize()
            t0 = time.perf_counter()
            dev.reset_peak_memory()
            micro = [next(loader).to(dev.torch_device) for _ in range(cfg_train.grad_accum)]
            with collective_context(par, step, "forward/backward (FSDP all-gather/reduce-scatter, MoE all-to-all)"):
                lm_total, mtp_total, stats = accumulate_gradients(model, micro, cfg_train, guard.scaler, par)
            with collective_context(par, step, "gradient sync, norm and loss all-reduce"):
                guard.scaler.unscale_(params)
                fidelity.record_grad_norms(step + 1, model)  # unscaled, before clipping
                grad_norm = clip_grad_norm(params, recipe.optim.grad_clip)
                step_tokens = sum(b.n_tokens for b in micro)
                totals = par.all_reduce_sum(torch.stack([lm_total, mtp_total, lm_total.new_tensor(step_tokens)]))
                lm_total, mtp_total, step_tokens = totals[0], totals[1], int(totals[2])
            applied = guard.check(lm_total, grad_norm, step)
            if applied:
                with collective_context(par, step, "optimizer step (Muon gathers) and router-bias all-reduce"):
                    optimizer.step()
                    reduce = par.all_reduce_sum if par.distributed else None
                    loads = update_router_bias(model, stats, cfg_train.bias_gamma, reduce) if cfg_train.bias_gamma \
                        else sum_expert_counts(stats)
            else:
                events.append(guard.last_reason)
                loads = sum_expert_counts(stats)
            optimizer.zero_grad(set_to_none=True)
            lr = optimizer.param_groups[0]["lr"]
            with warnings.catch_warnings():  # a skipped step still advances the schedule
                warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step\\(\\)`")
                scheduler.step()

            dev.synchronize()
            dt = time.perf_counter() - t0
            tokens_seen += step_tokens
            imbalance = {k: (v.max() / v.mean().clamp(min=1e-9)).item() for k, v in loads.items()}
            last = {
                "loss": lm_total.item(), "mtp_loss": mtp_total.item(), "grad_norm": grad_norm.item(), "lr": lr,
                "tokens_per_s": step_tokens / dt,
                "mfu": (step_tokens / dt * flops / (peak * par.world_size)) if peak else None,
                "mem_peak_bytes": dev.max_memory_allocated(), "loss_scale": guard.scaler.scale_value,
                "skipped_steps": guard.skipped_total, "expert_imbalance_max": max(imbalance.values(), default=1.0),
                "step_time_s": dt, "tokens": tokens_seen,
            }
            eval_now = eval_loader is not None and cfg_train.eval_every and (step + 1) % cfg_train.eval_every == 0
            if eval_now:
                last["eval_loss"] = evals[step + 1] = evaluate_loss(model, eval_loader, recipe.eval.batches, dev, par)
            if (step + 1) % cfg_train.log_every == 0 or step + 1 == cfg_train.steps or eval_now:
                run.log(step + 1, last, {f"expert_imbalance/{k}": v for k, v in imbalance.items()})
            fidelity.record_probe(step + 1, model)  # the fixed probe batch after the update
            progress.update(step + 1, last)
            stop = ckpt.after_step(step + 1, {"tokens": tokens_seen})  # saves when due, or on SIGTERM/SIGINT
            if stop:
                status = "terminated" if stop == signal.SIGTERM else "interrupted"
                break
        if status == "completed":
            ckpt.finish(scheduler.last_epoch, {"tokens": tokens_seen})
    except KeyboardInterrupt:
        status = "interrupted"
    except NonFiniteError as e:
        events.append(guard.last_reason)
        status = f"stopped: {e}"
    finally:
        progress.close()
        ckpt.close()

    if eval_loader is not None and status == "completed":
        evals["final"] = evaluate_loss(model, eval_loader, recipe.eval.batches, dev, par)
    summary = {
        "status": status,
        "steps_completed": scheduler.last_epoch,
        "tokens": tokens_seen,
        "wall_time_s": time.perf_counter() - t_start,
        "final": last,
        "eval_loss": evals,
        "skipped_steps": guard.skipped_total,
        "nonfinite_events": events,
        "data": loader.summary(),
        "precision": policy.to_dict(),
        "device": device_layer.environment_report(dev),
        "frozen_parameters": len(frozen),
        "flops_per_token": flops,
        "peak_flops": peak,
        "peak_flops_source": peak_source,
        "parallel": {"world_size": par.world_size, "dp_replicate": par.dp_replicate, "dp_shard": par.dp_shard,
                     "ep": par.ep, "activation_checkpointing": layout.activation_checkpointing},
    }
    run.write_summary(summary)
    run.plot_loss()
    run.close()
    if status.startswith("stopped"):
        raise NonFiniteError(status)
    if status == "interrupted":
        raise KeyboardInterrupt
    if status == "terminated":
        raise SystemExit(128 + signal.SIGTERM)  # saved a checkpoint, then exits as SIGTERM would
    return TrainResult(model=model, tokenizer=tokenizer, summary=summary, run_dir=run.path)
