"""The "vdev" tensor: a wrapper tensor subclass whose data is a plain CPU tensor.

Every aten op that reaches a ``VDevTensor`` (through the Python dispatch key) or that reaches
the PrivateUse1 backend with no tensor argument (factories such as ``torch.empty(...,
device="vdev")``, through a boxed PrivateUse1 fallback) ends in :func:`dispatch`, which

1. checks devices the way a real backend does (no mixing of vdev and non-scalar CPU tensors,
   no mixing of vdev:0 and vdev:1, except in the transfer and indexing ops that allow it),
2. replaces each ``VDevTensor`` by its CPU tensor and a ``device="vdev:i"`` argument by
   ``device="cpu"``,
3. runs the very same aten overload on CPU,
4. wraps tensor outputs back into ``VDevTensor`` (unless the op was asked for a CPU result),
   returns the mutated argument itself for in-place and ``out=`` ops, makes view outputs share
   the wrapper storage of their base (``return_and_correct_aliasing``), and refreshes the
   wrapper's sizes/strides when the CPU tensor was resized or restrided in place.

Because views of the CPU tensor share its memory, in-place updates through views (optimizers,
``param.data``, ``nn.Parameter``) behave as on a device.

Pitfalls handled here (each found by a failing comparison with CPU):
- conj/neg bits: inside ``__torch_dispatch__`` the Conjugate/Negative fallbacks are excluded, so
  the wrapper carries the CPU tensor's lazy bits and PyTorch resolves them above the Python key;
- ops with both a CompositeImplicitAutograd and a CPU kernel (``silu_backward``...) get a
  PrivateUse1 kernel so that vdev, like CPU, skips the decomposition (``_hybrid_ops``);
- a Python *fallback* cannot receive a vdev tensor while the Python key is excluded
  (``torch.tensor(..., device="vdev")`` does that): those ops get explicit kernels;
- ``resize_``/``set_``/``out=`` resizes are copied to the wrapper through the Meta ``set_`` kernel;
  inplace-view ops (``t_``, ``squeeze_``...) through ``return_and_correct_aliasing``;
- ``.to("cpu")`` reaching the wrapper undecomposed (inference mode) must copy, not alias;
- ``.data =`` (a C++ setter that consults ``__torch_function__``) must swap the CPU data too;
- ZeroTensors (no data) are materialised; ``tolist``/``__format__``/``data_ptr``/``numpy``/
  ``__reduce_ex__``/``__deepcopy__`` are redefined because torch's versions read the wrapper's
  empty storage or reject subclasses;
- meta tensors carrying the PrivateUse1 key (views of vdev FakeTensors) run the Meta kernel in the
  PrivateUse1 kernels instead of recursing, and ``FakeTensor.__new__`` builds them with the Meta
  key included (``patch_fake_tensor``);
- another tensor subclass among the arguments (DTensor) gets ``NotImplemented`` and goes first;
- ``new_tensor`` passes its own device (C++ would take index 0 from the stub device guard);
- ``UntypedStorage.resize_`` on a vdev storage that does not grow is a no-op (FSDP2's frees).
"""

from __future__ import annotations

import copy
import threading
from typing import Any

import torch
from torch.utils._python_dispatch import get_alias_info, return_and_correct_aliasing

DEVICE_TYPE = "vdev"
aten = torch.ops.aten
_CPU = torch.device("cpu")
_TensorBase = torch._C.TensorBase
_DATA_DESCRIPTOR = _TensorBase.__dict__["data"]

# Ops that legitimately take tensors on several devices (transfers, CPU index tensors).
_CROSS_DEVICE_OK = {
    aten.copy_.default,
    aten._to_copy.default,
    aten._copy_from.default,
    aten._copy_from_and_resize.default,
    aten.index.Tensor,
    aten.index_put.default,
    aten.index_put_.default,
    aten._index_put_impl_.default,
    aten._unsafe_index.Tensor,
    aten._unsafe_index_put.default,
    aten.set_.source_Tensor,
    # inference mode lets these composite ops through undecomposed
    aten.to.device,
    aten.to.dtype_layout,
    aten.to.other,
}


def _current_index() -> int:
    from trex_vdev import _module

    return _module.current_device()


def _normalize_device(dev: Any) -> torch.device:
    dev = torch.device(dev)
    if dev.type == DEVICE_TYPE and dev.index is None:
        return torch.device(DEVICE_TYPE, _current_index())
    return dev


# ---- memory accounting --------------------------------------------------------------------
# Bytes of the distinct CPU storages held by live VDevTensors, per device index. A storage
# shared by several wrappers (views, detach, .data) is counted once.
_mem_lock = threading.RLock()
_storage_refs: dict[tuple[int, int], list[int]] = {}  # (index, StorageImpl) -> [nbytes, refcount]
_allocated: dict[int, int] = {}
_peak: dict[int, int] = {}


def _acquire(index: int, inner: torch.Tensor) -> tuple[int, int] | None:
    st = inner.untyped_storage()
    nbytes = st.nbytes()
    if nbytes == 0:
        return None
    key = (index, st._cdata)  # the StorageImpl: its address survives storage resizes
    with _mem_lock:
        entry = _storage_refs.get(key)
        if entry is None:
            _storage_refs[key] = [nbytes, 1]
            now = _allocated.get(index, 0) + nbytes
            _allocated[index] = now
            if now > _peak.get(index, 0):
                _peak[index] = now
        else:
            entry[1] += 1
    return key


def _release(key: tuple[int, int] | None) -> None:
    if key is None or _storage_refs is None:  # nothing held / interpreter shutdown
        return
    with _mem_lock:
        entry = _storage_refs.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            del _storage_refs[key]
            _allocated[key[0]] = _allocated.get(key[0], 0) - entry[0]


class _Lease:
    """Held in a VDevTensor's __dict__: counts its CPU storage while the tensor lives.

    (A weakref.finalize would do too, but torch.utils.swap_tensors, which nn.Module.to() uses for
    traceable subclasses, refuses tensors that have weak references.)"""

    __slots__ = ("key",)

    def __init__(self, key):
        self.key = key

    def __del__(self):
        _release(self.key)

    def __deepcopy__(self, memo):
        return _Lease(None)

    def __reduce__(self):
        return (_Lease, (None,))


def memory_allocated(index: int) -> int:
    return _allocated.get(index, 0)


def max_memory_allocated(index: int) -> int:
    return _peak.get(index, 0)


def reset_peak_memory_stats(index: int) -> None:
    with _mem_lock:
        _peak[index] = _allocated.get(index, 0)


def _track(t: "VDevTensor") -> None:
    t._vdev_lease = _Lease(_acquire(t.device.index, t._vdev_cpu))


def _retrack(t: "VDevTensor") -> None:
    """The CPU tensor of ``t`` changed storage (``.data =``, ``set_``, ``resize_``)."""
    if not _is_tracing(t._vdev_cpu):
        _track(t)  # the old lease is released when it is replaced


# ---- the tensor subclass ----------------------------------------------------------------------
class VDevTensor(torch.Tensor):
    """A tensor on the virtual device; ``_vdev_cpu`` is its data (a plain CPU tensor)."""

    _vdev_cpu: torch.Tensor

    @staticmethod
    def __new__(cls, inner: torch.Tensor, device: torch.device):
        if inner.layout != torch.strided:
            raise NotImplementedError(f"trex_vdev: only strided tensors are supported, got {inner.layout}")
        if inner.device.type != "cpu":
            raise RuntimeError(f"trex_vdev: the data of a vdev tensor must be on CPU, got {inner.device}")
        if inner._is_zerotensor():
            # ZeroTensors have no data; the ZeroTensor key is excluded inside __torch_dispatch__,
            # so CPU kernels would read a null pointer. A real zero tensor is equivalent.
            inner = torch.zeros(inner.shape, dtype=inner.dtype)
        r = torch.Tensor._make_wrapper_subclass(
            cls,
            inner.size(),
            strides=inner.stride(),
            storage_offset=inner.storage_offset(),
            dtype=inner.dtype,
            layout=inner.layout,
            device=device,
            requires_grad=False,
            storage_size=inner.untyped_storage().nbytes(),
        )
        # Lazy conjugate/negative bits must live on the wrapper too: inside __torch_dispatch__
        # the Conjugate/Negative fallbacks are excluded, so a CPU kernel given an inner tensor
        # with the bit set would silently ignore it. With the bit on the wrapper, PyTorch
        # materialises it above the Python key, exactly as it does for a CPU or CUDA tensor.
        if inner.is_conj():
            torch._C._set_conj(r, True)
        if inner.is_neg():
            torch._C._set_neg(r, True)
        r._vdev_cpu = inner
        if not _is_tracing(inner):
            _track(r)
        return r

    def __init__(self, inner, device):  # noqa: D107 - __new__ does the work
        pass

    # Traceable wrapper subclass protocol: lets torch.compile (Dynamo + AOTAutograd) see through
    # the wrapper and compile the CPU program underneath (Inductor then emits CPU code).
    def __tensor_flatten__(self):
        return ["_vdev_cpu"], self.device

    @staticmethod
    def __tensor_unflatten__(inner_tensors, ctx, outer_size, outer_stride):
        return VDevTensor(inner_tensors["_vdev_cpu"], ctx)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__self__", None) is _DATA_DESCRIPTOR and getattr(func, "__name__", "") == "__set__":
            return _set_data(*args)  # ``t.data = new`` (the C++ setter consults __torch_function__)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    # Methods that PyTorch implements only for plain tensors (or that must not read the wrapper's
    # empty storage); defined on the class so they also apply with torch functions disabled.
    def tolist(self):
        return self._vdev_cpu.tolist()

    def numpy(self, *, force: bool = False):
        raise TypeError(
            f"can't convert {self.device} device type tensor to numpy. "
            "Use Tensor.cpu() to copy the tensor to host memory first."
        )

    def __format__(self, format_spec):
        if self.dim() == 0:
            return self._vdev_cpu.detach().item().__format__(format_spec)
        return object.__format__(self, format_spec)

    def __repr__(self, *, tensor_contents=None):
        # Print like a tensor on a real device: "tensor([...], device='vdev:0')".
        with torch._C.DisableTorchFunctionSubclass():
            text = torch._tensor_str._str(self, tensor_contents=tensor_contents)
        is_param = text.startswith("Parameter(") and text.endswith(")")
        if is_param:
            text = text[len("Parameter("):-1]
        prefix = type(self).__name__ + "("
        if text.startswith(prefix):
            body = text[len(prefix):].replace("\n" + " " * len(prefix), "\n" + " " * len("tensor("))
            text = "tensor(" + body
        return "Parameter containing:\n" + text if is_param else text

    def data_ptr(self):
        # A real (CPU) address, so that aliasing checks based on data_ptr() keep working.
        return self._vdev_cpu.data_ptr()

    def new_tensor(self, data, *args, **kwargs):
        # C++ fills in the device of ``t.new_tensor(data)`` from the device guard, and the Python
        # PrivateUse1 guard of PyTorch always answers index 0: vdev:1 tensors made vdev:0 ones.
        if kwargs.get("device") is None:
            kwargs["device"] = self.device
        return torch.Tensor.new_tensor(self, data, *args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if any(not issubclass(t, VDevTensor) for t in types):
            # Another tensor subclass is among the arguments (a DTensor, in ``torch.where(mask,
            # dtensor, 0)``): let it handle the op first; it calls it again with vdev tensors.
            return NotImplemented
        with torch._C.DisableTorchFunctionSubclass():
            return dispatch(func, args, kwargs or {})

    def __reduce_ex__(self, proto):
        # Pickle (torch.save) as a CPU tensor plus the device it came from, like XLA/PrivateUse1
        # tensors without storage; torch.load(map_location=...) can put it elsewhere.
        return (
            torch._utils._rebuild_device_tensor_from_cpu_tensor,
            (self.detach().cpu(), self.dtype, str(self.device), self.requires_grad),
        )

    def __deepcopy__(self, memo):
        if id(self) in memo:
            return memo[id(self)]
        with torch.no_grad():
            new = self.clone()
        new.requires_grad_(self.requires_grad)
        for k, v in self.__dict__.items():
            if k not in ("_vdev_cpu", "_vdev_lease"):
                setattr(new, k, copy.deepcopy(v, memo))  # e.g. _is_param
        if self.grad is not None:
            new.grad = copy.deepcopy(self.grad, memo)
        memo[id(self)] = new
        return new


def _is_tracing(inner: torch.Tensor) -> bool:
    return type(inner) is not torch.Tensor and not isinstance(inner, torch.nn.Parameter)


def _set_data(self: torch.Tensor, new: torch.Tensor) -> None:
    """``self.data = new``: the C++ setter swaps the TensorImpl; we swap the CPU data too."""
    with torch._C.DisableTorchFunctionSubclass():
        _DATA_DESCRIPTOR.__set__(self, new)
    if isinstance(self, VDevTensor) and isinstance(new, VDevTensor):
        self._vdev_cpu = new._vdev_cpu
        _retrack(self)


def cpu_data(t: torch.Tensor) -> torch.Tensor:
    """The CPU tensor behind a vdev tensor (shares memory with it); CPU tensors pass through."""
    return t._vdev_cpu if isinstance(t, VDevTensor) else t


# ---- dispatch ---------------------------------------------------------------------------------
def _map(fn, x):
    if isinstance(x, (list, tuple)):
        mapped = [_map(fn, y) for y in x]
        return mapped if isinstance(x, list) else type(x)(mapped) if type(x) is tuple else type(x)(*mapped)
    if isinstance(x, dict):
        return {k: _map(fn, v) for k, v in x.items()}
    return fn(x)


def _iter_tensors(x):
    if isinstance(x, (list, tuple)):
        for y in x:
            yield from _iter_tensors(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _iter_tensors(y)
    elif isinstance(x, torch.Tensor):
        yield x


def _unwrap(x):
    return x._vdev_cpu if isinstance(x, VDevTensor) else x


def _device_error(func, a, b) -> RuntimeError:
    return RuntimeError(
        f"Expected all tensors to be on the same device, but found at least two devices, {a} and {b}! "
        f"(when checking arguments for {func}) [trex_vdev]"
    )


def _sync_metadata(w: VDevTensor) -> None:
    """Make the wrapper's sizes/strides/offset match its CPU tensor after an in-place change."""
    inner = w._vdev_cpu
    if (
        w.shape == inner.shape
        and w.stride() == inner.stride()
        and w.storage_offset() == inner.storage_offset()
    ):
        return
    from torch.utils._mode_utils import no_dispatch

    with no_dispatch():
        meta_in_tls = torch._C._meta_in_tls_dispatch_include()
        torch._C._set_meta_in_tls_dispatch_include(True)
        try:
            aten.set_.source_Storage_storage_offset(
                w, _TensorBase.untyped_storage(w), inner.storage_offset(), inner.shape, inner.stride()
            )
        finally:
            torch._C._set_meta_in_tls_dispatch_include(meta_in_tls)


def dispatch(func, args, kwargs):
    special = _SPECIAL.get(func)
    if special is not None:
        return special(func, args, kwargs)

    # 1. devices
    vdevice = None
    cpu_dev = None
    for t in _iter_tensors((args, kwargs)):
        if isinstance(t, VDevTensor):
            if vdevice is None:
                vdevice = t.device
            elif t.device != vdevice and func not in _CROSS_DEVICE_OK:
                raise _device_error(func, vdevice, t.device)
        elif t.dim() > 0 or t.device.type != "cpu":
            cpu_dev = t.device
    if vdevice is not None and cpu_dev is not None and func not in _CROSS_DEVICE_OK:
        raise _device_error(func, vdevice, cpu_dev)

    target = vdevice
    if func is aten.to.other:
        target = _normalize_device(args[1].device)
    elif func is aten.to.device:
        target = _normalize_device(args[1] if len(args) > 1 else kwargs["device"])
    if func is aten.to.device and target.type == DEVICE_TYPE:
        args = (args[0], _CPU) + tuple(args[2:])
    if kwargs.get("device") is not None:
        target = _normalize_device(kwargs["device"])
    if target is None:
        target = torch.device(DEVICE_TYPE, _current_index())

    # 2. unwrap, 3. run on CPU
    uargs = _map(_unwrap, args)
    ukwargs = {k: _map(_unwrap, v) for k, v in kwargs.items()}
    if target.type == DEVICE_TYPE and "device" in ukwargs:
        ukwargs["device"] = _CPU
    out = func(*uargs, **ukwargs)

    # 4. wrap
    info = get_alias_info(func)
    if info.read_only_alias_match_indexes and vdevice is not None and target != vdevice:
        # A view-like op asked for another device (``aten.to(..., device="cpu")``, which
        # inference mode lets through undecomposed): the CPU op returned the data itself, but a
        # transfer between devices always copies.
        out = _map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, out)
        if target.type == DEVICE_TYPE:
            out = _map(lambda x: VDevTensor(x, target) if isinstance(x, torch.Tensor) else x, out)
        return out
    if info.outs_write_aliases is None and target.type == DEVICE_TYPE:
        out = _map(
            lambda x: VDevTensor(x, target) if isinstance(x, torch.Tensor) and not isinstance(x, VDevTensor) else x,
            out,
        )
    out = return_and_correct_aliasing(func, args, kwargs, out)
    # in-place / out= ops may have resized or restrided their CPU tensor
    if any(a.is_write for a in info.args):
        for t in _iter_tensors((args, kwargs)):
            if isinstance(t, VDevTensor):
                _sync_after_write(t)
    return out


def _sync_after_write(t: VDevTensor) -> None:
    inner = t._vdev_cpu
    if (t.shape != inner.shape or t.stride() != inner.stride()
            or t.storage_offset() != inner.storage_offset()):
        _sync_metadata(t)
    lease = t.__dict__.get("_vdev_lease")
    if lease is not None and not _is_tracing(inner):
        nbytes = inner.untyped_storage().nbytes()
        if (lease.key is None) != (nbytes == 0) or (lease.key is not None and lease.key[1] != inner.untyped_storage()._cdata):
            _retrack(t)


# ---- ops with their own handling --------------------------------------------------------------
def _check_self(func, self, others=()):
    if not isinstance(self, VDevTensor):
        raise _device_error(func, self.device, next((o.device for o in others if isinstance(o, torch.Tensor)), "vdev"))
    for o in others:
        if isinstance(o, torch.Tensor) and o.device != self.device:
            raise _device_error(func, self.device, o.device)


def _resize_like(func, args, kwargs):
    """resize_, resize_as_, set_(): change the CPU tensor, then copy its metadata to the wrapper."""
    self = args[0]
    _check_self(func, self, args[1:2] if func is aten.resize_as_.default else ())
    func(*_map(_unwrap, args), **{k: _map(_unwrap, v) for k, v in kwargs.items()})
    _sync_metadata(self)
    _retrack(self)
    return self


def _set_source_tensor(func, args, kwargs):
    """set_(source[, offset, size, stride]): share the source's data (and wrapper storage)."""
    self = args[0]
    source = args[1] if len(args) > 1 else kwargs["source"]
    _check_self(func, self, [source])
    func(*_map(_unwrap, args), **{k: _map(_unwrap, v) for k, v in kwargs.items()})
    torch._functionalize_unsafe_set(self, source)  # the wrapper shares the source's storage
    _sync_metadata(self)
    _retrack(self)
    return self


def _set_source_storage(func, args, kwargs):
    raise NotImplementedError(
        "trex_vdev: Tensor.set_(storage) is not supported on vdev tensors (their storages hold no "
        "data); use Tensor.set_(tensor) or .data = tensor"
    )


def _has_compatible_shallow_copy_type(func, args, kwargs):
    a, b = args
    if isinstance(a, VDevTensor) or isinstance(b, VDevTensor):
        return isinstance(a, VDevTensor) and isinstance(b, VDevTensor)
    return func(a, b)


def _record_stream(func, args, kwargs):
    return None


_SPECIAL = {
    aten.resize_.default: _resize_like,
    aten.resize_as_.default: _resize_like,
    aten.set_.default: _resize_like,
    aten.set_.source_Tensor: _set_source_tensor,
    aten.set_.source_Tensor_storage_offset: _set_source_tensor,
    aten.set_.source_Storage: _set_source_storage,
    aten.set_.source_Storage_storage_offset: _set_source_storage,
    aten.record_stream.default: _record_stream,
    aten._has_compatible_shallow_copy_type.default: _has_compatible_shallow_copy_type,
}


# Ops that get an explicit PrivateUse1 kernel, besides the boxed fallback. PyTorch cannot route a
# vdev tensor through a *Python fallback* while the Python key is excluded (e.g. inside
# ``torch.tensor(..., device="vdev")``, ``torch.as_tensor``, ``no_dispatch()``): its trampoline
# looks for a per-op Python kernel and asserts ("func != nullptr"). These are the ops reached that
# way in practice; everything else reaching PrivateUse1 (factories) goes through the fallback.
EXPLICIT_PRIVATEUSE1_OPS = (
    "empty.memory_format", "empty_strided", "copy_", "_copy_from", "_copy_from_and_resize",
    "_to_copy", "detach", "alias", "lift_fresh", "lift_fresh_copy", "clone", "view",
    "_reshape_alias", "as_strided", "_local_scalar_dense", "empty_like", "fill_.Scalar", "zero_",
    "resize_", "resize_as_", "set_", "set_.source_Tensor", "set_.source_Tensor_storage_offset",
    "set_.source_Storage", "set_.source_Storage_storage_offset",
    "expand", "slice.Tensor", "select.int", "unsqueeze", "squeeze", "t", "transpose.int",
    "permute", "_unsafe_view", "contiguous", "record_stream",
)


def _meta_args(args, kwargs) -> bool:
    """True when the op reached PrivateUse1 with meta tensors and no vdev tensor.

    That happens under FakeTensorMode (DTensor's sharding propagation, torch.compile): a
    FakeTensor of device vdev is a meta tensor whose backend key is PrivateUse1, and a view of it
    made by a meta kernel inherits that key set, so ``FakeTensor.__new__`` detaching it
    (``Tensor._make_subclass``) lands here with a plain meta tensor. A real backend would have
    run a CompositeExplicitAutograd kernel; unwrapping it and calling the op again would land here
    again (infinite recursion)."""
    meta = False
    for t in _iter_tensors((args, kwargs)):
        if isinstance(t, VDevTensor):
            return False
        if t.device.type == "meta":
            meta = True
    return meta


def _run_on_meta(op, args, kwargs):
    """Run ``op`` with the Meta backend bit included (what FakeTensorMode does in its kernel
    invocations): the Meta kernel, or the composite one, computes the meta result."""
    prev = torch._C._meta_in_tls_dispatch_include()
    torch._C._set_meta_in_tls_dispatch_include(True)
    try:
        return op(*args, **kwargs)
    finally:
        torch._C._set_meta_in_tls_dispatch_include(prev)


def _explicit_kernel(op):
    def kernel(*args, **kwargs):
        if _meta_args(args, kwargs):
            return _run_on_meta(op, args, kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            return dispatch(op, args, kwargs)

    kernel.__name__ = f"vdev_{op.__name__}"
    return kernel


def _hybrid_ops() -> list[str]:
    """aten ops with a CompositeImplicitAutograd kernel *and* a CPU kernel (silu_backward,
    mish_backward, native_channel_shuffle in torch 2.13).

    For such an op the dispatcher uses the decomposition on a backend's Autograd key only when that
    backend has no kernel of its own: CPU tensors run the CPU kernel, while vdev tensors would
    decompose (SiLU's backward then differs from CPU in the last bits, which was the only
    difference between trex's tiny DeepSeek-V4 model on CPU and on vdev). A PrivateUse1 kernel
    makes vdev take the CPU kernel too."""
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    return [
        n[len("aten::"):]
        for n in torch._C._dispatch_get_all_op_names()
        if n.startswith("aten::") and has(n, "CompositeImplicitAutograd") and has(n, "CPU")
    ]


def _resolve(name: str):
    base, _, overload = name.partition(".")
    packet = getattr(aten, base, None)
    return None if packet is None else getattr(packet, overload or "default", None)


def register_kernels(lib: torch.library.Library) -> list[str]:
    done = []
    for name in EXPLICIT_PRIVATEUSE1_OPS:
        op = _resolve(name)
        if op is None or torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeImplicitAutograd"):
            continue  # such ops decompose before reaching the backend (see _hybrid_ops for the rest)
        lib.impl(name, _explicit_kernel(op), "PrivateUse1")
        done.append(name)
    for name in _hybrid_ops():
        op = _resolve(name)
        if op is not None and name not in done:
            lib.impl(name, _explicit_kernel(op), "PrivateUse1")
            done.append(name)
    return done


def _no_tag(obj):
    return None


def _refuse_vdev_location(obj, location):
    """torch.load(map_location="vdev") would build storages with torch.UntypedStorage(n,
    device="vdev"), which needs a C++ allocator that a Python backend does not have: PyTorch
    segfaults. Refuse it with a message instead (this runs before PyTorch's PrivateUse1 entry)."""
    if isinstance(location, str) and (location == DEVICE_TYPE or location.startswith(DEVICE_TYPE + ":")):
        raise RuntimeError(
            f"trex_vdev: torch.load(map_location={location!r}) is not supported (vdev storages "
            "cannot hold data); load with map_location='cpu' and move the tensors with .to('vdev') "
            "or module.load_state_dict()"
        )
    return None


def register_serialization() -> None:
    torch.serialization.register_package(1, _no_tag, _refuse_vdev_location)


def privateuse1_fallback(op, *args, **kwargs):
    """Boxed fallback for the PrivateUse1 key: factories and ops reached without the Python key."""
    if _meta_args(args, kwargs):
        return _run_on_meta(op, args, kwargs)
    with torch._C.DisableTorchFunctionSubclass():
        return dispatch(op, args, kwargs)


def patch_fake_tensor() -> None:
    """Let ``FakeTensor(..., device="vdev")`` be constructed from a meta tensor with PrivateUse1 keys.

    ``FakeTensor.__new__`` calls ``Tensor._make_subclass(cls, elem, device_for_backend_keys=vdev)``,
    which detaches ``elem`` through the dispatcher. Under FakeTensorMode (DTensor's sharding
    propagation, torch.compile) ``elem`` is often the meta output of a view of a vdev FakeTensor,
    and a view inherits its base's key set, PrivateUse1 included: the detach then reaches this
    package's Python ``detach`` kernel, and ``_make_subclass`` refuses its result ("already
    associated to a python object"; a Python kernel cannot return a tensor without one). With a
    C++ backend (CUDA) the detach runs a C++ kernel. The wrapper below includes the Meta key for the
    construction, as FakeTensorMode does around its own kernel calls, so that detach runs the
    C++ Meta kernel. Only constructions whose ``elem`` carries PrivateUse1 are affected."""
    from torch._subclasses import fake_tensor

    cls = fake_tensor.FakeTensor
    original = cls.__dict__["__new__"]
    original = getattr(original, "__func__", original)
    if getattr(original, "_trex_vdev", False):
        return
    pu1 = torch._C.DispatchKey.PrivateUse1

    def __new__(cls, *args, **kwargs):
        elem = args[1] if len(args) > 1 else kwargs.get("elem")
        if isinstance(elem, torch.Tensor) and torch._C._dispatch_keys(elem).has(pu1):
            prev = torch._C._meta_in_tls_dispatch_include()
            torch._C._set_meta_in_tls_dispatch_include(True)
            try:
                return original(cls, *args, **kwargs)
            finally:
                torch._C._set_meta_in_tls_dispatch_include(prev)
        return original(cls, *args, **kwargs)

    __new__._trex_vdev = True
    __new__.__wrapped__ = original
    cls.__new__ = staticmethod(__new__)


def patch_storage_resize() -> None:
    """Accept ``resize_`` on the storage of a vdev tensor when it does not grow it, as a no-op.

    The storage of a vdev tensor is the wrapper's own, which holds no data (its data is the CPU
    tensor's storage), and torch refuses ``resize_`` on it ("invalid python storage"). FSDP2 frees
    and reallocates its all-gather buffers with ``t.untyped_storage().resize_(0)`` and
    ``.resize_(n)`` (``torch.distributed.fsdp._fully_shard._fsdp_param.free_storage`` /
    ``alloc_storage``), and writes them in full before reading them again; keeping the memory is a
    valid outcome of both (the contents of a reallocated storage are undefined anyway). Growing a
    vdev storage raises. ``untyped_storage()`` itself is left alone: torch's tracing (Dynamo's
    meta converter, functionalization) identifies a wrapper by its own storage."""
    cls = torch.UntypedStorage
    original = cls.resize_
    if getattr(original, "_trex_vdev", False):
        return

    def resize_(self, size):
        if self.device.type == DEVICE_TYPE:
            if size <= self.nbytes():
                return self
            raise NotImplementedError(
                f"trex_vdev: cannot grow the storage of a vdev tensor ({self.nbytes()} -> {size} bytes)"
            )
        return original(self, size)

    resize_._trex_vdev = True
    resize_.__wrapped__ = original
    resize_.__doc__ = original.__doc__
    cls.resize_ = resize_
