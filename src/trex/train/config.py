"""The training recipe: one typed dataclass per TOML section.

    [model]      what to train: a preset or a checkpoint directory
    [data]       trex.data.DataConfig
    [optim]      trex.train.optim.OptimConfig
    [schedule]   trex.train.schedule.ScheduleConfig
    [precision]  trex.train.precision.PrecisionConfig
    [train]      steps, batch, losses, logging, evaluation
    [eval]       held-out data for the periodic evaluation loss
    [parallel]   the device mesh: data-parallel replicate / shard and expert-parallel sizes
    [checkpoint] trex.train.checkpointing.CheckpointSection: sharded checkpoints and resume
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trex.data.config import DataConfig
from trex.fidelity.signals import FidelitySection
from trex.train.checkpointing import CheckpointSection
from trex.train.optim import OptimConfig
from trex.train.precision import PrecisionConfig
from trex.train.schedule import ScheduleConfig


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
    progress: bool = True
    """Show a live progress bar when the output is a terminal."""

    def __post_init__(self) -> None:
        for name in ("steps", "grad_accum", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"train.{name} must be >= 1, got {getattr(self, name)}")


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
    timeout_s: int = 1800
    """Collective timeout in seconds."""

    def __post_init__(self) -> None:
        if self.activation_checkpointing not in ("none", "full", "selective"):
            raise ValueError(f"parallel.activation_checkpointing: expected none, full or selective, "
                             f"got {self.activation_checkpointing!r}")
        if self.dp_replicate < 1 or self.ep < 1 or (self.dp_shard < 1 and self.dp_shard != -1):
            raise ValueError("parallel: dp_replicate and ep must be >= 1 and dp_shard >= 1 or -1")

    def world_size(self, available: int) -> int:
        """Ranks the layout needs given ``available`` ranks (resolving dp_shard = -1)."""
        shard = available // self.dp_replicate if self.dp_shard == -1 else self.dp_shard
        return self.dp_replicate * shard


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
