"""A profiled step's ops by class: where the time goes, what each class computes and moves.

Input: the ``torch.profiler`` events of one or more training steps (``FunctionEvent``s, recorded with
``record_shapes=True`` while trex.profile.scopes labels the model). Each event is classed by

- its own name: collectives (``communication``), host reads (``host_sync``);
- the ranges above it: ``Optimizer.step#...`` (``optimizer/muon_ns`` inside Muon's Newton-Schulz,
  ``optimizer/update`` for the rest), a ``trex/<scope>`` range (the model part: attention by kind,
  the MoE's router, experts and dispatch, norms and mHC) or one of the autograd Functions that are
  a part on their own (the fused LM head + loss, the Sinkhorn of mHC);
- for backward ops, the forward op that made their autograd node (autograd's sequence number links
  ``evaluate_function: XBackward`` to the forward op), so a backward is classed as its forward;
- inside a part, GEMMs apart from the rest: a GEMM under ``linear`` or outside any part is a
  ``dense_gemm``, one under ``moe/experts`` an ``moe/expert_gemm`` (the rest there: ``moe/dispatch``).

Time: on the host (CPU runs) each event's self time, the profiler step's own self time being the
Python between ops (``host/python``); on an accelerator each event's self device time (its kernels),
and the rest of the step ``device/idle``. Either way the classes add up to the step's span.

FLOPs come from ``torch.utils.flop_counter``'s formulas on the recorded shapes (GEMMs, attention
kernels; trex's grouped expert GEMM: 2 x rows x one expert's matrix); bytes are the op's inputs
(shapes x dtypes) plus an output as large as its largest input, for the ops that move data (views
and allocations move none). Both are "where known": a class without a formula reports none.
"""

from __future__ import annotations

import inspect
from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch.utils.flop_counter import flop_registry

from trex.profile.scopes import PREFIX

# The classes in the order the table lists them, with what each holds.
CLASSES: dict[str, str] = {
    "dense_gemm": "GEMMs of dense projections (attention in/out, dense and shared FFN, MTP)",
    "moe/expert_gemm": "grouped GEMMs of the routed experts",
    "attention/sliding": "sliding-window attention (V4, V4.1)",
    "attention/csa": "compressed sparse attention with its compressor and indexer (V4; V4.1's CSA2)",
    "attention/hca": "heavily compressed attention with its compressor (V4)",
    "attention/mla": "multi-head latent attention (V3)",
    "attention/dsa": "DeepSeek sparse attention: indexer + sparse MLA (V3.2)",
    "attention/dspark": "the DSpark drafter's attention (V4.1)",
    "moe/route": "router: scores, bias, group limit, top-k",
    "moe/dispatch": "sort by expert, gather, scatter, combine",
    "norm_mhc": "RMSNorm / LayerNorm and mHC hyper-connections",
    "head_loss": "LM head and the fused cross-entropy",
    "optimizer/muon_ns": "Muon's Newton-Schulz orthogonalisation",
    "optimizer/update": "optimizer updates: momentum, AdamW, masters, weight decay",
    "communication": "collectives (FSDP, EP all-to-all, CP, gradient reduction)",
    "host_sync": "device-to-host reads and synchronisations",
    "compiled_fused": "fused kernels of compiled regions",
    "other": "everything else (embedding, activations, loop, data)",
    "host/python": "host time between ops (Python, the loop)",
    "device/idle": "device time with no kernel running (waiting for the host)",
}
NAMED_PARTS = {"_HeadNLL": "head_loss", "_TokenNLL": "head_loss", "_LinearFP32": "head_loss",
               "_Sinkhorn": "norm_mhc"}  # autograd Functions that are a part of their own
GEMMS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::linear", "aten::einsum",
         "aten::addmv", "aten::mv", "aten::_grouped_mm", "aten::_scaled_mm", "aten::_scaled_grouped_mm"}
COMM_MARKS = ("c10d::", "record_param_comms", "all_reduce", "allreduce", "all_gather", "allgather", "reduce_scatter",
              "reducescatter", "all_to_all", "alltoall", "broadcast", "processgroup")
SYNC_OPS = {"aten::item", "aten::_local_scalar_dense", "aten::nonzero"}
MOVES_NOTHING = {"aten::view", "aten::as_strided", "aten::expand", "aten::t", "aten::transpose", "aten::reshape",
                 "aten::_unsafe_view", "aten::alias", "aten::slice", "aten::select", "aten::unsqueeze",
                 "aten::squeeze", "aten::permute", "aten::detach", "aten::detach_", "aten::empty",
                 "aten::empty_strided", "aten::empty_like", "aten::resolve_conj", "aten::resolve_neg",
                 "aten::lift_fresh", "aten::unflatten", "aten::flatten", "aten::split", "aten::chunk",
                 "aten::narrow", "aten::unbind", "aten::split_with_sizes", "aten::view_as", "aten::expand_as",
                 "aten::_reshape_alias", "aten::numpy_T", "aten::mT", "aten::movedim", "aten::diagonal",
                 "aten::set_", "aten::result_type", "aten::is_nonzero", "aten::zeros_like", "aten::new_empty",
                 "aten::new_empty_strided", "aten::record_stream"}
ITEMSIZE = {"float": 4, "c10::Half": 2, "c10::BFloat16": 2, "double": 8, "long int": 8, "int": 4, "bool": 1,
            "signed char": 1, "unsigned char": 1, "short int": 2, "c10::Float8_e4m3fn": 1, "c10::Float8_e5m2": 1,
            "c10::Float8_e8m0fnu": 1, "c10::complex<float>": 8}
DTYPE_NAMES = {"c10::BFloat16": "bf16", "c10::Half": "fp16", "float": "fp32", "c10::Float8_e4m3fn": "fp8",
               "c10::Float8_e5m2": "fp8"}


@dataclass
class Unit:
    """One op that does work on its own (a GEMM, an attention kernel, an elementwise op), for the
    device estimate: what it computes and moves, in which class and phase, in recorded order."""

    name: str
    cls: str
    phase: str  # forward, backward, optimizer
    flops: float  # 0: none known
    bytes: float
    dtype: str  # bf16, fp16, fp32, fp8: the precision its FLOPs run in
    launches: int = 1


@dataclass
class ClassTotal:
    time_s: float = 0.0
    launches: int = 0
    flops: float = 0.0
    bytes: float = 0.0


@dataclass
class StepProfile:
    """The classes of the profiled steps, per step (totals divided by ``steps``)."""

    steps: int
    step_s: float  # mean span of a profiled step
    classes: dict[str, ClassTotal] = field(default_factory=dict)
    units: list[Unit] = field(default_factory=list)  # every step's units, in order
    on_device: bool = False

    def total_s(self) -> float:
        return sum(c.time_s for c in self.classes.values())


def classify(events, on_device: bool) -> StepProfile:
    """Class the events of the profiled steps (``prof.events()`` of a schedule with active steps)."""
    spans = sorted((e for e in events if e.name.startswith("ProfilerStep")), key=lambda e: e.time_range.start)
    if not spans:
        raise ValueError("the profile holds no profiled step (no ProfilerStep event)")
    first, last = spans[0].time_range.start, spans[-1].time_range.end
    inside = [e for e in events if first <= e.time_range.start < last and not e.is_async]
    totals: dict[str, ClassTotal] = defaultdict(ClassTotal)
    units: list[Unit] = []
    forward_part: dict[tuple[int, int], str | None] = {}  # (thread, sequence_nr) -> the forward op's part
    # (event, part, phase, optimizer part, inside a GEMM, inside a compiled region, flops counted above)
    ids = {id(e) for e in inside}
    roots = [e for e in inside if e.cpu_parent is None or id(e.cpu_parent) not in ids]
    stack = [(e, None, "forward", "", False, False, False)
             for e in sorted(roots, key=lambda e: e.time_range.start, reverse=True)]
    while stack:
        e, part, phase, opt, in_gemm, compiled, counted = stack.pop()
        name = e.name
        if name.startswith("ProfilerStep"):
            cls = "host/python"
        else:
            part, phase, opt, compiled = _context(e, part, phase, opt, compiled, forward_part)
            in_gemm = in_gemm or name in GEMMS or name.endswith("grouped_mm")
            cls = class_of(name, part, phase, opt, in_gemm, compiled)
            if phase == "forward" and e.sequence_nr >= 0:
                forward_part[(e.thread, e.sequence_nr)] = part
        total = totals[cls]
        total.time_s += (e.self_device_time_total if on_device else e.self_cpu_time_total) * 1e-6
        if on_device:
            total.launches += len(e.kernels)
        flops = 0.0 if counted else op_flops(e)
        if flops or (not e.cpu_children and name.startswith("aten::") and name not in MOVES_NOTHING
                     and not counted):
            nbytes = op_bytes(e)
            total.flops += flops
            total.bytes += nbytes
            if not on_device:
                total.launches += 1
            units.append(Unit(name, cls, phase, flops, nbytes, op_dtype(e)))
        children = sorted(e.cpu_children, key=lambda c: c.time_range.start, reverse=True)
        stack.extend((c, part, phase, opt, in_gemm, compiled, counted or bool(flops)) for c in children)
    steps = len(spans)
    step_s = sum(s.time_range.elapsed_us() for s in spans) * 1e-6 / steps
    if on_device:  # the step's span less the kernels' time: the device waited
        busy = sum(t.time_s for t in totals.values())
        totals["device/idle"].time_s += max(0.0, step_s * steps - busy)
    classes = {k: ClassTotal(t.time_s / steps, round(t.launches / steps), t.flops / steps, t.bytes / steps)
               for k, t in totals.items() if t.time_s > 0 or t.flops > 0}
    return StepProfile(steps, step_s, classes, units, on_device)


def _context(e, part, phase, opt, compiled, forward_part):
    """The part, phase, optimizer part and compiled flag below event ``e``."""
    name = e.name
    if name.startswith(PREFIX):
        scope = name[len(PREFIX):]
        if scope == "muon_ns":
            return part, "optimizer", "muon_ns", compiled
        return scope, phase, opt, compiled
    if name.startswith("Optimizer.step#") or name.startswith("Optimizer.zero_grad#"):
        return part, "optimizer", opt or "update", compiled
    if name.startswith("autograd::engine::evaluate_function"):
        found = forward_part.get((e.fwd_thread, e.sequence_nr), part)
        return found, "backward", opt, compiled or "CompiledFunction" in name
    if name in NAMED_PARTS:
        return NAMED_PARTS[name], phase, opt, compiled
    if name.startswith("CompiledFunction") or name.startswith("Torch-Compiled Region"):
        return part, phase, opt, True
    return part, phase, opt, compiled


def class_of(name: str, part: str | None, phase: str, opt: str, in_gemm: bool, compiled: bool) -> str:
    """The class of an op named ``name`` under model part ``part`` (trex.profile.scopes)."""
    low = name.lower()
    if any(mark in low for mark in COMM_MARKS):
        return "communication"
    if name in SYNC_OPS or "synchronize" in low:
        return "host_sync"
    if phase == "optimizer":
        return "optimizer/muon_ns" if opt == "muon_ns" else "optimizer/update"
    if part is not None and (part.startswith("attention/") or part in ("moe/route", "moe/dispatch", "norm_mhc",
                                                                        "head_loss")):
        return part
    if part == "moe/experts":
        return "moe/expert_gemm" if in_gemm else "moe/dispatch"
    if part == "linear" or in_gemm:
        return "dense_gemm"
    return "compiled_fused" if compiled else "other"


def _formula(name: str):
    if not name.startswith("aten::"):
        return None
    packet = getattr(torch.ops.aten, name[len("aten::"):], None)
    f = flop_registry.get(packet)
    if f is None:
        return None
    params = inspect.signature(f).parameters.values()
    takes_all = any(p.kind is p.VAR_POSITIONAL for p in params)
    positional = sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.name != "out_shape" for p in params)
    return f, (None if takes_all else positional)


_FORMULAS: dict[str, object] = {}


def op_flops(e) -> float:
    """FLOPs of one op from its recorded input shapes; 0 when no formula is known."""
    name, shapes = e.name, e.input_shapes
    if name.endswith("grouped_mm") and len(shapes) >= 2 and len(shapes[0]) == 2 and len(shapes[1]) == 3:
        rows, (experts, a, b) = shapes[0][0], shapes[1]
        return 2.0 * rows * a * b
    if name.endswith("grouped_mm_weight_grad") and len(shapes) >= 2 and len(shapes[0]) == 2:
        return 2.0 * shapes[0][0] * shapes[0][1] * shapes[1][1]
    if name not in _FORMULAS:
        _FORMULAS[name] = _formula(name)
    found = _FORMULAS[name]
    if found is None or not shapes:
        return 0.0
    f, n = found
    try:
        return float(f(*(shapes if n is None else shapes[:n])))
    except Exception:  # a formula that does not fit these recorded arguments: FLOPs not known
        return 0.0


def op_bytes(e) -> float:
    """Bytes an op reads (its tensor inputs) and writes (taken as its largest input)."""
    sizes = []
    for shape, dtype in zip(e.input_shapes or [], e.input_dtypes or []):
        if shape and dtype in ITEMSIZE:
            n = 1
            for d in shape:
                n *= d
            sizes.append(n * ITEMSIZE[dtype])
    return float(sum(sizes) + max(sizes, default=0))


def op_dtype(e) -> str:
    names = [DTYPE_NAMES[d] for d in (e.input_dtypes or []) if d in DTYPE_NAMES]
    for low in ("fp8", "bf16", "fp16"):
        if low in names:
            return low
    return "fp32"
