"""``[drafter]``: re-fit the model's drafter against the target the job post-trained.

Two drafters: DeepSeek-V4.1's DSpark stages (``mtp.*``, a module of their own, ``trex.models.deepseek_v4.dspark``) and
the multi-token-prediction modules of DeepSeek-V4 and the V3 family (the model's own ``mtp``, which vLLM and
SGLang serve as a drafter of one token per module; ``MTPDrafter``). This file is the driver; each kind is a
module of ``trex.train.drafters`` (``dspark``, ``mtp``) filling one interface. Post-training moves the backbone's
hidden states and greedy tokens away from the ones the drafter learned, and speculative decoding accepts
fewer of its drafts (``trex fidelity drafter`` measures it). With ``[drafter] enabled`` the job restores them
itself: after its main steps (and, in GRPO and distillation, every ``every_n`` steps, where the policy keeps
moving) the target is frozen and the drafter trains on the target's own continuations of the job's prompts,
warm-started from the drafter it has:

    prompts   the job's: SFT the training records' prompts, GRPO / distillation the rollout prompts, or
              ``prompts`` (JSONL files), minus the ``held_out`` last ones kept for measuring acceptance
    data      each re-fit step k: ``prompts_per_step`` prompts drawn with a generator seeded by (seed, k),
              continued ``new_tokens`` tokens by the target (greedy, or sampled at ``temperature`` with
              uniforms of the same seed), under no_grad: the tap layers' hidden states and the target's
              logits of every continuation position come from the same decode
    forward   every continuation position an anchor, its block drafted at once, teacher-forced as a
              verified draft would be: DSpark's ``DSparkDrafter.forward`` over the tap layers' hidden
              (blocks of ``block_size``); the MTP modules' through one forward of the model over the
              continuation, only the modules trained (module j drafts the token j + 2 ahead)
    loss      ce * CE(draft, target's token) + tv * sum_v |p_draft - p_target| (the L1 distance, twice the
              total variation) + confidence * BCE(confidence, 1 - TV), the terms and defaults of DeepSpec's
              loss.py as NeMo Automodel ships them (0.1 / 0.9 / 1.0): 1 - TV is the probability that a
              sampled draft token is accepted, what DSpark's confidence head predicts (the MTP modules have
              none: CE and TV); averaged over every (anchor, position) before the row's stop token, over
              all ranks

The MTP modules are the model's: in SFT / CPT they train with the main loss (``train.mtp_weight``) and the
re-fit follows the main steps; in DPO, GRPO and distillation they get no gradient from the objective, so
with ``[drafter]`` they are frozen in the main steps (no weight decay drifts them) and only the re-fit moves
them. The re-fit trains the MTP parameters the recipe's freezes leave (``train.freeze_indexer``, a frozen
router), and ``trex ckpt export`` of the main checkpoint the last phase fitted writes the re-fit modules.

The step never reads the host (the loss and its parts are read once, as the main loop does); the target
and its embedding and head get no gradient. Acceptance (b) is measured with the drafter as the first phase
found it (kept in ``<checkpoint dir>/drafter/before``). Each re-fit step is checkpointed like a main step, in
``<checkpoint dir>/drafter/step_K`` (K counts re-fit steps over the run's phases), and a run resumed from any
of them repeats the uninterrupted run bit for bit: a step's data depends only on (seed, K) and the target.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import signal
import time
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F

from trex import logs
from trex.checkpoint.training import CheckpointSection, Checkpointer, RunState, one_process_dcp
from trex.models.registry import drafter_kind
from trex.posttrain.objective import reshard
from trex.precision import StepGuard
from trex.recipe import check_choices
from trex.rollout.speculation import Acceptance, Continuation, continue_prompts
from trex.train.drafters import kind_of
from trex.train.optim import OptimSection, build_optimizer, clip_grad_norm
from trex.train.schedule import ScheduleSection, build_scheduler
from trex.train.step import read_scalars

log = logging.getLogger(__name__)


@dataclass
class DrafterSection:
    """The ``[drafter]`` section: re-fit the model's drafter in the job (trex.train.drafter_refit)."""

    enabled: bool = False
    """Re-fit the drafter: DeepSeek-V4.1's DSpark stages, or the multi-token prediction modules of DeepSeek-V4
    and the V3 family."""
    steps: int = 100
    """Re-fit steps per phase (after the main steps; and each ``every_n`` steps in GRPO / distillation)."""
    every_n: int = 0
    """GRPO / distillation: also re-fit after every this many main steps; 0: only after the main steps."""
    lr: float = 2e-5
    """AdamW learning rate (eps 1e-8), constant after ``warmup_steps`` (SpecForge's V4.1 drafter fine-tune
    used 2e-5)."""
    warmup_steps: int = 0
    """Linear warm-up over the re-fit's first steps (at most ``steps``)."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    grad_clip: float = 1.0
    """Clip the drafter's gradients to this global L2 norm (0: measure only)."""
    ce: float = 0.1
    """Weight of the cross-entropy to the target's token (NeMo Automodel's DSpark default)."""
    tv: float = 0.9
    """Weight of the L1 distance between the draft's and the target's distributions (twice their total
    variation, as DeepSpec's loss.py computes it: NeMo's 0.9 means the same here)."""
    confidence: float = 1.0
    """Weight of DSpark's confidence head's BCE against 1 - TV, the sampled draft's acceptance probability
    (the MTP modules have no confidence head: not used)."""
    block_size: int = 0
    """DSpark: tokens drafted per anchor in training; 0: the config's ``dspark_block_size`` (what is served).
    SpecForge trains V4.1 blocks of 7 for 5 served: the stages do not depend on the block length. MTP: 0 (one
    token per module)."""
    sampling: Literal["greedy", "sampled"] = "greedy"
    """How the target continues the prompts: its greedy tokens (what a temperature-0 server verifies) or
    tokens sampled at ``temperature``."""
    temperature: float = 1.0
    """Sampling temperature (sampling = "sampled")."""
    new_tokens: int = 32
    """Tokens the target continues each prompt with (each a training anchor, less the block)."""
    prompts_per_step: int = 8
    """Prompts per re-fit step (all ranks together; each rank an equal share)."""
    prompts: list[str] = field(default_factory=list)
    """JSONL / Parquet prompt files ({"prompt"} or {"messages"}); empty: the job's prompts (SFT / DPO:
    ``data.paths``; GRPO / distillation: their ``prompts``)."""
    held_out: int = 8
    """The last this many prompts are kept out of the re-fit and measure acceptance before and after."""
    measure_tokens: int = 32
    """Greedy tokens per held-out prompt when measuring acceptance (``trex fidelity drafter``'s way)."""
    seed: int = 0
    """Seeds the re-fit's prompt draws and sampling."""

    def __post_init__(self) -> None:
        check_choices(self, "drafter")
        for key in ("steps", "new_tokens", "prompts_per_step", "measure_tokens"):
            value = getattr(self, key)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"drafter.{key} = {value!r}; expected an integer >= 1")
        for key in ("every_n", "block_size", "held_out", "warmup_steps"):
            value = getattr(self, key)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"drafter.{key} = {value!r}; expected an integer >= 0")
        for key in ("lr", "weight_decay", "grad_clip", "ce", "tv", "confidence"):
            if getattr(self, key) < 0:
                raise ValueError(f"drafter.{key} = {getattr(self, key)!r}; expected a value >= 0")
        if self.ce + self.tv + self.confidence == 0:
            raise ValueError("drafter.ce, drafter.tv and drafter.confidence are all 0; expected a positive weight")
        if self.temperature <= 0:
            raise ValueError(f"drafter.temperature = {self.temperature!r}; expected a value > 0 (greedy: "
                             "drafter.sampling = \"greedy\")")
        if self.warmup_steps > self.steps:
            raise ValueError(f"drafter.warmup_steps = {self.warmup_steps}; expected at most drafter.steps = {self.steps}")

    def check_against(self, mode: str, cfg) -> None:
        """ValueError (one line, naming the key) when this section cannot apply to ``mode`` and model ``cfg``."""
        if not self.enabled:
            return
        if drafter_kind(cfg) is None:
            raise ValueError("drafter.enabled: the model has no drafter to re-fit (DeepSeek-V4.1's DSpark stages: "
                             "num_nextn_predict_layers and dspark_target_layer_ids; or the multi-token prediction "
                             "modules of DeepSeek-V4 and the V3 family: num_nextn_predict_layers > 0)")
        if self.every_n and mode not in ("grpo", "distill"):
            raise ValueError(f"drafter.every_n = {self.every_n} re-fits during GRPO or distillation; train.mode is "
                             f"{mode!r} (set drafter.every_n = 0: the re-fit follows the main steps)")
        kind_of(cfg).check(self, cfg)


# ---- the objective ----------------------------------------------------------------------------------
def drafter_loss(logits: torch.Tensor, confidence: torch.Tensor | None, labels: torch.Tensor, target: torch.Tensor,
                 mask: torch.Tensor, section: DrafterSection, count: torch.Tensor
                 ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """logits [B, A, T, V] fp32 the drafts', confidence [B, A, T] (logits; None: a drafter without a confidence
    head), labels [B, A, T] the target's tokens, target [B, A, T, V] the target's logits there, mask [B, A, T]
    the pairs that count; count: the number of such pairs over all ranks (0-d). -> (the weighted loss, this
    rank's share of the mean over ``count``; its parts' shares: ce, tv (total variation), confidence (BCE),
    accepted (the drafts' argmax equals the label))."""
    w = mask.float() / count.clamp(min=1)
    ce = F.cross_entropy(logits.flatten(0, 2), labels.flatten(), reduction="none").view_as(w)
    tv = 0.5 * (logits.softmax(-1) - target.float().softmax(-1)).abs().sum(-1)
    parts = {"ce": (ce * w).sum(), "tv": (tv * w).sum(), "accepted": ((logits.argmax(-1) == labels).float() * w).sum()}
    loss = section.ce * parts["ce"] + section.tv * 2 * parts["tv"]
    if confidence is not None:
        bce = F.binary_cross_entropy_with_logits(confidence, (1 - tv).detach().clamp(0, 1), reduction="none")
        parts["confidence"] = (bce * w).sum()
        loss = loss + section.confidence * parts["confidence"]
    return loss, {k: v.detach() for k, v in parts.items()}


# ---- the drafters' training forward -----------------------------------------------------------------------
def fit_batch(drafter, model, c: Continuation, block: int, stop_ids: tuple[int, ...]):
    """The drafter's training forward over continuation ``c`` (its kind's ``draft``): anchors at every position
    from the prompt's last (P - 1) to the last whose block fits -> (logits [B, A, T, V], confidence (None: MTP),
    labels [B, A, T], target logits [B, A, T, V], mask [B, A, T]: labels generated before the row's stop token)."""
    P, L = c.width, c.ids.shape[1]
    A = L - P - block
    a = torch.arange(A, device=c.ids.device)[:, None] + torch.arange(block, device=c.ids.device)  # [A, T]
    logits, confidence = kind_of(drafter.cfg).draft(drafter, model, c, A, block)
    labels = c.ids[:, P + 1 + a]
    target = c.logits[:, a]
    generated = c.ids[:, P:]
    if stop_ids:  # a label counts when no stop token was generated before it
        stopped = torch.isin(generated, torch.tensor(stop_ids, device=generated.device)).long().cumsum(1)
        before = torch.cat([torch.zeros_like(stopped[:, :1]), stopped[:, :-1]], 1) == 0  # [B, G]
        mask = before[:, 1 + a]
    else:
        mask = torch.ones_like(labels, dtype=torch.bool)
    return logits, confidence, labels, target, mask


def step_prompts(n: int, per_step: int, seed: int, k: int) -> list[int]:
    """The ``per_step`` prompt indices (of ``n``) re-fit step ``k`` draws, the same at any layout (on the host:
    shuffled passes over the prompts)."""
    rng = random.Random(seed * 1_000_003 + k)
    picks: list[int] = []
    while len(picks) < per_step:
        picks += rng.sample(range(n), n)
    return picks[:per_step]


def step_uniforms(rows: int, new_tokens: int, seed: int, k: int) -> torch.Tensor:
    """The sampling uniforms of re-fit step ``k``: [rows, new_tokens], the same at any layout."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + k + 7_919)
    return torch.rand(rows, new_tokens, generator=g)


class _Position:
    """The re-fit's place for the checkpoint (its ``loader``): nothing beyond the step the checkpoint names,
    since step K's data depends only on (seed, K); and ``signal``, [re-fit steps, those with a drafting
    position to train on], over the run's phases (what ``JobRefit.warnings`` says)."""

    def __init__(self):
        self.signal = [0, 0]

    def state_dict(self) -> dict:
        return {"signal": list(self.signal)}

    def load_state_dict(self, state: dict) -> None:
        self.signal = list(state.get("signal", [0, 0]))  # checkpoints before the count: from the resume on


# ---- the phase runner ------------------------------------------------------------------------------------
class DrafterRefit:
    """The re-fit of one job: the drafter, its optimizer and checkpoints, its prompts, and the acceptance it
    measures. ``phase(model, upto)`` trains re-fit steps up to K = ``upto`` (cumulative over phases)."""

    def __init__(self, section: DrafterSection, drafter, prompts: list[list[int]], par, dev, pad_id: int,
                 stop_ids: tuple[int, ...], checkpoint: CheckpointSection, out: str, config: dict | None = None):
        if section.prompts_per_step % par.data_world:
            raise ValueError(f"drafter.prompts_per_step = {section.prompts_per_step}; expected a multiple of the "
                             f"{par.data_world} data-parallel ranks")
        if len(prompts) <= section.held_out:
            raise ValueError(f"drafter.held_out = {section.held_out}: the job has {len(prompts)} prompts; expected "
                             "more, some to re-fit on")
        self.section, self.par, self.dev = section, par, dev
        self.drafter = drafter
        self.train_prompts = prompts[:len(prompts) - section.held_out]
        self.held_out = prompts[len(prompts) - section.held_out:]
        self.pad_id, self.stop_ids = pad_id, stop_ids
        self.kind = kind_of(drafter.cfg)
        self.block = self.kind.block_size(drafter, section)
        self.width = self.kind.width(drafter, max(len(p) for p in prompts), section, par)
        self.params = self.kind.trainable_parameters(drafter)
        with trainable(self.params):  # the optimizer takes the parameters that require grad
            optim = OptimSection(name="adamw", lr=section.lr, weight_decay=section.weight_decay, eps=1e-8,
                                 grad_clip=section.grad_clip)
            self.optimizer = build_optimizer(drafter, optim, dev)
        self.scheduler = build_scheduler(self.optimizer, ScheduleSection(warmup_steps=section.warmup_steps,
                                                                         decay="constant"), section.steps)
        self.guard = StepGuard(8)
        directory = os.path.join(checkpoint.directory(out), "drafter")
        ckpt = dataclasses.replace(checkpoint, dir=directory, resume="auto" if checkpoint.resume else "")
        self.position = _Position()
        self.ckpt = Checkpointer(ckpt, out, RunState(drafter, self.optimizer, self.scheduler, self.guard,
                                                     self.position, dev), config=config)
        self.before_dir = os.path.join(directory, "before")  # the drafter as the first phase found it
        self.done = 0  # re-fit steps taken (K)
        self.metrics: list[dict] = []
        self.time_s = 0.0
        self.peak_bytes = 0

    def resume(self) -> None:
        """Continue from the newest re-fit checkpoint, if the run resumes and has one."""
        resumed = self.ckpt.resume()
        if resumed:
            self.done = resumed.step

    def _step(self, model, k: int) -> dict[str, torch.Tensor]:
        """Re-fit step ``k`` (0-based, cumulative): device tensors, no host read."""
        s, par = self.section, self.par
        picks = step_prompts(len(self.train_prompts), s.prompts_per_step, s.seed, k)
        share = s.prompts_per_step // par.data_world
        mine = picks[par.data_rank * share:(par.data_rank + 1) * share]
        uniforms = None
        if s.sampling == "sampled":
            uniforms = step_uniforms(s.prompts_per_step, s.new_tokens, s.seed, k)[
                par.data_rank * share:(par.data_rank + 1) * share]
        c = continue_prompts(model, [self.train_prompts[i] for i in mine], s.new_tokens, self.pad_id, self.width,
                             s.temperature if uniforms is not None else 0.0, uniforms,
                             self.kind.target_layers(self.drafter))
        logits, confidence, labels, target, mask = fit_batch(self.drafter, model, c, self.block, self.stop_ids)
        count = mask.sum()
        if par.distributed:
            count = par.all_reduce_sum(count)
        loss, parts = drafter_loss(logits, confidence, labels, target, mask, s, count)
        loss.backward()
        norm = clip_grad_norm(self.params, s.grad_clip)
        finite = self.guard.finite(loss.detach(), norm)
        self.optimizer.step(apply=finite.all())
        self.optimizer.zero_grad(set_to_none=True)
        if par.distributed:  # each rank's share of the global means
            parts = {k: par.all_reduce_sum(v) for k, v in parts.items()}
            loss = par.all_reduce_sum(loss.detach())
        return {"loss": loss.detach(), **parts, "grad_norm": norm, "positions": count, "loss_ok": finite[0],
                "norm_ok": finite[1]}

    def phase(self, model, upto: int, log_row=None) -> str:
        """Train re-fit steps self.done .. upto - 1 with ``model`` (the target) frozen; checkpoint like main
        steps (every ``save_every``, and the phase's last); -> "completed" or the stop signal's status. The
        first phase first keeps the drafter as it found it (``before``, for acceptance (b))."""
        if self.done >= upto:
            return "completed"
        if self.done == 0:
            self._keep_before()
        trained = [p for p in model.parameters() if p.requires_grad]
        for p in trained:
            p.requires_grad_(False)
        self.dev.reset_peak_memory()
        try:
            with self.ckpt.signals(), trainable(self.params):
                for k in range(self.done, upto):
                    t0 = time.perf_counter()
                    read = read_scalars(self._step(model, k))  # the step's one host read
                    self.scheduler.step()
                    self.guard.record(bool(read.pop("loss_ok")), bool(read.pop("norm_ok")), k + 1)
                    steps, taught = self.position.signal
                    self.position.signal = [steps + 1, taught + (read["positions"] > 0)]
                    read["step_time_s"] = time.perf_counter() - t0
                    self.time_s += read["step_time_s"]
                    self.done = k + 1
                    row = {"drafter_step": k + 1, **{f"drafter/{n}": v for n, v in read.items()}}
                    self.metrics.append(row)
                    if log_row is not None:
                        log_row(row)
                    stop = self.ckpt.after_step(k + 1)
                    if stop:
                        return "terminated" if stop == signal.SIGTERM else "interrupted"
                self.ckpt.finish(upto)
        finally:
            self.ckpt.close()
            for p in trained:
                p.requires_grad_(True)
            reshard(model)  # the no-grad forwards left FSDP's root gathered
            self.peak_bytes = max(self.peak_bytes, self.dev.max_memory_allocated())
        return "completed"

    @torch.no_grad()
    def acceptance(self, model) -> Acceptance:
        """``trex fidelity drafter``'s measure on the held-out prompts: ``model`` with the drafter as it is."""
        measured = self.kind.measure(self.drafter, model, self.held_out, self.section, self.pad_id, self.stop_ids,
                                     self.par)
        reshard(model)
        return measured

    @torch.no_grad()
    def acceptance_before(self, model) -> Acceptance:
        """The acceptance of ``model`` with the drafter as the first phase found it: the drafter as it is when
        no phase has run, else ``before`` put in its place for the measure (and taken out again)."""
        if self.done == 0:
            return self.acceptance(model)
        import torch.distributed.checkpoint as dcp

        state = self.drafter.state_dict()
        now = {k: v.detach().clone() for k, v in state.items()}
        with one_process_dcp():
            dcp.load(state, checkpoint_id=self.before_dir)  # in place, at any layout
        try:
            return self.acceptance(model)
        finally:
            for k, v in state.items():
                v.copy_(now[k])

    def _keep_before(self) -> None:
        """Write the drafter's state to ``before`` (DCP, every rank its shards; replaced whole)."""
        import shutil

        import torch.distributed.checkpoint as dcp

        tmp = self.before_dir + ".tmp"
        if self.par.is_main and os.path.exists(tmp):
            shutil.rmtree(tmp)
        _barrier(self.par)
        with one_process_dcp():
            dcp.save(self.drafter.state_dict(), checkpoint_id=tmp)
        _barrier(self.par)
        if self.par.is_main:
            if os.path.exists(self.before_dir):
                shutil.rmtree(self.before_dir)
            os.replace(tmp, self.before_dir)
        _barrier(self.par)


class trainable:
    """``params`` require grad inside the block; afterwards each has the flag it had (the MTP modules are
    frozen in a DPO / GRPO / distillation job's main steps)."""

    def __init__(self, params: list[torch.Tensor]):
        self.params = params

    def __enter__(self):
        self.held = [p.requires_grad for p in self.params]
        for p in self.params:
            p.requires_grad_(True)

    def __exit__(self, *_):
        for p, was in zip(self.params, self.held):
            p.requires_grad_(was)


def _barrier(par) -> None:
    if par.distributed:
        import torch.distributed as dist

        dist.barrier()


def write_json(path: str, obj) -> None:
    from trex import atomic

    atomic.write_text(path, json.dumps(obj, indent=1) + "\n")


# ---- the job's view: set-up, phases, acceptance, export ---------------------------------------------------
ACCEPTANCE_FILE = "drafter_acceptance.json"
METRICS_FILE = "drafter_metrics.jsonl"


def job_prompt_files(recipe) -> tuple[list[str], str]:
    """The prompt files the re-fit reads and the recipe key that names them."""
    if recipe.drafter.prompts:
        return recipe.drafter.prompts, "drafter.prompts"
    mode = recipe.train.mode
    if mode in ("grpo", "distill"):
        return getattr(recipe, mode).prompts, f"{mode}.prompts"
    return recipe.data.paths, "data.paths"


def load_job_prompts(recipe, tokenizer) -> list[list[int]]:
    """The job's prompts as token ids (trex.posttrain.on_policy.load_prompts: an SFT record's conversation
    before its last assistant turn); ValueError in one line naming the key on records without prompts."""
    from trex.data.records import BadRecordError
    from trex.posttrain.on_policy import load_prompts

    files, key = job_prompt_files(recipe)
    try:
        return [p.ids for p in load_prompts(files, tokenizer, recipe.data.thinking)]
    except BadRecordError as e:
        line = " ".join(str(e).split())
        raise ValueError(f"{key} (the drafter's prompts): {line}; set drafter.prompts to prompt files") from None


class JobRefit:
    """``[drafter]`` in a training job: ``start`` (after set-up: the drafter loaded, sharded, resumed, and
    acceptance (a) measured on a fresh run), ``after_step`` (GRPO / distillation every ``every_n``),
    ``finish`` (after the main steps: (b), the last phase, (c), the export), ``summary``."""

    def __init__(self, recipe, model, tokenizer, par, dev, policy, out: str, config: dict):
        section = recipe.drafter
        section.check_against(recipe.train.mode, model.cfg)
        self.section, self.par, self.out = section, par, out
        self.main_steps = recipe.train.steps
        self.source = recipe.model.path
        kind = kind_of(model.cfg)
        self.kind = kind.__name__.rpartition(".")[2]
        drafter = kind.build(model, recipe, par, dev, policy)
        stop = () if tokenizer.eos_id is None else (tokenizer.eos_id,)
        self.refit = DrafterRefit(section, drafter, load_job_prompts(recipe, tokenizer), par, dev, tokenizer.pad_id,
                                  stop, recipe.checkpoint, out, config)
        self.checkpoints = self.refit.ckpt.directory
        self.acceptance: dict = {}
        self.main_time_s = 0.0  # the main steps' time in this process (a resumed run: since it resumed)
        self.exported: str | None = None

    def phases(self) -> int:
        """Phases in the run: one each ``every_n`` main steps before the last, and the last."""
        n = self.section.every_n
        return ((self.main_steps - 1) // n if n else 0) + 1

    def start(self, model, resumed_step: int | None) -> None:
        """Resume the re-fit where the run's checkpoints put it; measure (a) on a fresh run."""
        path = os.path.join(self.out, ACCEPTANCE_FILE)
        if resumed_step is None:
            self.acceptance = {"base": self.refit.acceptance(model).to_dict()}
            if self.par.is_main:
                write_json(path, self.acceptance)
            _keep_metrics(os.path.join(self.out, METRICS_FILE), 0, self.par.is_main)
            return
        if os.path.exists(path):
            with open(path) as f:
                self.acceptance = json.load(f)
        self._resume(resumed_step)

    def _resume(self, main_step: int) -> None:
        """The re-fit checkpoint that belongs with main checkpoint ``main_step``: the newest whose step K
        the run had reached by then (K <= the started phases' steps, a later one is the next attempt's)."""
        from trex.checkpoint.manifest import verify_checkpoint
        from trex.checkpoint.training import list_checkpoints

        R = self.section.steps
        started, complete = self._phases_at(main_step)
        ok = [(k, p) for k, p in list_checkpoints(self.checkpoints) if k <= started * R and verify_checkpoint(p).ok]
        if not ok:
            if complete:
                raise ValueError(f"checkpoint.resume: the run resumes at main step {main_step}, after "
                                 f"{complete} re-fit phase(s), and {self.checkpoints} holds no re-fit checkpoint "
                                 f"of them (drafter step <= {started * R})")
            _keep_metrics(os.path.join(self.out, METRICS_FILE), 0, self.par.is_main)
            return
        k, path = ok[-1]
        if k < complete * R:
            raise ValueError(f"checkpoint.resume: main step {main_step} follows re-fit step {complete * R}; the "
                             f"newest re-fit checkpoint in {self.checkpoints} at or before it is step {k}")
        self.refit.ckpt.section = dataclasses.replace(self.refit.ckpt.section, resume=path)
        self.refit.resume()
        _keep_metrics(os.path.join(self.out, METRICS_FILE), self.refit.done, self.par.is_main)

    def _phases_at(self, main_step: int) -> tuple[int, int]:
        """(phases started, phases complete) when main checkpoint ``main_step`` was written: a periodic phase
        runs after its step's checkpoint, the last one after the final checkpoint."""
        n, end = self.section.every_n, main_step >= self.main_steps
        started = (min(main_step, self.main_steps - 1) // n if n else 0) + end
        complete = started - 1 if end or (n and main_step % n == 0 and main_step) else started
        return started, max(complete, 0)

    def catch_up(self, model, main_step: int) -> str:
        """A run resumed at main step ``main_step`` (before the last) inside a periodic phase finishes it
        before its next main step, as the uninterrupted run did."""
        started, _ = self._phases_at(main_step)
        if main_step >= self.main_steps or not self.section.every_n:
            return "completed"
        return self.refit.phase(model, started * self.section.steps, self._log)

    def _log(self, row: dict) -> None:
        if self.par.is_main:
            with open(os.path.join(self.out, METRICS_FILE), "a") as f:
                f.write(json.dumps(row) + "\n")

    def after_step(self, model, step: int) -> str:
        """After main step ``step`` (and its checkpoint): a phase when ``every_n`` divides it (not the last)."""
        n = self.section.every_n
        if not n or step % n or step >= self.main_steps:
            return "completed"
        return self.refit.phase(model, step // n * self.section.steps, self._log)

    def finish(self, model) -> str:
        """After the main steps: (b) the post-trained target with the drafter the first phase found (the loaded
        one; for MTP modules in SFT, as the main steps trained them), the last phase, (c), the export."""
        if "post_trained_old" not in self.acceptance or self.refit.done < self.phases() * self.section.steps:
            self.acceptance["post_trained_old"] = self.refit.acceptance_before(model).to_dict()
        status = self.refit.phase(model, self.phases() * self.section.steps, self._log)
        if status != "completed":
            return status
        self.acceptance["refit"] = self.refit.acceptance(model).to_dict()
        if self.par.is_main:
            write_json(os.path.join(self.out, ACCEPTANCE_FILE), self.acceptance)
        kind = self.refit.kind
        self.exported = kind.export(self.refit.drafter, self.source, os.path.join(self.checkpoints, kind.EXPORT_DIR),
                                    self.main_steps, self.par.is_main)
        return status

    def summary(self) -> dict:
        """summary.json's ``drafter``: the three acceptances (base = (a), post_trained_old = (b), refit =
        (c); each null with a ``reason`` when it had no drafting steps), (c) against (a), the re-fit's steps
        (and those with a drafting position to train on), time against the main steps' and peak memory."""
        a, c = (self.acceptance.get(k, {}).get("mean_accepted") for k in ("base", "refit"))
        rows = self.refit.metrics
        return {"kind": self.kind, "acceptance": self.acceptance, "refit_vs_base": None if a is None or c is None else c - a,
                "steps": self.refit.done, "steps_with_signal": self.refit.position.signal[1], "phases": self.phases(),
                "time_s": self.refit.time_s,
                "main_time_s": self.main_time_s, "peak_memory_bytes": self.refit.peak_bytes,
                "first": rows[0] if rows else None, "last": rows[-1] if rows else None,
                "export": self.exported}

    def warnings(self) -> list[str]:
        """What a re-fit that ran should still be warned about, from what its steps and measures already read on
        the host: steps with nothing to train on (loss and gradient 0: the drafter did not move), an acceptance
        without drafting steps. The loop logs each and lists it in summary.json."""
        found = []
        steps, taught = self.refit.position.signal
        if steps and not taught:
            stop = f" (id {self.refit.stop_ids[0]})" if self.refit.stop_ids else ""
            found.append(f"drafter: no re-fit step had a position to train on: in all {logs.plural(steps, 'step')} "
                         f"every continuation of the target began with its stop token{stop}, so drafter/loss and "
                         "drafter/grad_norm were 0 and the drafter did not change; check what the target answers "
                         "the prompts, or give drafter.prompts it continues")
        held_out = logs.plural(len(self.refit.held_out), "held-out prompt")
        names = {"base": "(a) base", "post_trained_old": "(b) post-trained", "refit": "(c) re-fit"}
        for key, name in names.items():
            reason = self.acceptance.get(key, {}).get("reason")
            if reason:
                found.append(f"drafter: acceptance {name} not measured on the {held_out}: {reason}")
        return found


def _keep_metrics(path: str, upto: int, main: bool) -> None:
    """drafter_metrics.jsonl keeps the rows of re-fit steps <= ``upto`` (a resumed run writes the rest again)."""
    if not main or not os.path.exists(path):
        return
    with open(path) as f:
        rows = [line for line in f if line.strip() and json.loads(line)["drafter_step"] <= upto]
    from trex import atomic

    atomic.write_text(path, "".join(rows))
