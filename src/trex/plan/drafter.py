"""What a recipe's ``[drafter]`` re-fit (trex.train.drafter_refit) adds to a plan: memory per device during a
re-fit phase and time per re-fit step, under the recipe's layout, for either drafter.

During a phase the main model's weights and optimizer state stay where they are (the main step's gradients
and activations are gone); on top of them each device holds the drafter's gradients and AdamW moments (fp32,
sharded), the drafter gathered at the compute dtype (one FSDP unit, its routed experts split by ``ep``), the
target's continuation and the drafter's training activations.

DeepSeek-V4.1's DSpark stages are a module of their own (fp32 weights of their own); the continuation holds the
tap layers' hidden at the compute dtype and fp32 logits of the generated positions; the activations' largest
part at a real vocabulary is the fp32 logits of every (anchor, position) pair, kept three times (the draft's,
its softmax, the target's softmax).

The multi-token prediction modules of DeepSeek-V4 and the V3 family are the model's (their weights are in the
main model's); each step runs the frozen model once more over prompt and continuation, teacher-forced, and the
modules over every position (their attention needs the context): activations of the modules at every
position, and the fp32 logits of every head (the main one and each module's) over the whole row, which the
model's forward returns; the training pairs are the continuation's (anchor, module) pairs.

Time per step: the target's no-grad forward over prompt and continuation (2 FLOPs per active parameter and
token: prefill and decode costed alike, at the plan's compute efficiency, which a memory-bound decode does not
reach, so it is a lower bound; MTP: a second, teacher-forced one), the drafter's forward and backward (6 per
active parameter and token, the frozen head's 4 per d x V), and FSDP's two gathers and one reduce-scatter of
the drafter, of which the plan's ``fsdp_overlap`` hides a share. Prompts are assumed ``seq_len - new_tokens``
long: the longest a row holds.

Under tensor parallelism (``Layout.tp``) the re-fit runs as trex.train.drafter_refit does: the tp ranks of a group
take the same prompts (rows per device as at tp = 1 with the same data-parallel ranks), and the target is the
split model, so each TP rank runs 1 / tp of its active parameters per token plus what TP leaves whole
(``ModelFacts.tp_whole_matmul``) on all of them. The DSpark stages are whole on every TP rank (EP splits their
routed experts, over the tp ranks too, each dispatching 1 / tp of the group's tokens; FSDP shards the rest over
dp_shard x cp only); they read the target's head and embedding whole, so their head FLOPs are not split. The
MTP modules are blocks of the model, split as the main plan splits them (``model_facts.TP_SPLIT``): their split
parameters, with their gradients and AdamW moments, 1 / tp on each TP rank, their FLOPs too, and the
vocabulary-parallel head's. What stays whole on every TP rank: the continuation (the tap layers' hidden states
are the replicated residual streams; the target's logits are gathered whole), every head's logits the MTP
forward returns (gathered whole) and the pairs' softmaxes, and the drafter's activations (the per-token
estimate does not separate the heads' share; whole, an upper bound). Not counted, at any tp: the target's and the
modules' TP all-reduces and EP all-to-alls, and the DSpark stages' whole copies of the head and embedding.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

import torch

from trex.plan.layout import Layout
from trex.plan.model_facts import TP_SPLIT, ModelFacts
from trex.plan.timing import TimeAssumptions, _group_seconds

STAGE_ACTIVATION_WORDS = 40  # fp32 words one drafted token keeps per stage for backward (mHC streams, attention, MoE)


@dataclass(frozen=True)
class DrafterPlan:
    steps: int  # re-fit steps per phase
    phases: int
    kind: str  # "dspark" (V4.1's stages) or "mtp" (the model's multi-token prediction modules)
    parameters: int  # the drafter's (its stages or modules; the embedding and head are the target's)
    active: int  # per drafted token (k of the drafter's routed experts)
    tokens_per_device: int  # drafted (anchor, position) pairs per step on one device
    memory: dict  # bytes per device: drafter weights, gradients, optimizer, gathered, activations, continuation,
    # main (the main model's weights, optimizer state and one gathered unit), total
    time_s: dict  # per re-fit step: target, drafter, fsdp_comm, total

    @property
    def phase_s(self) -> float:
        return self.steps * self.time_s["total"]

    def as_dict(self) -> dict:
        return {**asdict(self), "phase_s": self.phase_s}


def drafter_counts(cfg) -> tuple[int, int, int, int]:
    """(parameters, routed-expert parameters, active parameters per token, parameters tensor parallelism splits)
    of ``cfg``'s drafter: the DSpark stages (none split: whole on every TP rank), or the MTP modules (``mtp.*`` of
    the model built on the meta device; those ``model_facts.TP_SPLIT`` names)."""
    from trex.models.registry import architecture, drafter_kind

    if drafter_kind(cfg) == "dspark":  # a module of its own, the architecture's drafter
        with torch.device("meta"):
            named = list(architecture(cfg).load("drafter")(cfg).named_parameters())
        k, n = cfg.dspark_num_experts_per_tok, cfg.dspark_n_routed_experts
    else:
        from trex.models.build import build_model

        named = [(name, p) for name, p in build_model(cfg, device="meta").named_parameters() if name.startswith("mtp.")]
        k, n = cfg.num_experts_per_tok, cfg.n_routed_experts
    total = sum(p.numel() for _, p in named)
    experts = sum(p.numel() for name, p in named if ".ffn.experts." in name)
    split = 0 if drafter_kind(cfg) == "dspark" else sum(p.numel() for name, p in named if re.search(TP_SPLIT, name))
    return total, experts, total - experts + experts * k // n, split


def drafter_plan(cfg, section, layout: Layout, seq_len: int, hw, assume: TimeAssumptions, b: int,
                 main_memory, facts: ModelFacts, main_steps: int) -> DrafterPlan:
    """The re-fit of ``section`` (a DrafterSection) on ``layout``; ``b`` bytes of the compute dtype;
    ``main_memory`` the main plan's MemoryBreakdown, ``facts`` the main model's (its active parameters per token
    and what TP leaves whole)."""
    from trex.models.registry import drafter_kind

    kind = drafter_kind(cfg)
    total, experts, active, split = drafter_counts(cfg)
    tp = layout.tp
    expert_tp = tp if layout.ep > 1 else 1  # EP over the tp ranks (ep = 1: every TP rank holds and runs them all)
    dense = total - experts - split + split / tp  # a TP rank's parameters outside the routed experts
    held = dense + experts / expert_tp  # a TP rank's, before FSDP shards them over dp_shard x cp
    routed = active - (total - experts)  # routed-expert parameters active per token
    active_rank = active - routed - split + split / tp + routed / expert_tp
    mtp = kind == "mtp"
    T = cfg.num_nextn_predict_layers if mtp else section.block_size or cfg.dspark_block_size
    rows = max(1, section.prompts_per_step // layout.data_parallel)
    anchors = section.new_tokens - T
    tokens = rows * anchors * T
    prompt = max(1, seq_len - section.new_tokens)
    row = prompt + section.new_tokens
    d, V = cfg.hidden_size, cfg.vocab_size
    gathered = (dense + experts / layout.ep) * b
    if mtp:  # the modules over every position, every head's fp32 logits over the row, the pairs' softmaxes
        streams = getattr(cfg, "hc_mult", 1)
        activations = rows * row * (T * STAGE_ACTIVATION_WORDS * d * streams * 4 + (1 + T) * V * 4) + tokens * 2 * V * 4
        continuation = rows * section.new_tokens * V * 4
    else:
        k = len(cfg.dspark_target_layer_ids)
        activations = tokens * (cfg.num_nextn_predict_layers * STAGE_ACTIVATION_WORDS * d * 4 + 3 * V * 4)
        continuation = rows * row * k * d * b + rows * section.new_tokens * V * 4
    main = main_memory.weights + main_memory.optimizer + main_memory.gathered
    shards = layout.fsdp  # FSDP2 on the dp_mesh shards over dp_shard x cp (HSDP: whole over dp_replicate)
    memory = {"weights": 0.0 if mtp else 4 * held / shards, "gradients": 4 * held / shards,
              "optimizer": 8 * held / shards, "gathered": gathered, "activations": activations,
              "continuation": continuation, "main": main}
    memory["total"] = sum(memory.values())
    rate = hw.peak_flops(assume.dtype) * assume.compute_efficiency
    whole = facts.tp_whole_matmul if tp > 1 else 0
    target = (4 if mtp else 2) * ((facts.active - whole) / tp + whole) * rows * row / rate
    if mtp:  # the model's vocabulary-parallel head: 1 / tp of its rows on each TP rank
        drafter = (6 * active_rank * rows * row + (2 * d * V * (1 + T) * rows * row + 4 * d * V * tokens) / tp) / rate
    else:  # DSpark reads the head whole
        drafter = (6 * active_rank + 4 * d * V) * tokens / rate
    comm = _group_seconds(3 * dense * b, layout.fsdp, hw) * (1 - assume.fsdp_overlap)
    time_s = {"target": target, "drafter": drafter, "fsdp_comm": comm, "total": target + drafter + comm}
    n = section.every_n
    phases = ((main_steps - 1) // n if n else 0) + 1
    return DrafterPlan(section.steps, phases, kind, total, active, tokens, memory, time_s)
