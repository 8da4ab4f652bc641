"""Tensor parallelism: each block's attention heads, dense FFN and shared-expert widths, and the vocabulary of the
embedding and head split over the "tp" mesh dimension (Megatron's scheme), applied from outside to the unchanged
model from the plan its family declares as data (``TP_PLAN`` in the module its ``Architecture.tp_plan``
names: module-path patterns, ``*`` one path segment, -> styles).

Styles:

``colwise``         a linear's output rows split (Shard(0)): its replicated input enters the split region here
                    (identity forward; the input's gradient summed over the group in backward);
``colwise_within``  the same, its input already inside the region (entered by ``enter``: no second sum), as for
                    the linears that read one input (a SharedExpert's ``w1`` and ``w3``: one sum, not two);
``rowwise``         a linear's input columns split (Shard(1)): its output, a partial sum on each rank, is summed
                    over the group (forward; identity backward) and leaves the region;
``vocab``           an embedding's or the head's vocabulary rows split (Shard(0)): the embedding looks up the
                    ids in its rows, zeros the others' and sums over the group; the head (the model's
                    ``head_slice``) computes its rows' logits, and its loss the vocabulary-parallel
                    cross-entropy (trex.models.common.cross_entropy.head_nll);
``enter:METHOD``    the tensors the module's METHOD returns enter the region (replicated values every head
                    reads, such as MLA's latent, where no linear of their own takes them in; or an input several
                    split linears read, entered once: a SharedExpert's ``input``, a parameter-free identity,
                    with ``enter:forward``);
``heads:ATTR``      the module's integer ATTR (its head count, or its count of head groups) divided by tp: it
                    reshapes by this rank's heads; its ``head_split`` (trex.models.common.context.HeadSplit)
                    averages a statistic over all heads;
``heads_param:NAME`` the module's per-head parameter NAME split with the heads (Shard(0));
``head_split``      the module (an indexer aligned to the attention) is given the ``head_split`` only.

Sequence parallelism (``apply_tensor_parallel``'s ``sequence_parallel``; the same styles in every family's block,
trex.models.common.tp_plan): between the split regions each rank holds 1 / tp of the rows (dim 1 of [B, S, ...]);
the embedding's sum is reduce-scattered by rows; and

``rows_gather``     the module's output (a norm's, over this rank's rows) is all-gathered to the whole rows the
                    region after it reads (backward keeps this rank's rows: every reader of them is replicated or
                    enters the region itself, so their gradient is whole on every rank);
``rows_reduce``     the module's output (a region's: attention, FFN; the first of a tuple) is reduce-scattered to
                    this rank's rows: its row-parallel linears leave their outputs partial under it;
``rows_partial``    the module's output, the same on every rank (the routed experts'), becomes a partial (this
                    rank's rows kept, backward the identity) for the enclosing region's reduce-scatter; experts
                    whose expert-parallel group spans the tp ranks (their ``tp_slice`` this group's) return one
                    already (trex.parallel.expert_parallel);
``rows_whole``      the module (V4.1's Engram) runs on the whole rows: its first input gathered, its output
                    narrowed back to this rank's rows.

The parameters that compute on a rank's rows (every one outside ``rows_reduce`` / ``rows_whole`` regions that the
split leaves whole: norms, mHC, MTP's input projections, the final norm and mHC head) are seen through ``_Enter``,
which sums their gradients over the group. The root's pre-hook decides, per forward, whether its rows split: not
with a decode cache (generation keeps the whole rows) nor where tp does not divide the rows a rank computes; a
forward's ``hidden`` (V4.1's DSpark taps) comes back whole.

The parameters become DTensors on the tp mesh with their global shapes and names (checkpoints reshard across
layouts; FSDP2 shards them again over the data-parallel mesh, 2-D). While a block runs (and the root, for the
embedding and head), those parameters are seen as their local shards (``LocalView``), so the model's own
forward, and any direct read of a weight (MLA's absorbed forms), computes on this rank's slice with plain
tensors, and a compiled block traces no DTensor. The collectives are differentiable all-reduces; none reads the host.
Everything else (norms, routers, routed experts, MLA's down projections, V3.2's indexer) is replicated: each
rank of the group computes it on the same inputs, so their gradients are whole on every rank.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from trex.models.common.heads import Model
from trex.models.registry import ARCHITECTURES, architecture
from trex.parallel.parameter_view import ParameterView

STYLES = ("colwise", "colwise_within", "rowwise", "vocab", "enter", "heads", "heads_param", "head_split", "rows_gather",
          "rows_reduce", "rows_partial", "rows_whole")


def _all_reduce(x: torch.Tensor, op: str, group) -> torch.Tensor:
    """The group's sum (or max) of x, a new tensor (functional collectives: traceable by torch.compile)."""
    return funcol.wait_tensor(funcol.all_reduce(x.contiguous(), op, group))


def _all_gather(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Every rank's x along ``dim``, in rank order (traceable, as ``_all_reduce``)."""
    return funcol.wait_tensor(funcol.all_gather_single(x.movedim(dim, 0).contiguous(), 0, group)).movedim(0, dim)


def _reduce_scatter(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """This rank's slice along ``dim`` of the group's sum of x (traceable, as ``_all_reduce``)."""
    part = funcol.reduce_scatter_single(x.movedim(dim, 0).contiguous(), "sum", 0, group)
    return funcol.wait_tensor(part).movedim(0, dim)


class _Enter(torch.autograd.Function):
    """Identity forward; backward sums the gradient over the group (each rank's heads add their part)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_reduce(grad, "sum", ctx.group), None


class _Leave(torch.autograd.Function):
    """Forward sums each rank's partial output over the group; identity backward (the sum is replicated)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        return _all_reduce(x, "sum", group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _Gather(torch.autograd.Function):
    """Forward gathers each rank's slice of x along ``dim`` (equal slices, in rank order); backward keeps this rank's
    slice of the gradient (the whole result is the same on every rank, and so is any loss of it: the group's sum of
    its gradients, the all-gather's autograd, would be tp times this rank's)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, slice_: TensorParallelSlice, dim: int) -> torch.Tensor:
        ctx.rank, ctx.dim, ctx.rows = slice_.rank, dim, x.shape[dim]
        return _all_gather(x, dim, slice_.group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.narrow(ctx.dim, ctx.rank * ctx.rows, ctx.rows), None, None


class _Scatter(torch.autograd.Function):
    """Forward keeps this rank's slice of x along ``dim`` (x the same on every rank; its size a multiple of the
    group's); backward gathers every rank's slice of the gradient, so x's gradient is whole on every rank."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, slice_: TensorParallelSlice, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = slice_.group, dim
        rows = x.shape[dim] // slice_.size
        return x.narrow(dim, slice_.rank * rows, rows)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_gather(grad, ctx.dim, ctx.group), None, None


class _ReduceScatter(_Scatter):
    """Forward sums each rank's partial x over the group and keeps this rank's slice along ``dim`` (a size the group
    divides); backward, ``_Scatter``'s, gathers every rank's slice of the gradient (the sum's gradient is the same
    for every partial)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, slice_: TensorParallelSlice, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = slice_.group, dim
        return _reduce_scatter(x, dim, slice_.group)


class _Partial(torch.autograd.Function):
    """x, the same on every rank -> a partial: this rank's slice along dim 0 kept, zeros elsewhere, so the group's
    sum is x exactly; backward the identity (the gradient of a partial is the sum's, whole on every rank, and so
    is x's, as a replicated tensor's is)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, slice_: TensorParallelSlice) -> torch.Tensor:
        rows = x.shape[0] // slice_.size
        mine = torch.zeros(x.shape[0], dtype=torch.bool, device=x.device)
        mine[slice_.rank * rows:(slice_.rank + 1) * rows] = True
        return torch.where(mine.view(-1, *[1] * (x.dim() - 1)), x, torch.zeros((), dtype=x.dtype, device=x.device))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class TensorParallelSlice:
    """This rank's place in the tp group, and the head's vocabulary rows (``HeadSlice``). ``sequence_parallel``: the
    residual stream between the split regions is split by rows over the group in the forwards that allow it
    (``split``, set by the model's root pre-hook for each forward: module docstring)."""

    def __init__(self, mesh: DeviceMesh, vocab: int = 0, sequence_parallel: bool = False):
        self.group = mesh.get_group()
        self.rank, self.size = mesh.get_local_rank(), mesh.size()
        self.start = vocab // self.size * self.rank
        self.sequence_parallel = sequence_parallel
        self.split = False  # this forward's rows split over the group (sequence parallelism)

    def all_reduce_max(self, t: torch.Tensor) -> torch.Tensor:
        return _all_reduce(t, "max", self.group)

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        return _all_reduce(t, "sum", self.group)

    def local(self, weight: torch.Tensor) -> torch.Tensor:
        return weight.to_local() if isinstance(weight, DTensor) else weight

    def gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Each rank's slice of x along ``dim`` (the head's logits [..., V / tp]: the vocabulary's columns) -> the
        whole, the same on every rank, differentiable (``_Gather``: the backward keeps this rank's slice)."""
        return _Gather.apply(x, self, dim)

    def scatter(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """x, the same on every rank -> this rank's 1/tp of it along ``dim`` (a size the group divides),
        differentiable (``_Scatter``: the backward gathers the group's slices of the gradient)."""
        return _Scatter.apply(x, self, dim)

    def mean(self, x: torch.Tensor) -> torch.Tensor:
        """``HeadSplit.mean``: the group's mean of each rank's per-head mean (equal head counts)."""
        return self.all_reduce_sum(x) / self.size

    def enter(self, x):
        return _Enter.apply(x, self.group) if isinstance(x, torch.Tensor) and x.requires_grad else x

    def leave(self, x: torch.Tensor) -> torch.Tensor:
        return _Leave.apply(x, self.group)

    # ---- sequence parallelism: [B, rows, ...] tensors, rows on dim 1; each the identity when not ``split`` ----
    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's rows -> the whole rows (all-gather; backward keeps this rank's rows: what reads the whole rows
        is replicated or enters the region itself, so its gradient is whole on every rank)."""
        return _Gather.apply(x, self, 1) if self.split else x

    def own_rows(self, x: torch.Tensor) -> torch.Tensor:
        """The whole rows, the same on every rank -> this rank's (backward: all-gather)."""
        return _Scatter.apply(x, self, 1) if self.split else x

    def leave_rows(self, x: torch.Tensor) -> torch.Tensor:
        """A partial sum over the group's rows -> this rank's rows of the sum (reduce-scatter; backward all-gather);
        not split: the whole sum (``leave``)."""
        return _ReduceScatter.apply(x, self, 1) if self.split else self.leave(x)

    def sum_rows(self, x: torch.Tensor) -> torch.Tensor:
        """A split region's output, a partial sum over the group -> this rank's rows of the sum (reduce-scatter;
        backward all-gather)."""
        return _ReduceScatter.apply(x, self, 1) if self.split else x

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, ...], the same on every rank -> a partial of it (``_Partial``) that a split region's outputs
        sum into."""
        return _Partial.apply(x, self) if self.split else x


_VIEW = "_trex_local_view"


class LocalView(ParameterView):
    """While ``unit``'s forward runs (each block, and the root for what lies outside blocks), the split (DTensor)
    parameters under it (minus those under ``skip``) are seen as their local shards: differentiable views
    (``to_local``) whose gradients reach the DTensor parameters. Under sequence parallelism, in a forward whose rows
    are split, the unit's other parameters outside ``whole_rows`` (the regions that read the whole rows) compute on
    this rank's rows: they are seen through ``_Enter``, which sums their gradients over the group. The hooks run
    outside a block's compiled forward (torch.compile sees plain tensors) and after FSDP2's gather (which its
    pre-forward hook runs first). Entering again while entered does nothing; activation checkpointing's recompute,
    which calls the block's forward without its hooks, enters it (``local_view_of``), with the rows split as they
    were in the unit's last forward."""

    def __init__(self, unit: nn.Module, slice_: TensorParallelSlice, skip: tuple[nn.Module, ...] = (),
                 whole_rows: tuple[nn.Module, ...] = ()):
        whole = {id(m) for region in whole_rows for m in region.modules()}
        on_rows = {id(p) for m in unit.modules() if id(m) not in whole for p in m.parameters(recurse=False)}
        self.slice_, self.recorded, self.before, self.replaying = slice_, False, False, False
        super().__init__(unit, lambda p: isinstance(p, DTensor) or (slice_.sequence_parallel and id(p) in on_rows),
                         self._local, skip)
        unit.__dict__[_VIEW] = self

    def _local(self, p: torch.Tensor) -> torch.Tensor:
        if isinstance(p, DTensor):
            return p.to_local()
        return self.slice_.enter(p) if self.slice_.split else p

    def _enter(self) -> None:
        if self.depth == 0 and not self.replaying:
            self.recorded = self.slice_.split
        super()._enter()

    def __enter__(self) -> LocalView:
        self.before, self.slice_.split, self.replaying = self.slice_.split, self.recorded, True
        try:
            return super().__enter__()
        finally:
            self.replaying = False

    def __exit__(self, *_) -> None:
        super().__exit__()
        self.slice_.split = self.before


def local_view_of(unit: nn.Module) -> contextlib.AbstractContextManager:
    """The unit's ``LocalView`` for an eager recompute; a no-op context without tensor parallelism, and inside a
    compiled block (its graph took the local shards as inputs from the hooks, and recomputes from them)."""
    view = unit.__dict__.get(_VIEW)
    return view if view is not None and not torch.compiler.is_compiling() else contextlib.nullcontext()


def tp_plan(model: Model) -> dict[str, tuple[str, ...]]:
    """The plan of ``model``'s family; a family without one is a ValueError naming it."""
    plan = architecture(model.cfg).load("tp_plan")
    if plan is None:
        planned = sorted(name for name, a in ARCHITECTURES.items() if a.tp_plan)
        raise ValueError(f"parallel.tp: {model.cfg.architecture} has no tensor-parallel plan yet (families with one: "
                         f"{', '.join(planned)})")
    return plan.TP_PLAN


def _matches(pattern: str, path: str) -> bool:
    want, have = pattern.split("."), path.split(".")
    return len(want) == len(have) and all(w in ("*", h) for w, h in zip(want, have))


def planned_modules(model: Model, plan: dict[str, tuple[str, ...]]) -> dict[str, tuple[nn.Module, list[str]]]:
    """Module path -> (module, its styles) for every module of ``model`` a pattern of ``plan`` matches."""
    found = {}
    for path, module in model.named_modules():
        styles = [s for pattern, ss in plan.items() if _matches(pattern, path) for s in ss]
        for style in styles:
            if style.partition(":")[0] not in STYLES:
                raise ValueError(f"tensor-parallel plan of {model.cfg.architecture}: {path}: unknown style "
                                 f"{style!r} (known: {', '.join(STYLES)})")
        if styles:
            found[path] = (module, styles)
    return found


def check_divisible(model: Model, tp: int) -> None:
    """ValueError unless ``tp`` divides everything the plan splits; one line naming each number that does not."""
    bad = {}
    for path, (module, styles) in planned_modules(model, tp_plan(model)).items():
        for style in styles:
            kind, _, attr = style.partition(":")
            if kind == "heads":
                n, name = getattr(module, attr), attr.replace("n_", "")
            elif kind == "heads_param":
                n, name = getattr(module, attr).shape[0], f"{attr} rows"
            elif kind in ("colwise", "colwise_within", "vocab"):
                n, name = module.weight.shape[0], "vocabulary" if kind == "vocab" else "rows"
            elif kind == "rowwise":
                n, name = module.weight.shape[1], "columns"
            else:
                continue
            what = f"{name} {n}"
            if n % tp:
                bad.setdefault(what, path)
    if bad:
        parts = ", ".join(f"{path}'s {what}" for what, path in bad.items())
        raise ValueError(f"parallel.tp = {tp} does not divide {parts}")


def _split(module: nn.Module, dim: int, mesh: DeviceMesh, name: str = "weight") -> None:
    full = getattr(module, name)
    setattr(module, name, nn.Parameter(distribute_tensor(full.detach(), mesh, [Shard(dim)], src_data_rank=None),
                                       requires_grad=full.requires_grad))


def apply_tensor_parallel(model: Model, tp_mesh: DeviceMesh, sequence_parallel: bool = False) -> None:
    """Split ``model`` over ``tp_mesh`` by its family's plan (module docstring); a no-op for a group of one. The
    model's parameters must be the same on every rank of the group (each keeps its slice, no communication).
    ``sequence_parallel``: the rows between the split regions split over the group too (module docstring)."""
    tp = tp_mesh.size()
    if tp == 1:
        return
    check_divisible(model, tp)
    modules = planned_modules(model, tp_plan(model))
    slice_ = TensorParallelSlice(tp_mesh, model.cfg.vocab_size, sequence_parallel)
    whole_rows = []  # the regions that read the whole rows under sequence parallelism
    for path, (module, styles) in modules.items():
        for style in styles:
            kind, _, arg = style.partition(":")
            if kind in ("colwise", "colwise_within", "rowwise", "vocab"):
                _split(module, 1 if kind == "rowwise" else 0, tp_mesh)
            if kind == "colwise":
                module.register_forward_pre_hook(lambda m, args: (slice_.enter(args[0]), *args[1:]))
            elif kind == "rowwise":  # split rows: a partial, summed where its region leaves (rows_reduce)
                module.register_forward_hook(lambda m, args, out: out if slice_.split else slice_.leave(out))
            elif kind == "vocab" and isinstance(module, nn.Embedding):
                _vocab_embedding(module, slice_)
            elif kind == "vocab":
                if module is not getattr(model, "head", None):
                    raise ValueError(f"tensor-parallel plan: {path}: vocab splits an embedding or the model's head")
                model.head_slice = slice_
                continue
            elif kind == "enter":
                _enter_outputs(module, arg, slice_)
            elif kind == "heads":
                setattr(module, arg, getattr(module, arg) // tp)
                module.head_split = slice_
            elif kind == "heads_param":
                _split(module, 0, tp_mesh, arg)
            elif kind == "head_split":
                module.head_split = slice_
            elif not sequence_parallel:
                continue
            elif kind == "rows_gather":
                module.register_forward_hook(lambda m, args, out: slice_.rows(out))
            elif kind == "rows_reduce":
                module.register_forward_hook(lambda m, args, out: _first(out, slice_.sum_rows))
                whole_rows.append(module)
            elif kind == "rows_partial":  # experts dispatching over this group's ranks return a partial already
                module.register_forward_hook(
                    lambda m, args, out: out if getattr(m, "tp_slice", None) is slice_ else slice_.partial(out))
            elif kind == "rows_whole":
                module.register_forward_pre_hook(lambda m, args: (slice_.rows(args[0]), *args[1:]))
                module.register_forward_hook(lambda m, args, out: slice_.own_rows(out))
                whole_rows.append(module)
    model.__dict__[_SLICE] = slice_
    if sequence_parallel:
        model.register_forward_pre_hook(functools.partial(_split_rows, slice_=slice_), with_kwargs=True)
        model.register_forward_hook(functools.partial(_whole_hidden, slice_=slice_))
    blocks = (*model.layers, *getattr(model, "mtp", ()))
    for unit in (model, *blocks):
        LocalView(unit, slice_, skip=blocks if unit is model else (), whole_rows=tuple(whole_rows))


_SLICE = "_trex_tp_slice"


def slice_of(model: Model, tp_mesh: DeviceMesh) -> TensorParallelSlice:
    """The slice ``apply_tensor_parallel`` split ``model`` with over ``tp_mesh`` (whose ``split`` says, per forward,
    whether the rows are split), or a new one for a model it did not split."""
    return model.__dict__.get(_SLICE) or TensorParallelSlice(tp_mesh)


def _split_rows(model: Model, args: tuple, kwargs: dict, slice_: TensorParallelSlice) -> None:
    """The root's pre-hook under sequence parallelism: this forward's rows are split over the group unless it
    generates (a decode cache: its prefill keeps the whole rows, a step has one) or the group does not divide the
    rows this rank computes (the sequence over its context-parallel ranks)."""
    ids = args[0] if args else kwargs["input_ids"]
    cache = args[3] if len(args) > 3 else kwargs.get("cache")
    shards = model.sequence_shard.size if model.sequence_shard is not None else 1
    slice_.split = cache is None and ids.shape[1] % (shards * slice_.size) == 0


def _whole_hidden(model: Model, args: tuple, out, slice_: TensorParallelSlice) -> None:
    """The root's forward hook under sequence parallelism: the hidden states a forward returns (V4.1's DSpark taps)
    for the whole rows, as without it."""
    if slice_.split and getattr(out, "hidden", None) is not None:
        out.hidden = slice_.rows(out.hidden)


def _first(out, fn):
    """``fn`` applied to ``out``, or to the first of a tuple (V4.1's attention returns its output and ``Shared``)."""
    return (fn(out[0]), *out[1:]) if isinstance(out, tuple) else fn(out)


def _vocab_embedding(module: nn.Embedding, slice_: TensorParallelSlice) -> None:
    """Ids outside this rank's rows look up row 0 and are zeroed; the group's sum is every id's row (its rows of
    the sequence under sequence parallelism: a reduce-scatter)."""
    rows = module.weight.shape[0] // slice_.size
    lo = rows * slice_.rank

    def before(m, args):
        ids = args[0]
        m._tp_outside = (ids < lo) | (ids >= lo + rows)
        return ((ids - lo).masked_fill(m._tp_outside, 0), *args[1:])

    def after(m, args, out):
        outside = m.__dict__.pop("_tp_outside")
        return slice_.leave_rows(out.masked_fill(outside[..., None], 0.0))

    module.register_forward_pre_hook(before)
    module.register_forward_hook(after)


def _enter_outputs(module: nn.Module, method: str, slice_: TensorParallelSlice) -> None:
    """Wrap the instance's ``method`` so the tensors it returns enter the split region."""
    original = getattr(module, method)

    def entered(*args, **kwargs):
        out = original(*args, **kwargs)
        return type(out)(slice_.enter(t) for t in out) if isinstance(out, tuple) else slice_.enter(out)

    setattr(module, method, entered)
