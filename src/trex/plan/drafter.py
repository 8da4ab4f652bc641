"""What a recipe's ``[drafter]`` re-fit (trex.train.drafter_refit) adds to a plan: memory per device during a
re-fit phase and time per re-fit step, for DeepSeek-V4.1's DSpark drafter under the recipe's layout.

During a phase the main model's weights and optimizer state stay where they are (the main step's gradients
and activations are gone); on top of them each device holds the drafter's fp32 shard, its gradients and
AdamW moments, the drafter gathered at the compute dtype (one FSDP unit, its routed experts split by ``ep``),
the target's continuation (tap hidden at the compute dtype, fp32 logits of the generated positions) and the
drafter's training activations, whose largest part at a real vocabulary is the fp32 logits of every
(anchor, position) pair, kept three times (the draft's, its softmax, the target's softmax).

Time per step: the target's no-grad forward over prompt and continuation (2 FLOPs per active parameter and
token: prefill and decode costed alike, at the plan's compute efficiency, which a memory-bound decode does not
reach, so it is a lower bound), the drafter's forward and backward (6 per active parameter and token, the
frozen head's 4 per d x V), and FSDP's two gathers and one reduce-scatter of the drafter, of which the plan's
``fsdp_overlap`` hides a share. Prompts are assumed ``seq_len - new_tokens`` long: the longest a row holds.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from trex.plan.layout import Layout
from trex.plan.timing import TimeAssumptions, _group_seconds

STAGE_ACTIVATION_WORDS = 40  # fp32 words one drafted token keeps per stage for backward (mHC streams, attention, MoE)


@dataclass(frozen=True)
class DrafterPlan:
    steps: int  # re-fit steps per phase
    phases: int
    parameters: int  # the drafter's (its stages; the embedding and head are the target's)
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


def drafter_counts(cfg) -> tuple[int, int, int]:
    """(parameters, routed-expert parameters, active parameters per token) of ``cfg``'s DSpark drafter."""
    from trex.models.dspark import DSparkDrafter

    with torch.device("meta"):
        drafter = DSparkDrafter(cfg)
    total = sum(p.numel() for p in drafter.parameters())
    experts = sum(p.numel() for n, p in drafter.named_parameters() if ".ffn.experts." in n)
    return total, experts, total - experts + experts * cfg.dspark_num_experts_per_tok // cfg.dspark_n_routed_experts


def drafter_plan(cfg, section, layout: Layout, seq_len: int, hw, assume: TimeAssumptions, b: int,
                 main_memory, main_active: int, main_steps: int) -> DrafterPlan:
    """The re-fit of ``section`` (a DrafterSection) on ``layout``; ``b`` bytes of the compute dtype;
    ``main_memory`` the main plan's MemoryBreakdown, ``main_active`` its active parameters per token."""
    total, experts, active = drafter_counts(cfg)
    world = layout.devices
    T = section.block_size or cfg.dspark_block_size
    rows = max(1, section.prompts_per_step // layout.data_parallel)
    anchors = section.new_tokens - T
    tokens = rows * anchors * T
    prompt = max(1, seq_len - section.new_tokens)
    d, V, k = cfg.hidden_size, cfg.vocab_size, len(cfg.dspark_target_layer_ids)
    gathered = (total - experts + experts / layout.ep) * b
    activations = tokens * (cfg.num_nextn_predict_layers * STAGE_ACTIVATION_WORDS * d * 4 + 3 * V * 4)
    continuation = rows * (prompt + section.new_tokens) * k * d * b + rows * section.new_tokens * V * 4
    main = main_memory.weights + main_memory.optimizer + main_memory.gathered
    memory = {"weights": 4 * total / world, "gradients": 4 * total / world, "optimizer": 8 * total / world,
              "gathered": gathered, "activations": activations, "continuation": continuation, "main": main}
    memory["total"] = sum(memory.values())
    rate = hw.peak_flops(assume.dtype) * assume.compute_efficiency
    target = 2 * main_active * rows * (prompt + section.new_tokens) / rate
    drafter = (6 * active + 4 * d * V) * tokens / rate
    comm = _group_seconds(3 * (total - experts) * b, layout.fsdp, hw) * (1 - assume.fsdp_overlap) if world > 1 else 0.0
    time_s = {"target": target, "drafter": drafter, "fsdp_comm": comm, "total": target + drafter + comm}
    n = section.every_n
    phases = ((main_steps - 1) // n if n else 0) + 1
    return DrafterPlan(section.steps, phases, total, active, tokens, memory, time_s)
