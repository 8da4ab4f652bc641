"""The training recipe: one typed dataclass per TOML section.

    [model]      what to train: a preset or a checkpoint directory
    [data]       trex.data.DataConfig
    [optim]      trex.train.optim.OptimConfig
    [schedule]   trex.train.schedule.ScheduleConfig
    [precision]  trex.precision.PrecisionConfig
    [train]      mode, steps, batch, losses, logging, evaluation
    [eval]       held-out data for the periodic evaluation loss
    [parallel]   the device mesh: data-parallel replicate / shard and expert-parallel sizes
    [checkpoint] trex.checkpoint.training.CheckpointSection: sharded checkpoints and resume
    [dpo]        beta, label smoothing, reference model (train.mode = "dpo")
    [sampling]   generation settings of on-policy modes (grpo, distill)
    [grpo]       GRPO with verifiable rewards (train.mode = "grpo")
    [distill]    on-policy distillation from frozen teachers (train.mode = "distill")
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from trex.checkpoint.training import CheckpointSection
from trex.data.config import DataConfig
from trex.posttrain import TRAIN_MODES
from trex.precision import PrecisionConfig
from trex.recipe import require_positive
from trex.train.optim import OptimConfig
from trex.train.schedule import ScheduleConfig
from trex.train.signals import FidelitySection



@dataclass
class ModelSection:
    preset: str = "tiny"
    """Model preset (tiny, deepseek-v4-flash, deepseek-v4-pro), used when `path` is empty."""
    path: str = ""
    """A checkpoint directory (config.json + safetensors) to start from; overrides `preset`."""
    overrides: dict = field(default_factory=dict)
    """Config fields changed on top of the preset, e.g. { num_hidden_layers = 2 }."""
    init_seed: int = 0
    """Seed of the random initialisation when training a preset from scratch."""

    def __post_init__(self) -> None:
        if not self.path and not self.preset:
            raise ValueError("model: set `preset` or `path`")


@dataclass
class TrainSection:
    mode: str = "sft"
    """What the steps optimise (trex.posttrain): sft (continued pretraining / SFT; [data] mode picks the
    encoding), dpo ([dpo]), grpo ([grpo]), distill ([distill])."""
    steps: int = 100
    """Optimizer steps."""
    grad_accum: int = 1
    """Micro-batches per optimizer step (global batch = micro_batch_size x grad_accum x ranks)."""
    seed: int = 0
    """Seeds torch (dropout-free model: it matters for initialisation and data order)."""
    out: str = "runs/latest"
    """Run directory."""
    device: str = ""
    """Device override (cpu, cuda, npu, cuda:1 ...); empty: the device layer decides."""
    mtp_weight: float = 0.1
    """Weight of the MTP loss (V4 used 0.3, then 0.1 once the lr decays)."""
    balance_alpha: float = 1e-4
    """Weight of the sequence-wise balance loss."""
    bias_gamma: float = 1e-3
    """Speed of the aux-loss-free router bias update after each optimizer step (0 disables)."""
    freeze_indexer: bool = True
    """Keep the lightning indexer fixed (its top-k gets no gradient from the LM loss anyway)."""
    log_every: int = 1
    """Steps between metric lines (metrics.jsonl, TensorBoard, progress bar)."""
    eval_every: int = 0
    """Steps between held-out evaluations (0: only at the end, if [eval] has data)."""
    eval_at_start: bool = False
    """Also evaluate the starting model before step 1 (``summary.json`` ``eval["0"]``; not on resume)."""
    progress: bool = True
    """Show a live progress bar when the output is a terminal."""
    overwrite: bool = False
    """Replace an earlier run in ``out`` (its metrics, signals, TensorBoard events and checkpoints)
    instead of refusing to start; a resumed run continues it instead."""
    compile: bool | Literal["auto"] = "auto"
    """torch.compile each block and the head + loss (trex.parallel.plan.apply_compile); "auto": on
    accelerators that torch.compile has a backend for, off on CPU, where the compiled step is not
    faster (docs/benchmarks.md)."""

    def compile_on(self, dev) -> bool:
        """Whether this run compiles on ``dev`` (a trex.device.Device)."""
        return (dev.is_accelerator and dev.compiles()) if self.compile == "auto" else self.compile

    def __post_init__(self) -> None:
        if self.mode not in TRAIN_MODES:
            raise ValueError(f"train.mode = {self.mode!r}; expected one of {', '.join(TRAIN_MODES)}")
        require_positive(self, "train", ("steps", "grad_accum", "log_every"))


@dataclass
class DPOSection:
    """The ``[dpo]`` section: direct preference optimisation (``train.mode = "dpo"``, trex.posttrain.dpo)."""

    beta: float = 0.1
    """Strength of the implicit KL to the reference: rewards are beta * (log pi - log pi_ref)."""
    label_smoothing: float = 0.0
    """Conservative DPO: the assumed probability that a pair's preference label is flipped, in [0, 0.5)."""
    reference: str = "precompute"
    """precompute: the reference's sequence log-probs of every pair once at start; online: a frozen
    reference model scores each batch (memory for a second model, no start-up pass)."""
    reference_path: str = ""
    """The reference model's checkpoint directory; empty: the initial policy."""
    rpo_alpha: float = 0.0
    """RPO: add rpo_alpha x the chosen response's mean per-token NLL to each pair's loss, so the
    chosen answer keeps its likelihood while the margin grows (0: plain DPO)."""

    def __post_init__(self) -> None:
        if self.rpo_alpha < 0:
            raise ValueError(f"dpo.rpo_alpha must be >= 0, got {self.rpo_alpha}")
        if self.beta <= 0:
            raise ValueError(f"dpo.beta must be > 0, got {self.beta}")
        if not 0 <= self.label_smoothing < 0.5:
            raise ValueError(f"dpo.label_smoothing must be in [0, 0.5), got {self.label_smoothing}")
        if self.reference not in ("precompute", "online"):
            raise ValueError(f"dpo.reference: expected precompute or online, got {self.reference!r}")


@dataclass
class EvalSection:
    paths: list[str] = field(default_factory=list)
    """Held-out data files, encoded like [data] (empty: no evaluation loss)."""
    batches: int = 8
    """Micro-batches per evaluation."""


@dataclass
class ParallelSection:
    dp_replicate: int = 1
    """Data-parallel replicas (the outer, replicated dimension of HSDP)."""
    dp_shard: int = -1
    """Ranks that shard parameters, gradients and optimizer state (FSDP); -1: all ranks not used by
    dp_replicate."""
    ep: int = 1
    """Expert-parallel size: routed experts are split across this many ranks of the shard dimension."""
    activation_checkpointing: str = "none"
    """none | full | selective (recompute mHC and attention)."""
    reduce_every_micro_batch: bool = False
    """With grad_accum > 1: reduce-scatter gradients after every micro-batch, so only sharded fp32
    gradients accumulate (grad_accum reduce-scatters per step). Off: one reduce-scatter after the
    last micro-batch, and FSDP2 keeps the stage's gradients unsharded in between (see trex plan)."""
    timeout_s: int = 1800
    """Collective timeout in seconds: how long a rank waits in one collective before the backend
    gives up (long enough for a first step that compiles on a large cluster)."""
    heartbeat_timeout_s: float = 300
    """Seconds after which a rank that sends no heartbeat, or is stuck at one place of the loop while
    the others moved on, is named and the job stops (exit 4); 0: off. See trex.parallel.watchdog."""

    def __post_init__(self) -> None:
        if self.activation_checkpointing not in ("none", "full", "selective"):
            raise ValueError(f"parallel.activation_checkpointing: expected none, full or selective, "
                             f"got {self.activation_checkpointing!r}")
        if self.dp_replicate < 1 or self.ep < 1 or (self.dp_shard < 1 and self.dp_shard != -1):
            raise ValueError("parallel: dp_replicate and ep must be >= 1 and dp_shard >= 1 or -1")
        if self.timeout_s <= 0 or self.heartbeat_timeout_s < 0:
            raise ValueError("parallel: timeout_s must be > 0 and heartbeat_timeout_s >= 0 (0: no heartbeat)")

    def world_size(self, available: int) -> int:
        """Ranks the layout needs given ``available`` ranks (resolving dp_shard = -1)."""
        shard = available // self.dp_replicate if self.dp_shard == -1 else self.dp_shard
        return self.dp_replicate * shard


@dataclass
class SamplingSection:
    """How on-policy modes (grpo, distill) sample completions (trex.rollout.SamplingParams)."""
    temperature: float = 1.0
    """Sampling temperature (0: greedy)."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p."""
    max_new_tokens: int = 64
    """Longest completion; one cut here is "truncated" (no stop token)."""
    batch_size: int = 64
    """Prompts per generation batch."""

    def __post_init__(self) -> None:
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.max_new_tokens < 1 or self.batch_size < 1:
            raise ValueError("sampling: expected temperature >= 0, 0 < top_p <= 1, max_new_tokens >= 1, "
                             "batch_size >= 1")


@dataclass
class GRPOSection:
    """GRPO with verifiable rewards (trex.posttrain.grpo)."""
    prompts: list[str] = field(default_factory=list)
    """Prompt files: JSONL records {"prompt": str | "messages": [...], "answer": ...}."""
    eval_prompts: list[str] = field(default_factory=list)
    """Held-out prompt files (same format): greedy exact match and reward at each evaluation."""
    eval_limit: int = 0
    """Held-out prompts evaluated (0: all)."""
    prompts_per_step: int = 8
    """Prompts per optimizer step over all ranks (each rank takes an equal share)."""
    group_size: int = 8
    """Completions sampled per prompt (G); advantages are normalised within each group."""
    rewards: list[str] = field(default_factory=lambda: ["exact_match"])
    """Reward functions: built-in names, trex.rewards entry points or module:function paths."""
    reward_weights: list[float] = field(default_factory=list)
    """One weight per reward (empty: all 1)."""
    scale_by_std: bool = True
    """Divide advantages by the group's reward std (False: Dr. GRPO)."""
    eps_low: float = 0.2
    """Lower clip of the policy ratio: 1 - eps_low."""
    eps_high: float = 0.2
    """Upper clip of the policy ratio: 1 + eps_high (DAPO raises it, e.g. 0.28)."""
    kl_coef: float = 0.0
    """Weight of the k3 KL to the reference model (0: no reference is loaded)."""
    reference: str = ""
    """Reference checkpoint directory; empty: a frozen copy of the initial policy."""
    aggregation: str = "token"
    """token (mean over all tokens) | sequence (mean per completion, then over completions) |
    constant (sum / (max_new_tokens x completions), no length bias)."""
    mask_truncated: bool = False
    """Completions cut at max_new_tokens contribute no loss (they still count in the metrics)."""
    ppo_epochs: int = 1
    """Optimizer steps per sampled batch (> 1: later steps reuse the batch with the clipped ratio)."""
    micro_batch_size: int = 32
    """Completions per training forward."""
    seed: int = 0
    """Seeds the prompt order and the sampler."""

    def __post_init__(self) -> None:
        if self.aggregation not in ("token", "sequence", "constant"):
            raise ValueError(f"grpo.aggregation = {self.aggregation!r}; expected token, sequence or constant")
        require_positive(self, "grpo", ("prompts_per_step", "ppo_epochs", "micro_batch_size"))
        if self.group_size < 2:
            raise ValueError(f"grpo.group_size must be >= 2, got {self.group_size}")
        if self.eps_low < 0 or self.eps_high < 0 or self.kl_coef < 0:
            raise ValueError("grpo: eps_low, eps_high and kl_coef must be >= 0")


@dataclass
class TeacherSpec:
    path: str = ""
    """Teacher checkpoint directory (same tokenizer/vocabulary as the student)."""
    weight: float = 1.0
    """w_i in sum_i w_i KL(student || teacher_i)."""

    def __post_init__(self) -> None:
        if not self.path or self.weight < 0:
            raise ValueError(f"distill.teachers: expected {{path = \"...\", weight >= 0}}, got path={self.path!r} "
                             f"weight={self.weight}")


@dataclass
class DistillSection:
    """On-policy distillation (trex.posttrain.distill): the student samples, teachers score its tokens."""
    teachers: list[TeacherSpec] = field(default_factory=list)
    """Teachers: [{ path = "...", weight = 1.0 }, ...]."""
    prompts: list[str] = field(default_factory=list)
    """Prompt files: JSONL records {"prompt": str | "messages": [...], "answer": ... (optional)}."""
    eval_prompts: list[str] = field(default_factory=list)
    """Held-out prompt files: reverse KL to each teacher and, with answers, greedy exact match."""
    eval_limit: int = 0
    """Held-out prompts evaluated (0: all)."""
    prompts_per_step: int = 16
    """Prompts per optimizer step over all ranks."""
    samples_per_prompt: int = 1
    """Completions sampled per prompt."""
    micro_batch_size: int = 32
    """Completions per training forward."""
    chunk: int = 1024
    """Positions per chunk of the full-vocabulary KL (bounds its fp32 memory)."""
    seed: int = 0
    """Seeds the prompt order and the sampler."""

    def __post_init__(self) -> None:
        require_positive(self, "distill", ("prompts_per_step", "samples_per_prompt", "micro_batch_size", "chunk"))


@dataclass
class TrainRecipe:
    model: ModelSection = field(default_factory=ModelSection)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    train: TrainSection = field(default_factory=TrainSection)
    eval: EvalSection = field(default_factory=EvalSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    fidelity: FidelitySection = field(default_factory=FidelitySection)
    dpo: DPOSection = field(default_factory=DPOSection)
    sampling: SamplingSection = field(default_factory=SamplingSection)
    grpo: GRPOSection = field(default_factory=GRPOSection)
    distill: DistillSection = field(default_factory=DistillSection)
