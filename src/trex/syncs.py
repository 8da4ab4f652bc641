"""Count device-to-host synchronisations in a region of code, on any device, CPU included.

    with SyncCounter() as syncs:
        train_step(...)
    assert syncs.count == 0, syncs.report()

An accelerator drains its queue whenever the host needs a value the device computes. This counts
every way trex code can ask for one, seen from two sides so that it works on CPU too (where nothing
actually waits, but the same code would on a GPU or NPU):

* torch-function side: ``Tensor.item``, ``tolist``, ``numpy``, ``__bool__``, ``__int__``,
  ``__float__``, ``__index__`` (``if t:``, ``int(t)``, ``range(t)``) - a host read of a tensor;
* dispatch side: ``aten._local_scalar_dense`` (the read under all of these), ops whose output shape
  depends on the data (``nonzero``, ``masked_select``, ``unique``, ``bincount``, ``repeat_interleave``
  without ``output_size``, boolean-mask indexing), and copies from an accelerator to the CPU.

One host read counts once (``int(t)`` is seen as ``__int__`` and not again as its
``_local_scalar_dense``). ``events`` keeps each one with the innermost frame outside torch that caused it.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

_HOST_READS = {"item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__"}
aten = torch.ops.aten
_DATA_DEPENDENT = {aten.nonzero.default, aten.masked_select.default, aten._unique2.default, aten.unique_dim.default,
                   aten.unique_consecutive.default, aten.bincount.default, aten.nonzero_static.default}


def _where() -> str:
    """The innermost stack frame outside torch and this module, as "file:line function"."""
    for frame in reversed(traceback.extract_stack()):
        if "/torch/" not in frame.filename and not frame.filename.endswith("trex/syncs.py"):
            return f"{frame.filename.rsplit('/src/', 1)[-1]}:{frame.lineno} {frame.name}"
    return "?"


class _FunctionSide(TorchFunctionMode):
    def __init__(self, counter: SyncCounter):
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in _HOST_READS:
            self.counter._add(name)
            self.counter._inside_read = True
            try:
                return func(*args, **(kwargs or {}))
            finally:
                self.counter._inside_read = False
        return func(*args, **(kwargs or {}))


class _DispatchSide(TorchDispatchMode):
    def __init__(self, counter: SyncCounter):
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.counter._inside_read:
            if func is aten._local_scalar_dense.default:
                self.counter._add("_local_scalar_dense")
            elif func in _DATA_DEPENDENT:
                self.counter._add(func.overloadpacket.__name__)
            elif func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
                self.counter._add("repeat_interleave without output_size")
            elif func is aten.index.Tensor and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool
                                                   for i in args[1]):
                self.counter._add("boolean-mask indexing")
            elif func in (aten._to_copy.default, aten.copy_.default) and _to_host(func, args, kwargs):
                self.counter._add("copy to host")
        return func(*args, **kwargs)


def _to_host(func, args, kwargs) -> bool:
    if func is aten.copy_.default:
        dst, src = args[0], args[1]
        return dst.device.type == "cpu" and src.device.type != "cpu"
    dev = kwargs.get("device")
    return dev is not None and torch.device(dev).type == "cpu" and args[0].device.type != "cpu"


@dataclass
class SyncCounter:
    """A context manager; ``count`` and ``events`` (what, where) after (or during) the region."""

    events: list[tuple[str, str]] = field(default_factory=list)
    _inside_read: bool = False

    @property
    def count(self) -> int:
        return len(self.events)

    def report(self) -> str:
        return "\n".join(f"  {what:40s} {where}" for what, where in self.events) or "  (none)"

    def _add(self, what: str) -> None:
        self.events.append((what, _where()))

    def __enter__(self) -> SyncCounter:
        self._modes = [_FunctionSide(self), _DispatchSide(self)]
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
