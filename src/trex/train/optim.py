"""Muon (as DeepSeek-V4 uses it) and AdamW in one optimizer, parameter grouping by rule, clipping.

Muon, for each logically independent matrix W (n x m) with gradient G (report Algorithm 1)::

    M = mu * M + G                                   # momentum, mu = 0.95
    O' = HybridNewtonSchulz(mu * M + G)              # Nesterov
    O = O' * sqrt(max(n, m)) * update_rms            # update_rms = 0.18: update RMS ~ AdamW's
    W = W * (1 - lr * wd) - lr * O                   # decoupled weight decay

Parameters are split into logical matrices by a per-parameter *row split* (``row_blocks``): a
list of row counts along dim -2, each block orthogonalised on its own; leading dims (stacked
experts [E, out, in]) are always a batch of independent matrices. The update is written as two
functions so that a sharded (FSDP/DTensor) version can reuse it: `momentum_direction` is
elementwise and runs on local shards; `orthogonalized_update` needs each logical matrix whole
(gather, update, re-shard). See docs/optimizers.md.

`build_optimizer` groups a DeepSeek-V4, V4.1 or V3-family model's parameters by the rules in
`classify`; parameters with ``requires_grad=False`` are left out. Parameters stored in a dtype other than fp32 get an
fp32 master copy in the optimizer state; the update is computed on the master and copied back.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass, field
import typing
from typing import Callable, Iterable, Literal, Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard
from torch.distributed.tensor.experimental import implicit_replication
from torch import nn

from trex import device as trex_device
from trex.logs import plural
from trex.parallel.parameter_view import full_tensor
from trex.recipe import check_choices

OptimizerName = Literal["muon", "adamw"]
OPTIMIZERS = typing.get_args(OptimizerName)
ALGORITHMS = (*OPTIMIZERS, "rowwise_adagrad")  # a group's; row-wise AdaGrad only for V4.1's Engram tables
NS_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass
class OptimSection:
    """The ``[optim]`` section of a recipe. Defaults follow DeepSeek-V4 (report §2.4)."""

    name: OptimizerName = "muon"
    """"muon" (Muon for matrices, AdamW for the rest, as V4) or "adamw" (AdamW for everything)."""
    lr: float = 2e-5
    """Peak learning rate, shared by the Muon and AdamW groups (Muon's update_rms makes them comparable).
    0 leaves every weight unchanged (a diagnostic: rung 4 of `trex fidelity ladder`)."""
    weight_decay: float = 0.1
    """Decoupled weight decay: W <- W * (1 - lr * weight_decay) before the update."""
    decay_gains_and_biases: bool = False
    """Also decay 1-D parameters and biases (norm weights, mHC base/scale, sinks, compressor ape)."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    """AdamW (beta1, beta2)."""
    eps: float = 1e-20
    """AdamW epsilon (V4 uses 1e-20)."""
    momentum: float = 0.95
    """Muon momentum mu."""
    nesterov: bool = True
    """Muon: orthogonalise mu * M + G (Nesterov) instead of M."""
    ns_coefficients: list[list[float]] = field(default_factory=lambda: [[3.4445, -4.7750, 2.0315], [2.0, -1.5, 0.5]])
    """Newton-Schulz (a, b, c) stages: X <- a X + b (X X^T) X + c (X X^T)^2 X."""
    ns_iterations: list[int] = field(default_factory=lambda: [8, 2])
    """Iterations of each stage in ns_coefficients (V4: 8 then 2)."""
    ns_dtype: Literal["auto", "fp32", "bf16"] = "auto"
    """Newton-Schulz matmul dtype: "fp32", "bf16", or "auto" (bf16 on accelerators with fast bf16, else fp32)."""
    update_rms: float = 0.18
    """Muon update scale gamma: O = NS(.) * sqrt(max(n, m)) * update_rms."""
    grad_clip: float = 1.0
    """Clip gradients to this global L2 norm; 0 disables clipping (the norm is still measured)."""
    engram_lr_scale: float = 1.0
    """With ``[train] engram = "train"`` (DeepSeek-V4.1): the Engram tables' learning rate is lr times this
    (their row-wise AdaGrad steps each looked-up element by about lr at first, as Adam does)."""

    def __post_init__(self) -> None:
        def need(ok: bool, fld: str, what: str) -> None:
            if not ok:
                raise ValueError(f"optim.{fld}: {what}, got {getattr(self, fld)!r}")

        check_choices(self, "optim")
        need(self.lr >= 0, "lr", "expected a learning rate >= 0")
        need(self.weight_decay >= 0, "weight_decay", "expected >= 0")
        need(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), "betas", "expected [beta1, beta2] in [0, 1)")
        need(self.eps >= 0, "eps", "expected >= 0")
        need(0 <= self.momentum < 1, "momentum", "expected a value in [0, 1)")
        need(len(self.ns_coefficients) == len(self.ns_iterations), "ns_iterations",
             f"expected one iteration count per ns_coefficients stage ({len(self.ns_coefficients)})")
        need(all(len(c) == 3 for c in self.ns_coefficients), "ns_coefficients", "expected [a, b, c] triples")
        need(all(isinstance(i, int) and i >= 0 for i in self.ns_iterations), "ns_iterations", "expected integers >= 0")
        need(self.update_rms > 0, "update_rms", "expected > 0")
        need(self.grad_clip >= 0, "grad_clip", "expected >= 0 (0 disables)")
        need(self.engram_lr_scale >= 0, "engram_lr_scale", "expected >= 0")

    def ns_schedule(self) -> list[tuple[float, float, float, int]]:
        """[(a, b, c, iterations)] per stage, the form `hybrid_newton_schulz` takes."""
        stages = zip(self.ns_coefficients, self.ns_iterations)
        return [(float(a), float(b), float(c), int(n)) for (a, b, c), n in stages]


# ==================================================================================================
# The Muon update (shared with the distributed version)
# ==================================================================================================
@torch.profiler.record_function("trex/muon_ns")  # `trex profile`'s optimizer/muon_ns class
def hybrid_newton_schulz(x: torch.Tensor, schedule: Sequence[tuple[float, float, float, int]],
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Approximate U V^T of each matrix in x: [..., n, m] -> fp32 [..., n, m].

    Each matrix is normalised by its Frobenius norm (in fp32), then iterated in ``dtype`` with
    X <- a X + b (X X^T) X + c (X X^T)^2 X. Tall matrices (n > m) are transposed first so the
    Gram matrix X X^T is the small side (min(n, m) square); the result is transposed back.
    """
    X = x.float()
    X = X / (torch.linalg.matrix_norm(X, keepdim=True) + 1e-7)
    tall = X.shape[-2] > X.shape[-1]
    batch = X.shape[:-2]
    # one contiguous [batch, small, large] stack: every product is one bmm, scales and sums in its epilogue
    X = (X.mT if tall else X).reshape(-1, *X.shape[-2:][::-1] if tall else X.shape[-2:]).to(dtype).contiguous()
    for a, b, c, iterations in schedule:
        for _ in range(iterations):
            A = torch.bmm(X, X.mT)
            B = torch.baddbmm(A, A, A, beta=b, alpha=c)  # b A + c A A
            X = torch.baddbmm(X, B, X, beta=a)  # a X + B X
    X = X.reshape(*batch, *X.shape[-2:])
    return (X.mT if tall else X).float()


def momentum_direction(grad: torch.Tensor, momentum: torch.Tensor, mu: float, nesterov: bool,
                       apply: torch.Tensor | None = None) -> torch.Tensor:
    """M <- mu * M + G in place; returns mu * M + G (Nesterov) or M. Elementwise: shard-local.
    ``apply`` (0-d bool, on the device): where False, M is left as it was (``grad`` must then be 0)."""
    g = grad.float()
    momentum.mul_(mu if apply is None else torch.where(apply, mu, 1.0)).add_(g)
    return momentum * mu + g if nesterov else momentum.clone()


def orthogonalized_update(direction: torch.Tensor, row_blocks: Sequence[int], update_rms: float,
                          schedule: Sequence[tuple[float, float, float, int]],
                          ns_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Muon update O for a whole parameter: direction [..., rows, cols] -> fp32, same shape.

    Leading dims are a batch of independent matrices. ``row_blocks`` splits dim -2 into logical
    matrices (empty: one block); each block b (r x cols) gets NS(b) * sqrt(max(r, cols)) * update_rms.
    """
    if direction.dim() < 2:
        raise ValueError(f"Muon needs a matrix, got a tensor of shape {tuple(direction.shape)}")
    rows = direction.shape[-2]
    blocks = list(row_blocks) or [rows]
    if sum(blocks) != rows:
        raise ValueError(f"row_blocks {blocks} sum to {sum(blocks)}, but the tensor of shape "
                         f"{tuple(direction.shape)} has {rows} rows")

    def scaled(x: torch.Tensor) -> torch.Tensor:
        return hybrid_newton_schulz(x, schedule, ns_dtype) * (math.sqrt(max(x.shape[-2], x.shape[-1])) * update_rms)

    if len(set(blocks)) == 1:  # equal blocks: one batched call
        return scaled(direction.unflatten(-2, (len(blocks), blocks[0]))).flatten(-3, -2)
    return torch.cat([scaled(b) for b in direction.split(blocks, dim=-2)], dim=-2)


def ns_flops(shape: Sequence[int], row_blocks: Sequence[int], iterations: int) -> int:
    """Matmul FLOPs of `orthogonalized_update` on a whole parameter of ``shape`` with ``iterations``
    Newton-Schulz iterations in all: each logical n x m matrix (n <= m after the transpose) costs
    4 n^2 m + 2 n^3 per iteration (X X^T, A A, then (b A + c A A) X)."""
    rows, cols = shape[-2], shape[-1]
    per_stack = 0
    for r in list(row_blocks) or [rows]:
        n, m = min(r, cols), max(r, cols)
        per_stack += 4 * n * n * m + 2 * n ** 3
    return math.prod(shape[:-2]) * per_stack * iterations


def muon_update(grad: torch.Tensor, momentum: torch.Tensor, row_blocks: Sequence[int], *, mu: float,
                nesterov: bool, update_rms: float, schedule: Sequence[tuple[float, float, float, int]],
                ns_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The full Muon update O for one parameter (full, unsharded tensors); updates ``momentum``."""
    direction = momentum_direction(grad, momentum, mu, nesterov)
    return orthogonalized_update(direction, row_blocks, update_rms, schedule, ns_dtype)


# ==================================================================================================
# Parameter grouping rules
# ==================================================================================================
@dataclass(frozen=True)
class Rule:
    """One grouping rule: the optimizer a parameter gets and why."""

    key: str
    muon: bool  # Muon under name="muon" (AdamW otherwise)
    decay: bool  # weight decay applies (gains and biases only with decay_gains_and_biases)
    what: str


RULES = {r.key: r for r in (
    Rule("matrix", True, True, "matrices (attention, shared experts, router, MTP projections, mHC head fn), whole; "
         "DeepSeek-V3's MLA wkv_a [latent | k_pe] and wkv_b [per head k_nope | v] too, as Moonlight trains them"),
    Rule("experts", True, True, "routed experts [E, out, in], each expert a separate matrix"),
    Rule("mhc_fn", True, True, "mHC fn [(2+n)n, nd], rows split into pre (n) / post (n) / comb (n*n)"),
    Rule("csa_halves", True, True, "CSA compressor wkv/wgate [2c, d], rows split [0:c] / [c:2c]"),
    Rule("wo_a_groups", True, True, "grouped wo_a [g*o_lora_rank, H*c/g], rows split into g groups"),
    Rule("embed_head", False, True, "embedding and output head"),
    Rule("gains_biases", False, False, "RMSNorm weights, mHC base/scale, attention sinks, compressor ape, Engram's "
         "gate gains"),
    Rule("engram_table", False, False, "V4.1's Engram tables [rows, d]: row-wise AdaGrad, only the rows a step "
         "looks up move"),
)}


def classify(model: nn.Module) -> list[tuple[str, nn.Parameter, Rule, list[int]]]:
    """(name, parameter, rule, row_blocks) for every trainable parameter, in model order.

    The model's modules say which of their parameters take a rule other than the default: a module with
    ``optimizer_rules()`` returns {parameter name relative to it (``wkv.weight``): (a key of RULES, row
    blocks)}. The interface each family's modules fill (V4's compressor, attention and mHC, V4.1's Engram,
    the shared routed experts), so no family's class is named here. The rest: the embedding and the output
    head ``embed_head``, 1-D parameters ``gains_biases``, matrices ``matrix``.
    A parameter shared by two modules (tied embedding and head) is listed once.
    """
    declared = _declared_rules(model)
    out, seen = [], set()
    for mod_name, module in model.named_modules():
        for leaf, p in module.named_parameters(recurse=False):
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            name = f"{mod_name}.{leaf}" if mod_name else leaf
            rule, blocks = declared.get(id(p)) or _default_rule(model, module, p, name)
            out.append((name, p, rule, blocks))
    return out


def _declared_rules(model: nn.Module) -> dict[int, tuple[Rule, list[int]]]:
    """The rules the model's modules declare (``optimizer_rules``), by parameter id."""
    found = {}
    for mod_name, module in model.named_modules():
        declare = getattr(module, "optimizer_rules", None)
        if declare is None:
            continue
        for rel, (key, blocks) in declare().items():
            if key not in RULES:
                raise ValueError(f"optimizer grouping: {type(module).__name__} ({mod_name or 'the model'}) names "
                                 f"rule {key!r} for {rel}; expected one of {sorted(RULES)}")
            found[id(module.get_parameter(rel))] = (RULES[key], list(blocks))
    return found


def _default_rule(model: nn.Module, module: nn.Module, p: nn.Parameter, name: str) -> tuple[Rule, list[int]]:
    if isinstance(module, nn.Embedding) or module is getattr(model, "head", None):
        return RULES["embed_head"], []
    if p.dim() == 1:
        return RULES["gains_biases"], []
    if p.dim() == 2:
        return RULES["matrix"], []
    raise ValueError(f"optimizer grouping: no rule for parameter {name} of shape {tuple(p.shape)} "
                     f"in {type(module).__name__}")


# ==================================================================================================
# The optimizer
# ==================================================================================================
class MuonAdamW(torch.optim.Optimizer):
    """One optimizer with Muon groups (``algorithm="muon"``), AdamW groups (``"adamw"``) and, for V4.1's
    Engram tables, row-wise AdaGrad (``"rowwise_adagrad"``).

    Every group has ``lr``, ``weight_decay`` and ``names`` (parameter names, for messages);
    Muon groups have ``momentum``, ``nesterov``, ``update_rms``, ``ns_schedule`` ([a, b, c,
    iterations] per stage), ``ns_dtype`` ("fp32"/"bf16") and ``row_blocks`` (one list per parameter);
    AdamW groups have ``betas`` and ``eps``, row-wise AdaGrad ``eps``. State per parameter:
    ``momentum_buffer`` (Muon), ``step``, ``exp_avg``, ``exp_avg_sq`` (AdamW) or ``sum_sq`` [rows]
    (row-wise AdaGrad), all fp32, and ``master`` (fp32) for parameters stored in a lower precision.
    """

    def __init__(self, param_groups: list[dict]):
        for group in param_groups:
            if group.get("algorithm") not in ALGORITHMS:
                raise ValueError(f"param group needs an algorithm of {ALGORITHMS}, got {group.get('algorithm')!r}")
            n = len(group["params"])
            group.setdefault("names", [f"param{i}" for i in range(n)])
            if group["algorithm"] == "muon":
                group.setdefault("row_blocks", [[] for _ in range(n)])
        super().__init__(param_groups, defaults={})
        self._owners: dict[torch.Tensor, int] | None = None  # see `owners`

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        self._owners = None  # assigned again over every group at the next step

    def load_state_dict(self, state_dict: dict) -> None:
        """As torch's, except that state tensors keep their saved dtype (fp32 master and moments):
        torch would cast them to the parameter dtype, losing the master weights of bf16 parameters.
        Every state tensor, AdamW's step count included, goes to the parameter's device."""
        super().load_state_dict(state_dict)
        params = [p for group in self.param_groups for p in group["params"]]
        for index, saved in state_dict["state"].items():
            p = params[index]
            for key, value in saved.items():
                if isinstance(value, torch.Tensor):
                    self.state[p][key] = value.to(device=p.device, copy=True)

    @torch.no_grad()
    def step(self, closure=None, *, apply: torch.Tensor | None = None):
        """One update of every parameter with a gradient. ``apply`` (0-d bool on the parameters'
        device) makes the step conditional without a host read: where it is False, parameters,
        masters, moments and step counts keep their values exactly (non-finite gradients included),
        so a skipped step costs no synchronisation.

        A Muon matrix sharded over its rows or columns (FSDP) is orthogonalised by one rank of its
        shard group, its owner (`owners`): every such direction is first gathered to its owner, then
        each rank orthogonalises what it owns, then every result is scattered back as shards, so the
        ranks run their Newton-Schulz iterations side by side, not one after another. The owner sees
        the same full matrix as one process would, so the update is bitwise the one process's."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with implicit_replication():  # the 0-d ``apply`` and step tensors meet DTensor state as replicated
            gathered = []
            for group in self.param_groups:
                for i, p in enumerate(group["params"]):
                    if p.grad is None:
                        continue
                    update = self._update_of(group, i, p, apply)
                    if isinstance(update, _Gathered):
                        gathered.append((group, p, update))
                    else:
                        self._apply(group, p, update, apply)
            for *_, g in gathered:  # this rank's own matrices only
                g.orthogonalize()
            for group, p, g in gathered:  # in the gathers' order on every rank
                self._apply(group, p, g.scatter(), apply)
        return loss

    def owners(self) -> dict[torch.Tensor, int]:
        """The owner of each Muon parameter whose matrices are split over a shard group: its index in
        that group (0 .. size - 1). Deterministic from the parameters' order, global shapes and
        placements (the same on every rank): largest Newton-Schulz cost first, each to the least loaded
        index of groups of its size (ties: the lowest index), so the owners' loads are balanced."""
        if self._owners is None:
            candidates = []
            for group in self.param_groups:
                if group["algorithm"] != "muon":
                    continue
                iterations = sum(int(stage[3]) for stage in group["ns_schedule"])
                for p, blocks in zip(group["params"], group["row_blocks"]):
                    split = _matrix_split(p) if isinstance(p, DTensor) else None
                    if isinstance(split, tuple):
                        size = p.device_mesh.size(split[0])
                        candidates.append((ns_flops(p.shape, blocks, iterations), len(candidates), size, p))
            loads: dict[int, list[int]] = {}
            self._owners = {}
            for cost, _, size, p in sorted(candidates, key=lambda c: (-c[0], c[1])):
                load = loads.setdefault(size, [0] * size)
                owner = load.index(min(load))
                load[owner] += cost
                self._owners[p] = owner
        return self._owners

    def _update_of(self, group: dict, i: int, p: torch.Tensor, apply: torch.Tensor | None):
        state = self.state[p]
        grad = p.grad if apply is None else torch.where(apply, p.grad, 0)
        if group["algorithm"] == "muon":
            return self._muon_update(group, i, p, grad, state, apply)
        if group["algorithm"] == "rowwise_adagrad":
            return self._rowwise_adagrad_update(group, grad, state, apply)
        return self._adamw_update(group, p, grad, state, apply)

    def _apply(self, group: dict, p: torch.Tensor, update: torch.Tensor, apply: torch.Tensor | None) -> None:
        master = self._master(p, self.state[p])
        decay = 1.0 - group["lr"] * group["weight_decay"]
        if apply is None:
            master.mul_(decay).add_(update, alpha=-group["lr"])
        else:
            master.mul_(torch.where(apply, decay, 1.0)).add_(torch.where(apply, update, 0), alpha=-group["lr"])
        if master is not p:
            p.copy_(master)

    @staticmethod
    def _master(p: torch.Tensor, state: dict) -> torch.Tensor:
        if p.dtype == torch.float32:
            return p
        if "master" not in state:
            state["master"] = p.detach().float().clone()
        return state["master"]

    def _muon_update(self, group: dict, i: int, p: torch.Tensor, grad: torch.Tensor, state: dict,
                     apply: torch.Tensor | None) -> torch.Tensor | _Gathered:
        """The momentum is updated shard-locally; the orthogonalization sees each logical matrix whole.
        A stack of experts sharded on dim 0 (over EP and FSDP, plain or strided) already holds whole
        matrices: each rank orthogonalises its own. A matrix split over one mesh dim's rows or columns
        (FSDP) is gathered to its owner (returned as `_Gathered`, see `step`). Any other layout is
        gathered on every rank and orthogonalised redundantly. The result is sharded like the parameter."""
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p, dtype=torch.float32)
        direction = momentum_direction(grad, state["momentum_buffer"], group["momentum"], group["nesterov"], apply)

        def orthogonalize(d: torch.Tensor) -> torch.Tensor:
            return orthogonalized_update(d, group["row_blocks"][i], group["update_rms"], group["ns_schedule"],
                                         NS_DTYPES[group["ns_dtype"]])

        if not isinstance(direction, DTensor):
            return orthogonalize(direction)
        split = _matrix_split(direction)
        if split == "local":
            return DTensor.from_local(orthogonalize(direction.to_local()), direction.device_mesh,
                                      direction.placements, shape=direction.shape, stride=direction.stride())
        if isinstance(split, tuple):
            return _Gathered(direction, *split, self.owners()[p], orthogonalize)
        full = orthogonalize(full_tensor(direction))
        return distribute_tensor(full, direction.device_mesh, direction.placements, src_data_rank=None)

    @staticmethod
    def _adamw_update(group: dict, p: torch.Tensor, grad: torch.Tensor, state: dict,
                      apply: torch.Tensor | None) -> torch.Tensor:
        """The step count lives on the parameter's device and the bias corrections are computed there
        (in fp64, as a host float would be): no host read."""
        if "step" not in state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
        beta1, beta2 = group["betas"]
        g = grad.float()
        if apply is None:
            state["step"] += 1
            state["exp_avg"].lerp_(g, 1 - beta1)
            state["exp_avg_sq"].mul_(beta2).addcmul_(g, g, value=1 - beta2)
        else:
            state["step"] += apply.float()
            state["exp_avg"].lerp_(g, torch.where(apply, 1 - beta1, 0.0))
            state["exp_avg_sq"].mul_(torch.where(apply, beta2, 1.0)).addcmul_(g, g, value=1 - beta2)
        t = state["step"].double().clamp(min=1)  # >= 1: a first step that is skipped divides by no zero
        denom = (state["exp_avg_sq"] / (1 - beta2**t)).sqrt_().add_(group["eps"])
        return state["exp_avg"] / (1 - beta1**t) / denom

    @staticmethod
    def _rowwise_adagrad_update(group: dict, grad: torch.Tensor, state: dict, apply: torch.Tensor | None
                                ) -> torch.Tensor:
        """Row-wise AdaGrad (as embedding tables are trained in recommendation models): one fp32 ``sum_sq``
        per row accumulates the row's mean squared gradient; the update is g / (sqrt(sum_sq) + eps). A row
        no token looked up has a zero gradient: its state and its weights stay as they were."""
        g = grad.float()
        if "sum_sq" not in state:
            state["sum_sq"] = torch.zeros_like(g[..., 0])
        mean_sq = g.square().mean(dim=-1)
        state["sum_sq"].add_(mean_sq if apply is None else torch.where(apply, mean_sq, 0))
        return g / (state["sum_sq"].sqrt() + group["eps"]).unsqueeze(-1)

    def describe_groups(self) -> str:
        """A table of the groups for the start of a run: rule, algorithm, counts, names (layers folded)."""
        lines = []
        total = matrices = 0
        for group in self.param_groups:
            numel = sum(p.numel() for p in group["params"])
            total += numel
            rule = RULES.get(group.get("rule", ""))
            summary = f"{plural(len(group['params']), 'tensor')}, {plural(numel, 'parameter')}"
            if group["algorithm"] == "muon":
                n = sum(_logical_count(p, rb) for p, rb in zip(group["params"], group["row_blocks"]))
                matrices += n
                summary += f", {plural(n, 'logical matrix', 'logical matrices')}"
            lines.append(f"  {group['algorithm']:5s} [{group.get('rule', '?')}] {rule.what if rule else ''}")
            lines.append(f"        lr {group['lr']:g}, weight decay {group['weight_decay']:g}; {summary}")
            folded = Counter(re.sub(r"(^|\.)(layers|mtp)\.\d+\.", r"\1\2.*.", n) for n in group["names"])
            lines += [f"        {name}" + (f"  x{count}" if count > 1 else "") for name, count in folded.items()]
        head = (f"optimizer: {plural(len(self.param_groups), 'group')}, {plural(total, 'parameter')}, "
                f"{plural(matrices, 'Muon logical matrix', 'Muon logical matrices')}")
        return "\n".join([head, *lines])


def _matrix_split(t: DTensor) -> str | tuple[int, int]:
    """How a Muon parameter's (or direction's) logical matrices lie over its mesh: "local" when every rank
    holds whole matrices (replicated, or a stack sharded on its leading dims only); (mesh dim, tensor
    dim) when exactly one mesh dim splits a matrix dim into plain chunks (FSDP's Shard); "full" otherwise."""
    stack_dims = t.dim() - 2
    splits = []
    for mesh_dim, placement in enumerate(t.placements):
        if placement.is_replicate():
            continue
        if isinstance(placement, (Shard, _StridedShard)) and placement.dim < stack_dims:
            continue  # whole matrices of a stack (experts over EP and FSDP)
        if type(placement) is not Shard:
            return "full"
        splits.append((mesh_dim, placement.dim))
    if not splits:
        return "local"
    return splits[0] if len(splits) == 1 else "full"


class _Gathered:
    """One sharded Muon direction on its way through its owner (see `MuonAdamW.step`): the constructor
    gathers the shards on the owner; `orthogonalize` runs the update there (a no-op elsewhere);
    `scatter` sends each rank its shard of the result. Shards follow torch.chunk along ``dim`` (DTensor's
    Shard), zero-padded to equal sizes for the collectives. Only the owner keeps tensors in between."""

    def __init__(self, direction: DTensor, mesh_dim: int, dim: int, owner: int,
                 update: Callable[[torch.Tensor], torch.Tensor]):
        mesh = direction.device_mesh
        self.dim, self.owner, self.update = dim, owner, update
        self.mesh, self.placements = mesh, direction.placements
        self.shape, self.stride = direction.shape, direction.stride()
        self.group, self.size = mesh.get_group(mesh_dim), mesh.size(mesh_dim)
        self.is_owner = mesh.get_local_rank(mesh_dim) == owner
        self.chunk = -(-direction.shape[dim] // self.size)
        self.local_shape, self.device = direction.to_local().shape, direction.to_local().device
        local = self._padded(direction.to_local(), self.chunk)
        self.parts = [torch.empty_like(local) for _ in range(self.size)] if self.is_owner else None
        dist.gather(local, self.parts, group=self.group, group_dst=owner)
        self.result: torch.Tensor | None = None

    def _padded(self, t: torch.Tensor, length: int) -> torch.Tensor:
        """``t`` with zeros appended along ``dim`` up to ``length``, contiguous."""
        short = length - t.shape[self.dim]
        if short == 0:
            return t.contiguous()
        return torch.cat([t, t.new_zeros(*t.shape[:self.dim], short, *t.shape[self.dim + 1:])], dim=self.dim)

    def orthogonalize(self) -> None:
        if self.is_owner:
            full = torch.cat(self.parts, dim=self.dim).narrow(self.dim, 0, self.shape[self.dim])
            self.parts = None
            self.result = self.update(full.contiguous())  # contiguous as one process's: a view takes another path

    def scatter(self) -> DTensor:
        received = torch.empty((*self.local_shape[:self.dim], self.chunk, *self.local_shape[self.dim + 1:]),
                               dtype=torch.float32, device=self.device)
        parts = None
        if self.is_owner:
            parts = list(self._padded(self.result, self.chunk * self.size).split(self.chunk, dim=self.dim))
            parts = [c.contiguous() for c in parts]
            self.result = None
        dist.scatter(received, parts, group=self.group, group_src=self.owner)
        return DTensor.from_local(received.narrow(self.dim, 0, self.local_shape[self.dim]), self.mesh,
                                  self.placements, shape=self.shape, stride=self.stride)


def _logical_count(p: torch.Tensor, row_blocks: Sequence[int]) -> int:
    return math.prod(p.shape[:-2]) * max(1, len(row_blocks))


def resolve_ns_dtype(name: str, dev: trex_device.Device) -> str:
    """"auto" -> "bf16" on accelerators with fast bf16, "fp32" elsewhere (always fp32 on CPU)."""
    if name != "auto":
        return name
    return "bf16" if dev.is_accelerator and dev.capabilities().bf16_fast else "fp32"


def build_optimizer(model: nn.Module, cfg: OptimSection, dev: trex_device.Device | None = None) -> MuonAdamW:
    """Group the model's trainable parameters by rule (see `classify`) into one `MuonAdamW`.

    ``dev`` resolves ``ns_dtype = "auto"``; by default it is the device of the parameters.
    """
    entries = classify(model)
    if not entries:
        raise ValueError("build_optimizer: the model has no trainable parameters")
    if dev is None:
        p0 = entries[0][1]
        dev = trex_device.Device(p0.device.type, p0.device.index or 0)
    by_rule: dict[str, list] = {}
    for entry in entries:
        by_rule.setdefault(entry[2].key, []).append(entry)
    groups = []
    for key, members in by_rule.items():
        rule = RULES[key]
        decay = rule.decay or cfg.decay_gains_and_biases
        group = {"rule": key, "params": [m[1] for m in members], "names": [m[0] for m in members],
                 "lr": cfg.lr, "weight_decay": cfg.weight_decay if decay else 0.0}
        if key == "engram_table":
            group.update(algorithm="rowwise_adagrad", eps=cfg.eps, lr=cfg.lr * cfg.engram_lr_scale)
        elif rule.muon and cfg.name == "muon":
            group.update(algorithm="muon", momentum=cfg.momentum, nesterov=cfg.nesterov, update_rms=cfg.update_rms,
                         ns_schedule=[list(stage) for stage in cfg.ns_schedule()],
                         ns_dtype=resolve_ns_dtype(cfg.ns_dtype, dev), row_blocks=[m[3] for m in members])
        else:
            group.update(algorithm="adamw", betas=tuple(cfg.betas), eps=cfg.eps)
        groups.append(group)
    return MuonAdamW(groups)


# ==================================================================================================
# Gradient clipping
# ==================================================================================================
def clip_grad_norm(params: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Scale gradients so their global L2 norm is at most ``max_norm`` (0: measure only).

    Returns the norm before clipping as a 0-d tensor (non-finite if any gradient is). Sharded
    (DTensor) gradients contribute their full norm, whatever mesh they live on (FSDP shards and
    expert-parallel shards mix), so every rank sees the same global norm.
    """
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    squares = []
    for g in grads:
        norm = torch.linalg.vector_norm(g.float())
        squares.append((norm.full_tensor() if isinstance(norm, DTensor) else norm) ** 2)
    total = torch.stack(squares).sum().sqrt()
    if max_norm > 0:  # on the device, no host read; a non-finite norm makes every gradient nan: the step skips
        coef = (max_norm / (total.double() + 1e-6)).clamp(max=1.0)  # fp64, as a host float would be
        if not any(isinstance(g, DTensor) for g in grads):
            torch._foreach_mul_(grads, coef)
        else:
            with implicit_replication():  # gradients on different meshes (FSDP, expert shards): one at a time
                for g in grads:
                    g.mul_(coef)
    return total
