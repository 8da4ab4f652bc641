"""A training layout: how ranks split a model and its batch, checked against the model.

    devices = dp_replicate x dp_shard x cp x tp x pp
    dp_shard   data-parallel ranks sharding parameters, gradients and optimizer state (FSDP / ZeRO-3);
    cp         context parallel: each sequence split over this many ranks, which also shard the
               parameters (FSDP over dp_shard x cp) and read the same micro-batches;
    tp         tensor parallel: attention heads, the dense FFNs and shared experts split column/row-wise,
               embedding and head by vocabulary (the V3 family as Megatron / torchtitan, with sequence
               parallelism between them; V4 and V4.1 as trex's TP runs them: the family's plan terms); the TP
               ranks of a group read the same micro-batches and are the innermost (adjacent) ranks, inside one
               node when they fit;
    ep         routed experts split over this many ranks carved from dp_shard x cp x tp (torchtitan's
               expert_tensor_parallel_degree = 1: experts are never TP-split; under TP each rank
               dispatches its own tokens of the group's sequence); trex train splits them over
               ep / tp ranks of dp_shard x the tp ranks, never over cp, so there ep must be tp times a
               divisor of dp_shard (ep dividing dp_shard at tp = 1; `Layout.train_refusal`: a search
               offers only layouts trex train runs, an explicit one says why not). The expert
               weights are FSDP-sharded over the dp_shard x cp x tp / ep ranks left;
    pp         pipeline stages, each holding num_hidden_layers / pp blocks (trex train has no
               pipeline parallelism yet: plans with pp > 1 say so);
    global batch tokens = micro_batch x seq_len x grad_accum x dp_replicate x dp_shard.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from trex.models.registry import ARCHITECTURES, AnyConfig, architecture, check_shardable
from trex.plan.terms import terms

RECOMPUTE = ("none", "selective", "full")


def check_context_parallel(cfg: AnyConfig, seq_len: int, cp: int) -> None:
    """ValueError unless a sequence of ``seq_len`` splits over ``cp`` context-parallel ranks, by the rule of the
    model's family (trex.models.registry.check_shardable: V4's compression windows and halos, the V3 family's
    equal shards); the message names lengths that would work."""
    check_shardable(cfg, seq_len, cp)


class PlanError(ValueError):
    """Input the planner cannot plan for; the message says what was expected."""


def check_tensor_parallel(cfg: AnyConfig, tp: int) -> None:
    """PlanError unless ``tp`` divides everything tensor parallelism splits in the model (the family's
    ``tp_split``: for the DeepSeek-V3 family the attention heads, the vocabulary, the dense FFN and shared-expert
    widths; for V4 and V4.1 the heads, the output groups, the vocabulary and the shared expert's width); the
    message names the numbers, or why the family's TP is not planned."""
    if tp == 1:
        return
    if not architecture(cfg).tp_plan:  # what trex.parallel.tensor_parallel would refuse
        planned = sorted(name for name, a in ARCHITECTURES.items() if a.tp_plan)
        raise PlanError(f"layout: tp={tp}: {cfg.architecture} has no tensor-parallel plan (families with one: "
                        f"{', '.join(planned)})")
    try:
        split = terms(cfg).tp_split(cfg)
    except NotImplementedError as e:
        raise PlanError(f"layout: tp={tp}: {e}") from None
    bad = [f"{n} {v}" for n, v in split.items() if v and v % tp]
    if bad:
        raise PlanError(f"layout: tp={tp} does not divide the model's {', '.join(bad)}")


@dataclass(frozen=True)
class Trained:
    """What trains that post-training leaves frozen by default (a layout's ``train_engram``, ``train_indexer``; a
    search keeps them as it finds layouts): V4.1's Engram tables, the lightning indexer."""

    engram: bool = False
    indexer: bool = False


@dataclass(frozen=True)
class Layout:
    dp_shard: int
    dp_replicate: int = 1
    ep: int = 1
    cp: int = 1
    tp: int = 1
    sequence_parallel: bool = True  # with tp > 1: the rows between the split regions split over the tp ranks
    pp: int = 1
    micro_batch: int = 1
    grad_accum: int = 1
    recompute: str = "none"
    optimizer: str = "muon"
    offload_optimizer: bool = False  # optimizer moments in host memory (a "virtual optimizer")
    reduce_every_micro_batch: bool = False  # reduce-scatter per micro-batch: no unsharded gradient accumulation
    train_engram: bool = False  # V4.1: [train] engram = "train" (the tables' gradients and row-wise AdaGrad)
    train_indexer: bool = False  # [train] indexer_loss > 0: the lightning indexer trains (its KL to the main
    #                              attention: its FLOPs, gradients and optimizer state, not its Newton-Schulz
    #                              FLOPs); frozen otherwise

    def trained(self) -> Trained:
        return Trained(self.train_engram, self.train_indexer)

    @property
    def devices(self) -> int:
        return self.dp_replicate * self.dp_shard * self.cp * self.tp * self.pp

    @property
    def fsdp(self) -> int:
        """Ranks one parameter (a TP shard of it, under TP) is sharded over: dp_shard x cp."""
        return self.dp_shard * self.cp

    @property
    def expert_fsdp(self) -> int:
        """Ranks one expert's weights are FSDP-sharded over: the dp_shard x cp x tp ranks per ep rank."""
        return self.dp_shard * self.cp * self.tp // self.ep

    @property
    def data_parallel(self) -> int:
        return self.dp_replicate * self.dp_shard

    def global_batch_tokens(self, seq_len: int) -> int:
        return self.micro_batch * seq_len * self.grad_accum * self.data_parallel

    def describe(self) -> str:
        parts = [f"dp_shard={self.dp_shard}", f"ep={self.ep}"] + ([f"cp={self.cp}"] if self.cp > 1 else [])
        parts += [f"tp={self.tp}"] if self.tp > 1 else []
        parts += ["no-sequence-parallel"] if self.tp > 1 and not self.sequence_parallel else []
        if self.dp_replicate > 1:
            parts.insert(0, f"dp_replicate={self.dp_replicate}")
        if self.pp > 1:
            parts.append(f"pp={self.pp}")
        parts += [f"mb={self.micro_batch}", f"ga={self.grad_accum}", f"recompute={self.recompute}", self.optimizer]
        if self.offload_optimizer:
            parts.append("offload")
        if self.reduce_every_micro_batch and self.grad_accum > 1:
            parts.append("reduce-every-micro-batch")
        if self.train_engram:
            parts.append("engram-trained")
        if self.train_indexer:
            parts.append("indexer-trained")
        return " ".join(parts)

    def train_refusal(self) -> str | None:
        """Why trex train would refuse this layout today, beyond what :meth:`check` checks (None: it runs it): no
        pipeline parallelism, and experts split over ep / tp ranks of dp_shard x the tp ranks, never over cp
        (trex.parallel.mesh.check_expert_split, the check trex train runs)."""
        from trex.parallel.mesh import check_expert_split  # here: it imports torch.distributed

        if self.pp > 1:
            return "pipeline parallelism is modelled, but trex train does not run it yet"
        try:
            check_expert_split(self.dp_shard, self.ep, self.tp)
        except ValueError as e:
            return (f"trex train refuses it ({e}): ep={self.ep} spans context-parallel ranks or a part of the tp "
                    "ranks, as torchtitan may place experts (expert_tensor_parallel_degree = 1)")
        return None

    def check(self, cfg: AnyConfig, seq_len: int) -> None:
        """Raise PlanError unless the layout divides the model and the sequence is allowed."""
        for name in ("dp_shard", "dp_replicate", "ep", "cp", "tp", "pp", "micro_batch", "grad_accum"):
            if getattr(self, name) < 1:
                raise PlanError(f"layout: {name} must be >= 1, got {getattr(self, name)}")
        if self.recompute not in RECOMPUTE:
            raise PlanError(f"layout: recompute must be one of {list(RECOMPUTE)}, got {self.recompute!r}")
        from trex.train.optim import OPTIMIZERS  # here: it imports DTensor, which a CLI that never plans skips

        if self.optimizer not in OPTIMIZERS:
            raise PlanError(f"layout: optimizer must be one of {list(OPTIMIZERS)}, got {self.optimizer!r}")
        E, L = cfg.n_routed_experts, cfg.num_hidden_layers
        if E % self.ep:
            raise PlanError(f"layout: ep={self.ep} does not divide the model's {E} routed experts")
        if self.tp == 1 and self.dp_shard % self.ep:
            raise PlanError(f"layout: ep={self.ep} must divide dp_shard={self.dp_shard} (experts are split inside "
                            "the shard group)")
        if (self.dp_shard * self.cp * self.tp) % self.ep:
            raise PlanError(f"layout: ep={self.ep} must divide dp_shard x cp x tp = {self.dp_shard} x {self.cp} x "
                            f"{self.tp} (the ranks experts are split over)")
        check_tensor_parallel(cfg, self.tp)
        if L % self.pp:
            raise PlanError(f"layout: pp={self.pp} does not divide the model's {L} layers")
        if seq_len < 1 or seq_len > cfg.max_position_embeddings:
            raise PlanError(f"sequence length {seq_len} is outside 1..{cfg.max_position_embeddings} "
                            "(the model's max_position_embeddings)")
        try:
            check_context_parallel(cfg, seq_len, self.cp)
        except ValueError as e:
            raise PlanError(f"layout: {e}") from None
        if (seq_len // self.cp) % self.tp:
            raise PlanError(f"layout: tp={self.tp} does not divide the {seq_len // self.cp} rows of a sequence per "
                            "context-parallel rank (sequence parallelism splits them)")
        if self.train_indexer:
            from trex.plan.terms import terms

            try:
                trained = sum(terms(cfg).indexer_training_flops(cfg, seq_len))
            except NotImplementedError as e:
                raise PlanError(f"layout: train_indexer: {e}") from None
            if not trained:
                raise PlanError(f"layout: train_indexer: {cfg.architecture} has no lightning indexer")


def parse_layout(text: str, base: Layout) -> Layout:
    """``"dp_shard=64,ep=32,pp=1"`` (any Layout field) applied on top of ``base``."""
    fields = {f.name: f for f in dataclasses.fields(Layout)}
    changes = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or key not in fields:
            raise PlanError(f"--layout: cannot read {item!r}; expected key=value with key one of {sorted(fields)}")
        kind = fields[key].type
        try:
            if kind in ("int", int):
                changes[key] = int(value)
            elif kind in ("bool", bool):
                changes[key] = value.strip().lower() in ("1", "true", "yes")
            else:
                changes[key] = value.strip()
        except ValueError:
            raise PlanError(f"--layout: {key} expects an integer, got {value!r}") from None
    return dataclasses.replace(base, **changes)
