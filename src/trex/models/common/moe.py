"""Mixture of experts: the router (``Gate``: scores, top-k with the aux-loss-free bias or a token-id hash
table, routing replay), the routed experts stacked per layer and run as grouped matmuls over rows
sorted by expert (``Experts``; expert parallelism moves the sorted rows between the sort and the FFN),
the shared expert (also a dense SwiGLU MLP), and the layer (``MoE``) with its statistics (``MoEStats``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from trex import kernels
from trex.kernels import quantize
from trex.models.common.config import HASH_MOE
from trex.models.common.context import SequenceContext
from trex.models.common.linear import QuantLinear, QuantSim, linear_fp32


class MoEConfig(Protocol):
    """The config fields a MoE layer reads (every DeepSeek family's config has them)."""

    vocab_size: int
    hidden_size: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    scoring_func: str  # "sqrtsoftplus", "sigmoid" or "softmax"
    norm_topk_prob: bool
    routed_scaling_factor: float
    swiglu_limit: float  # <= 0: no clamp
    fp8_block: int
    # and optionally n_group, topk_group (DeepSeek-V3's group-limited routing, ``limit_groups``); a config
    # without them (DeepSeek-V4's) routes over one group


@dataclass
class MoEStats:
    """Per-layer routing facts for the training loop (balance loss, bias update, load metrics)."""

    layer: str
    counts: torch.Tensor  # [E] tokens routed to each expert (detached)
    balance_loss: torch.Tensor | None  # sequence-wise balance loss (score-routed layers, training only)


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """silu(gate) * up in fp32, gate clamped above and up to [-limit, limit]; ``limit <= 0`` means no
    clamp (as the official ``Expert`` reads ``swiglu_limit = 0``)."""
    gate, up = gate.float(), up.float()
    if limit > 0:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return F.silu(gate) * up


class SharedExpert(nn.Module):
    """A SwiGLU MLP: w2(clamped_swiglu(w1(x), w3(x))), x [..., dim] -> [..., dim]. ``input``, an identity without
    parameters (no name in the state dict), is where x is taken in once for both w1 and w3: the point a
    parallelism hooks to act on the input once (tensor parallelism's split region starts there)."""

    def __init__(self, dim: int, inter: int, limit: float, block: int):
        super().__init__()
        self.limit = limit
        self.input = nn.Identity()
        self.w1 = QuantLinear(dim, inter, block=block)
        self.w2 = QuantLinear(inter, dim, block=block)
        self.w3 = QuantLinear(dim, inter, block=block)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.input(x)
        return self.w2(clamped_swiglu(self.w1(h), self.w3(h), self.limit).to(x.dtype))


def expert_counts(idx: torch.Tensor, n_experts: int, valid: torch.Tensor | None = None) -> torch.Tensor:
    """idx [T, k] expert ids -> [E] long rows per expert, on the device (``bincount`` reads its
    input's maximum back to the host on accelerators; a scatter-add does not); with ``valid`` [T]
    only the valid tokens' rows."""
    flat = idx.reshape(-1)
    ones = torch.ones_like(flat) if valid is None else valid.long()[:, None].expand_as(idx).reshape(-1)
    return flat.new_zeros(n_experts).scatter_add_(0, flat, ones)


@dataclass
class ExpertSort:
    """The (token, expert) pairs of a routed batch, sorted by expert: ``order`` [T*k] positions into
    the flattened [T, k] choices, ``token`` [T*k] the token of each sorted row, ``counts`` [E] rows
    per expert (long, on the device)."""

    order: torch.Tensor
    token: torch.Tensor
    counts: torch.Tensor


def sort_by_expert(idx: torch.Tensor, n_experts: int) -> ExpertSort:
    """Sort the choices idx [T, k] by expert (stable: tokens keep their order within an expert)."""
    order = idx.reshape(-1).argsort(stable=True)
    return ExpertSort(order, order // idx.shape[1], expert_counts(idx, n_experts))


def expert_ffn(xs: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor,
               row_weights: torch.Tensor, limit: float, quant: QuantSim = QuantSim(),
               act_block: int = quantize.FP8_BLOCK) -> torch.Tensor:
    """The routed experts on rows sorted by expert: xs [R, d], counts [E] rows per expert (device
    tensor), w1/w3 [E, I, d], w2 [E, d, I], row_weights [R] each row's routing weight, applied to the
    fp32 SwiGLU output before w2 (as the official code does) -> [R, d]. Grouped matmuls over device-side
    offsets: no host read. ``quant``: FP4 weights and FP8 inputs (blocks of ``act_block``) of both GEMMs,
    as served."""
    offsets = counts.cumsum(0).to(torch.int32)
    mm = kernels.get("grouped_mm", xs.device.type)
    if quant.experts:
        w1, w2, w3 = (quantize.fake_fp4_weight(w) for w in (w1, w2, w3))
    act = (lambda t: quantize.fake_fp8_act(t, act_block)) if quant.activations else (lambda t: t)
    xs = act(xs)
    h = clamped_swiglu(mm(xs, w1, offsets), mm(xs, w3, offsets), limit)
    return mm(act((h * row_weights[:, None].float()).to(xs.dtype)), w2, offsets)


def combine(y: torch.Tensor, token: torch.Tensor, T: int) -> torch.Tensor:
    """Sum the sorted rows' outputs y [R, d] back into their tokens -> fp32 [T, d] (the official MoE
    accumulates its experts in fp32; a bf16 sum would round after every expert)."""
    return y.new_zeros(T, y.shape[1], dtype=torch.float32).index_add_(0, token, y.float())


class Experts(nn.Module):
    """E routed experts stacked as w1, w3: [E, I, d] and w2: [E, d, I]. The forward is the dispatch
    every layout shares: sort by expert, grouped SwiGLU, combine; expert parallelism
    (trex.parallel.expert_parallel) moves the sorted rows between the sort and the FFN."""

    quant = QuantSim()

    def __init__(self, n: int, dim: int, inter: int, limit: float, act_block: int = quantize.FP8_BLOCK):
        super().__init__()
        self.limit, self.act_block = limit, act_block
        self.w1 = nn.Parameter(torch.empty(n, inter, dim))
        self.w2 = nn.Parameter(torch.empty(n, dim, inter))
        self.w3 = nn.Parameter(torch.empty(n, inter, dim))

    def optimizer_rules(self) -> dict[str, tuple[str, list[int]]]:
        """{parameter: (optimizer rule, row blocks)} (trex.train.optim.classify): each expert a matrix of its own."""
        return {w: ("experts", []) for w in ("w1", "w2", "w3")}

    def forward(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x: [T, d]; idx, weights: [T, k] -> sum_k weights * expert_idx(x): fp32 [T, d]."""
        sort = sort_by_expert(idx, self.w1.shape[0])
        y = expert_ffn(x[sort.token], sort.counts, self.w1, self.w2, self.w3, weights.reshape(-1)[sort.order],
                       self.limit, self.quant, self.act_block)
        return combine(y, sort.token, x.shape[0])


def limit_groups(biased: torch.Tensor, n_group: int, topk_group: int) -> torch.Tensor:
    """DeepSeek-V3's group-limited routing: the experts [T, E] split into ``n_group`` groups of E / n_group,
    each group scored by the sum of its two best (biased) scores; the experts outside a token's
    ``topk_group`` best groups get -inf, so its top-k comes from those groups only."""
    T, E = biased.shape
    grouped = biased.view(T, n_group, E // n_group)
    group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [T, n_group]
    keep = group_scores.topk(topk_group, dim=-1, sorted=False).indices
    mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
    return grouped.masked_fill(~mask[:, :, None], float("-inf")).view(T, E)


class Gate(nn.Module):
    """Router: sqrt(softplus), sigmoid or softmax affinities in fp32; top-k with the aux-loss-free bias
    (within the best groups when the config has ``n_group`` > 1: DeepSeek-V3), or a hash table."""

    def __init__(self, cfg: MoEConfig, hashed: bool):
        super().__init__()
        self.cfg, self.hashed = cfg, hashed
        self.n_group, self.topk_group = getattr(cfg, "n_group", 1), getattr(cfg, "topk_group", 1)
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size))
        if hashed:
            self.register_buffer("tid2eid", torch.zeros(cfg.vocab_size, cfg.num_experts_per_tok, dtype=torch.long))
        else:
            self.register_buffer("bias", torch.zeros(cfg.n_routed_experts, dtype=torch.float32))

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        logits = linear_fp32(x, self.weight)
        fn = self.cfg.scoring_func
        if fn == "sqrtsoftplus":
            return F.softplus(logits).sqrt()
        return logits.sigmoid() if fn == "sigmoid" else logits.softmax(dim=-1)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor, replay: torch.Tensor | None = None):
        """x: [T, d] -> (weights [T, k] fp32, idx [T, k], scores [T, E] fp32). ``replay`` [T, k]: routing replay,
        the experts each token takes (its row -1: route it here); the weights are this router's scores of them."""
        s = self.scores(x)
        if self.hashed:
            idx = self.tid2eid[input_ids.reshape(-1)].long()
        else:
            biased = s + self.bias
            if self.n_group > 1:
                biased = limit_groups(biased, self.n_group, self.topk_group)
            idx = biased.topk(self.cfg.num_experts_per_tok, dim=-1, sorted=False).indices
        if replay is not None:
            idx = torch.where(replay[:, :1] >= 0, replay, idx)
        w = s.gather(1, idx)
        if self.cfg.norm_topk_prob and self.cfg.scoring_func != "softmax":
            w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        return w * self.cfg.routed_scaling_factor, idx, s


class MoE(nn.Module):
    def __init__(self, cfg: MoEConfig, mlp_type: str, name: str):
        super().__init__()
        self.name = name
        self.routing: tuple[torch.Tensor, torch.Tensor | None] | None = None  # (counts, balance loss)
        self.gate = Gate(cfg, hashed=mlp_type == HASH_MOE)
        self.experts = Experts(cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.swiglu_limit,
                               cfg.fp8_block)
        self.shared_experts = SharedExpert(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts,
                                           cfg.swiglu_limit, cfg.fp8_block)

    def forward(self, x: torch.Tensor, ctx: SequenceContext) -> torch.Tensor:
        B, S, d = x.shape
        flat = x.reshape(-1, d)
        replay = None if ctx.routes is None else ctx.routes.get(self.name)
        if replay is not None:  # [B, S, k] over whole rows, -1 where the sampler recorded none
            replay = replay[:, ctx.t0:ctx.t1].reshape(B * S, -1).to(flat.device)
        weights, idx, scores = self.gate(flat, ctx.input_ids, replay)
        if ctx.route_log is not None:  # routing recording: the experts of this forward's tokens
            ctx.route_log[self.name] = idx.view(B, S, -1)
        y = (self.experts(flat, idx, weights) + self.shared_experts(flat).float()).to(x.dtype)  # fp32 sum
        balance = self._balance_loss(scores, idx, B, ctx) if self.training and not self.gate.hashed else None
        if ctx.recording:  # kept for the model to collect (take_stats) once its forward is done; a recompute
            # in backward (activation checkpointing) keeps nothing, or its graph would outlive the step
            valid = None if ctx.token_mask is None else ctx.token_mask.reshape(-1)
            self.routing = (expert_counts(idx, scores.shape[-1], valid), balance)
        return y.view(B, S, d)

    def take_stats(self) -> MoEStats:
        """This layer's MoEStats from its last forward (and forget them)."""
        counts, balance = self.routing
        self.routing = None
        return MoEStats(self.name, counts, balance)

    @staticmethod
    def _balance_loss(scores: torch.Tensor, idx: torch.Tensor, B: int, ctx: SequenceContext) -> torch.Tensor:
        """Sequence-wise balance loss sum_i f_i * P_i averaged over sequences (DeepSeek-V3 form), over
        whole sequences (a context-parallel group sums its shards' counts and probabilities), over a
        sequence's real tokens (``ctx.token_mask``; all S without one)."""
        E, k = scores.shape[-1], idx.shape[-1]
        chosen = torch.zeros_like(scores).scatter_(1, idx, 1.0).view(B, -1, E)
        p = (scores / scores.sum(dim=-1, keepdim=True)).view(B, -1, E)
        if ctx.token_mask is None:
            sums = ctx.shard_sum(torch.stack((chosen.sum(dim=1), p.sum(dim=1)), dim=1))  # [B, 2, E]
            S = ctx.seq_len
        else:
            w = ctx.token_mask.view(B, -1, 1).float()
            n = w.sum(dim=1).expand(B, E)
            sums = ctx.shard_sum(torch.stack(((chosen * w).sum(dim=1), (p * w).sum(dim=1), n), dim=1))  # [B, 3, E]
            S = sums[:, 2].clamp(min=1)
        return (sums[:, 0] * (E / (k * S)) * (sums[:, 1] / S)).sum(dim=-1).mean()
