"""The training recipe: one typed dataclass per TOML section.

    [model]      what to train: a preset or a checkpoint directory
    [data]       trex.data.DataSection
    [optim]      trex.train.optim.OptimSection
    [schedule]   trex.train.schedule.ScheduleSection
    [precision]  trex.precision.PrecisionSection
    [train]      mode, steps, batch, losses, logging, evaluation
    [eval]       held-out data for the periodic evaluation loss
    [parallel]   the device mesh: data-parallel replicate / shard and expert-parallel sizes
    [checkpoint] trex.checkpoint.training.CheckpointSection: sharded checkpoints and resume
    [dpo]        beta, label smoothing, reference model (train.mode = "dpo")
    [sampling]   generation settings of on-policy modes (grpo, distill)
    [grpo]       GRPO with verifiable rewards (train.mode = "grpo")
    [distill]    on-policy distillation from frozen teachers (train.mode = "distill")
    [environment] multi-turn, tool-using rollouts of grpo and distill (trex.posttrain.environment)
    [drafter]    re-fit DeepSeek-V4.1's DSpark drafter against the trained target (trex.train.drafter_refit)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

from trex.checkpoint.training import CheckpointSection
from trex.data.config import DataSection
from trex.models.registry import PRESETS, config_from_file, get_preset
from trex.parallel.mesh import ParallelSection
from trex.posttrain import TrainMode
from trex.posttrain.distill import DistillSection
from trex.posttrain.dpo import DPOSection
from trex.posttrain.environment import EnvironmentSection
from trex.posttrain.grpo import GRPOSection
from trex.posttrain.on_policy import SamplingSection
from trex.precision import PrecisionSection
from trex.recipe import RecipeError, check_choices, require_positive, unknown_key
from trex.train.drafter_refit import DrafterSection
from trex.train.optim import OptimSection
from trex.train.schedule import ScheduleSection
from trex.train.signals import FidelitySection
from trex.train.trackers import LoggingSection

CompileBackend = Literal["inductor", "aot_eager", "eager"]


@dataclass
class ModelSection:
    preset: str = "tiny"
    """Model preset (tiny, deepseek-v4-flash, deepseek-v4-pro), used when `path` is empty."""
    path: str = ""
    """A checkpoint directory (config.json + safetensors) to start from; overrides `preset`."""
    overrides: dict = field(default_factory=dict)
    """Config fields changed on top of the preset or of the checkpoint's config.json, e.g. { num_hidden_layers = 2 }
    on a preset, { num_nextn_predict_layers = 0 } on a checkpoint without MTP weights."""
    init_seed: int = 0
    """Seed of the random initialisation when training a preset from scratch."""

    def __post_init__(self) -> None:
        if not self.path and not self.preset:
            raise ValueError("model: set `preset` or `path`")
        if not self.overrides:
            return
        if self.path:  # the checkpoint's config class, when it is here (a missing or bad one is named at load)
            try:
                base = config_from_file(self.path)
            except ValueError:
                return
        elif self.preset in PRESETS:  # an unknown preset: named where it is built
            base = get_preset(self.preset)
        else:
            return
        fields = [f.name for f in dataclasses.fields(base) if f.init]
        for key in self.overrides:
            if key not in fields:
                raise RecipeError(unknown_key(key, fields, "model.overrides."), key=f"model.overrides.{key}")


@dataclass
class TrainSection:
    mode: TrainMode = "sft"
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
    router: Literal["auto", "frozen", "train"] = "auto"
    """The MoE routers: "train" updates the gates' weights (gradient) and their bias (``bias_gamma``);
    "frozen" keeps both as loaded; "auto": frozen in the RL modes (grpo, distill), trained otherwise. RL
    keeps them fixed because a route that moves between the sampler's forward and the trainer's turns
    the same tokens into different experts' outputs, which the policy ratio reads as a policy change;
    miles requires the gate and the bias frozen for V4 RL, and routing replay assumes it."""
    freeze_indexer: bool = True
    """Keep the lightning indexer fixed (its top-k gets no gradient from the LM loss anyway)."""
    engram: Literal["frozen", "train"] = "frozen"
    """DeepSeek-V4.1's Engram tables (197 B parameters in V4.1-Flash): "frozen" keeps them as loaded (the
    gate and projection around them still train); "train" updates the rows a step looks up, with row-wise
    AdaGrad (one fp32 per row of state: 3 GB for V4.1-Flash, where Adam's would be ~1.6 TB; see
    docs/model.md). Either way the tables are split by rows over every rank."""
    indexer_loss: float = 0.0
    """Weight of the indexer alignment loss: the KL from the main attention's distribution over the
    picked compressed entries to the indexer's, on every CSA layer, indexer inputs detached
    (trex.models.deepseek_v4.compressor.Indexer.align; logged as ``indexer_loss``). Needs freeze_indexer = false.
    DeepSeek-V3.2 (trex.models.deepseek_v3.dsa): the same KL over each query's picked tokens, the sparse
    training stage of DeepSeek's V3.2 report."""
    indexer_warmup: bool = False
    """DeepSeek-V3.2's dense warm-up stage: the attention stays dense, every parameter but the lightning
    indexer's is frozen (the routers too), and the indexer learns ``indexer_loss`` x its KL to the main
    attention over every visible token. Needs indexer_loss > 0 and a V3.2 model."""
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
    compile_backend: CompileBackend = "inductor"
    """torch.compile's backend when compiling: inductor (generated kernels), aot_eager (the same graphs,
    forward and backward partitioned as Inductor's, run by eager kernels: tells a lowering or codegen
    problem from a tracing one) or eager (the captured graphs only)."""

    def router_frozen(self) -> bool:
        """Whether the routers stay fixed (see ``router``)."""
        return (self.router == "frozen" or (self.router == "auto" and self.mode in ("grpo", "distill"))
                or self.indexer_warmup)

    def router_bias_gamma(self) -> float:
        """The bias update speed this run applies: ``bias_gamma``, or 0 with the routers frozen."""
        return 0.0 if self.router_frozen() else self.bias_gamma

    def compile_on(self, dev) -> bool:
        """Whether this run compiles on ``dev`` (a trex.device.Device)."""
        return (dev.is_accelerator and dev.compiles()) if self.compile == "auto" else self.compile

    def compile_with(self, dev) -> str | None:
        """The torch.compile backend this run compiles its blocks with on ``dev``; None: not compiled."""
        return self.compile_backend if self.compile_on(dev) else None

    def __post_init__(self) -> None:
        check_choices(self, "train")
        require_positive(self, "train", ("steps", "grad_accum", "log_every"))
        if self.indexer_loss < 0:
            raise ValueError(f"train.indexer_loss: {self.indexer_loss} is negative; expected a weight >= 0")
        if self.indexer_loss > 0 and self.freeze_indexer:
            raise ValueError("train.indexer_loss > 0 trains the indexer, which train.freeze_indexer = true keeps "
                             "fixed: set train.freeze_indexer = false")
        if self.indexer_warmup and self.indexer_loss <= 0:
            raise ValueError("train.indexer_warmup trains only the indexer, by train.indexer_loss x its KL: set "
                             "train.indexer_loss > 0 (and train.freeze_indexer = false)")


@dataclass
class EvalSection:
    paths: list[str] = field(default_factory=list)
    """Held-out data files, encoded like [data] (empty: no evaluation loss)."""
    batches: int = 8
    """Micro-batches per evaluation."""


@dataclass
class TrainRecipe:
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    optim: OptimSection = field(default_factory=OptimSection)
    schedule: ScheduleSection = field(default_factory=ScheduleSection)
    precision: PrecisionSection = field(default_factory=PrecisionSection)
    train: TrainSection = field(default_factory=TrainSection)
    eval: EvalSection = field(default_factory=EvalSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    fidelity: FidelitySection = field(default_factory=FidelitySection)
    dpo: DPOSection = field(default_factory=DPOSection)
    sampling: SamplingSection = field(default_factory=SamplingSection)
    grpo: GRPOSection = field(default_factory=GRPOSection)
    distill: DistillSection = field(default_factory=DistillSection)
    environment: EnvironmentSection = field(default_factory=EnvironmentSection)
    drafter: DrafterSection = field(default_factory=DrafterSection)
    logging: LoggingSection = field(default_factory=LoggingSection)

    def __post_init__(self) -> None:
        rows = self.data.seq_len // self.parallel.cp  # a rank's rows of a sequence, split over tp under SP
        if self.parallel.tp > 1 and self.parallel.sequence_parallel and rows % self.parallel.tp:
            raise ValueError(f"data.seq_len = {self.data.seq_len}: parallel.tp = {self.parallel.tp} does not divide "
                             f"the {rows} rows of a sequence per context-parallel rank that sequence parallelism "
                             f"splits; make it a multiple of cp x tp = {self.parallel.cp * self.parallel.tp}, or set "
                             "parallel.sequence_parallel = false")
