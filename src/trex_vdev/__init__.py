"""trex_vdev: a virtual accelerator, "vdev", registered from Python through PrivateUse1.

Contract
--------
Purpose: prove that device-agnostic code (trex's device layer, training loops, optimizers,
checkpointing, collectives) really is device-agnostic, on machines without accelerator hardware.
It registers the way an out-of-tree accelerator such as torch_npu registers "npu": PrivateUse1 is
renamed to ``"vdev"``, a device module is registered as ``torch.vdev``
(``torch.get_device_module("vdev")``), Tensor/Module methods are generated (``t.vdev()``,
``t.is_vdev``, ``module.vdev()``), and PrivateUse1 hooks and a device guard are installed, so that
``torch.accelerator.is_available()`` is True and ``torch.accelerator.current_accelerator() ==
torch.device("vdev")``. It is a test device, not a performance device.

Use: ``import trex_vdev`` (or ``trex_vdev.register()``; idempotent) before anything asks torch for
the accelerator; then ``device="vdev"``/``"vdev:0"``, ``.to("vdev")``, or trex's
``TREX_DEVICE=vdev`` / ``--device vdev`` (trex.device does not import this package by itself).
Registration is process-global and irreversible (the process becomes an accelerator process), so
test suites should register it in a subprocess.

Data lives in CPU memory. A vdev tensor is a ``trex_vdev.VDevTensor``, a wrapper tensor subclass
whose data is a plain CPU tensor (``trex_vdev.cpu_data(t)``); every aten op runs the CPU kernel on
it, views share its memory, in-place ops and ``out=`` ops mutate it. Results are therefore bitwise
equal to the same program on CPU, provided the program takes the same code paths on both devices
(code that branches on ``device.type == "cpu"`` may not; nor do a few composite ops, see below).
Devices are checked like on a real accelerator: mixing vdev with non-scalar CPU tensors, or vdev:0
with vdev:1, raises "Expected all tensors to be on the same device", except in copies, ``.to()``
and indexing with CPU indices; 0-dim CPU tensors are accepted as scalars.

RNG: vdev has no generator of its own. ``torch.vdev.manual_seed/seed/get_rng_state/set_rng_state``
act on the CPU default generator (so ``torch.vdev.manual_seed`` also seeds CPU), random ops on vdev
draw from it, and ``torch.Generator(device="vdev")`` returns a CPU generator that reports device
vdev (``torch.Generator`` is replaced by a thin factory; ``TREX_VDEV_PATCH_GENERATOR=0`` opts out).
A seeded vdev run draws the same numbers as the seeded CPU run.

Memory: ``torch.vdev.memory_allocated/max_memory_allocated/reset_peak_memory_stats`` (and
``torch.accelerator.memory_*``) count the bytes of the distinct CPU storages held by live vdev
tensors (views counted once). ``get_device_properties().total_memory`` is
``TREX_VDEV_TOTAL_MEMORY`` or the machine's RAM.

Works: factories; elementwise, reduction, matmul, indexing, complex ops (conj/neg bits); views and
in-place ops through views; ``.item()``/``.tolist()``/printing; transfers; autograd (custom
``autograd.Function``, ``torch.utils.checkpoint`` with RNG preservation, double backward);
``nn.Module.to("vdev")``, ``param.data = ...``, ``copy.deepcopy``; AdamW (per-tensor, foreach,
fused), ``clip_grad_norm_``; ``state_dict``/``load_state_dict``; ``torch.save`` (a vdev tensor
pickles as CPU data plus its device; ``torch.load(map_location="cpu")`` loads it anywhere);
``torch.autocast("vdev")`` (CUDA's cast policy: matmuls in the autocast dtype, softmax/norms/losses
in fp32; no cast cache); ``torch.compile`` (Dynamo/AOTAutograd see through the subclass, Inductor
emits CPU code); ``torch.distributed`` with gloo (collectives unwrap to CPU, see ``_dist.py``;
DDP works); ``torch.accelerator.synchronize/memory_*/empty_cache/get_memory_info/device_count``
(routed to ``torch.vdev``; ``TREX_VDEV_PATCH_ACCELERATOR=0`` opts out).

Several processes, one device index each (``TREX_VDEV_COUNT=n``, rank r on ``vdev:r``, what trex
picks from ``LOCAL_RANK``): DTensor and FSDP2 (``fully_shard``) over gloo work. Checked with trex's
2-process ``parallel.dp_shard=2`` SFT run (Muon, grad accumulation, MTP, MoE): losses, MTP losses
and grad norms bitwise equal to the same run on CPU (tests/test_vdev_plugin.py). What that needs
from the plugin, each found by the run failing without it:
- FakeTensors of device vdev (DTensor's sharding propagation runs every op on them): a view's meta
  tensor inherits the PrivateUse1 key, so ``FakeTensor.__new__`` detaching it reached this
  package's Python ``detach`` kernel (infinite recursion, then "already associated to a python
  object"). ``FakeTensor.__new__`` is wrapped to include the Meta key while it builds such a
  tensor (what FakeTensorMode does around its own kernels), and the PrivateUse1 kernels run the
  Meta kernel for meta tensors instead of unwrapping them (``_tensor.patch_fake_tensor``).
- ``torch.vdev.Stream``/``Event``/``stream``/``current_stream`` with ``torch.cuda``'s signatures
  (subclasses of ``torch.Stream``/``torch.Event``; everything is synchronous, so waits are no-ops
  and ``Event.synchronize()`` returns at once).
- FSDP2 frees its all-gather buffers with ``t.untyped_storage().resize_(0)`` and reallocates them
  with ``.resize_(n)``: on a vdev storage (the wrapper's, holding no data) a ``resize_`` that does
  not grow it is accepted and does nothing; the memory stays allocated, so ``memory_allocated``
  does not show FSDP2's frees (``torch.UntypedStorage.resize_`` is wrapped for vdev storages only).
- Backward on vdev:1: see below (autograd multithreading is off).
- ``t.new_tensor(data)`` takes ``t``'s device (C++ would ask the device guard, which says 0).
- Another tensor subclass among an op's arguments (a DTensor in ``torch.where(vdev_mask, dtensor,
  0)``) gets the op first: ``__torch_dispatch__`` returns ``NotImplemented``.

Does not work / differs:
- One device really: ``TREX_VDEV_COUNT=n`` makes ``device_count()`` n and tensors carry their
  index (mixing indices raises), but all indices are the same CPU memory. PyTorch's Python
  PrivateUse1 device guard is a stub (``deviceCount()`` 1, current device always 0, no-op
  ``setDevice``), hence:
  - the autograd engine has a worker queue for vdev:0 only, and a backward on vdev:1 hits an
    internal assert in engine.cpp. ``register()`` calls
    ``torch.autograd.set_multithreading_enabled(False)``, so backward runs on the calling thread
    (as a CPU backward does) for every index. The setting is thread-local: a backward on vdev:1
    in another thread needs that call in that thread;
  - where C++ fills in a missing index it gets 0, whatever ``torch.vdev.set_device`` said:
    ``torch.tensor(x, device="vdev")``, ``cpu_t.to("vdev")`` land on vdev:0. Pass the index
    (``vdev:1``), as trex does; Python-level factories (``torch.zeros(..., device="vdev")``) do
    use the current device;
  - streams and events always report index 0.
- ``untyped_storage()`` of a vdev tensor is the wrapper's, which holds no data: its ``data_ptr()``
  raises (so ``safetensors.torch.save`` of vdev tensors: call ``.cpu()`` first), growing it raises,
  shrinking it is a no-op (see FSDP2 above). ``Tensor.set_(storage)``,
  ``torch.UntypedStorage(..., device="vdev")`` (segfaults in PyTorch),
  ``torch.load(map_location="vdev")`` (refused with a message: load to CPU, then
  ``.to("vdev")``/``load_state_dict``), pinned memory (``pin_memory()`` raises),
  ``torch.Event(device="vdev")`` synchronize/elapsed_time (``torch.vdev.Event`` synchronizes),
  sparse/quantized layouts.
- trex computes in bf16 on an accelerator by default (``precision`` auto) and in fp32 on CPU: to
  compare a trex run on vdev with the CPU run, pin ``precision.dtype`` (and ``optim.ns_dtype``).
- Ops called on vdev tensors under ``torch._C._DisableTorchDispatch()``/``no_dispatch()`` hit a
  PyTorch assert ("func != nullptr") unless they are in ``EXPLICIT_PRIVATEUSE1_OPS``.
- Composite ops that branch on the device: ``scaled_dot_product_attention`` takes the math path on
  vdev (CPU takes its flash kernel; compare with ``sdpa_kernel(SDPBackend.MATH)`` on CPU);
  ``flex_attention`` refuses devices other than cuda/cpu/hpu/mps (a PyTorch check); in
  ``torch.inference_mode`` composite ops reach the wrapper undecomposed and run CPU's own
  composite. Autocast follows CUDA's op lists, not CPU's.
- Optimizers and ``clip_grad_norm_`` default to their per-tensor path (the parameters are a tensor
  subclass) where CUDA defaults to foreach; pass ``foreach=`` explicitly when comparing.
- ``init_process_group()`` without a backend creates only a vdev backend, and vdev collectives
  unwrap to CPU tensors: use ``backend="gloo"`` (what ``trex.device.Device.backend()`` returns).
- Every op pays Python dispatch overhead (tens of times slower than CPU on small ops).
"""

from __future__ import annotations

import os
import threading

import torch

from trex_vdev._tensor import DEVICE_TYPE, VDevTensor, cpu_data

__all__ = ["DEVICE_TYPE", "VDevTensor", "cpu_data", "is_registered", "register", "device"]

_lock = threading.Lock()
_registered = False
_keep_alive: list = []  # the hook, guard and library objects C++ holds raw pointers to


class _Hooks(torch._C._acc.PrivateUse1Hooks):
    def is_available(self) -> bool:
        return True

    def is_built(self) -> bool:
        return True

    def has_primary_context(self, device_index: int) -> bool:
        return True


class _DeviceGuard(torch._C._acc.DeviceGuard):
    def type_(self):
        return torch._C._autograd.DeviceType.PrivateUse1


def is_registered() -> bool:
    return _registered


def register() -> None:
    """Register "vdev" as the PrivateUse1 device of this process (idempotent)."""
    global _registered
    with _lock:
        if _registered:
            return
        name = torch._C._get_privateuse1_backend_name()
        if name != DEVICE_TYPE:
            if name != "privateuseone":
                raise RuntimeError(
                    f"trex_vdev: PrivateUse1 is already registered as {name!r} in this process"
                )
            torch.utils.rename_privateuse1_backend(DEVICE_TYPE)
        from trex_vdev import _module, _tensor

        if getattr(torch, DEVICE_TYPE, None) is None:
            torch._register_device_module(DEVICE_TYPE, _module)
        if not hasattr(torch.Tensor, f"is_{DEVICE_TYPE}"):
            torch.utils.generate_methods_for_privateuse1_backend(
                for_tensor=True, for_module=True, for_packed_sequence=True, for_storage=False
            )
        hooks, guard = _Hooks(), _DeviceGuard()
        torch._C._acc.register_python_privateuseone_hook(hooks)
        torch._C._acc.register_python_privateuseone_device_guard(guard)
        lib = torch.library.Library("_", "IMPL")  # noqa: TOR901 - a backend fallback, on purpose
        lib.fallback(_tensor.privateuse1_fallback, "PrivateUse1")
        lib_aten = torch.library.Library("aten", "IMPL")  # noqa: TOR901
        _tensor.register_kernels(lib_aten)
        _tensor.register_serialization()
        _tensor.patch_fake_tensor()
        _tensor.patch_storage_resize()
        from trex_vdev import _autocast

        _autocast.register(lib, lib_aten)
        if os.environ.get("TREX_VDEV_PATCH_GENERATOR", "1") != "0":
            from trex_vdev import _generator

            _generator.patch()
        from trex_vdev import _dist

        _dist.setup()
        if os.environ.get("TREX_VDEV_PATCH_ACCELERATOR", "1") != "0":
            from trex_vdev import _accel

            _accel.patch()
        # The Python device guard reports deviceCount() == 1 (a PyTorch stub), so the autograd
        # engine makes a worker queue for vdev:0 only and a backward on vdev:1 hits an internal
        # assert. Without multithreading the engine runs the backward on the calling thread, like
        # a CPU backward, for every index (the setting is thread-local: this thread's).
        torch.autograd.set_multithreading_enabled(False)
        _keep_alive.extend([hooks, guard, lib, lib_aten])
        _registered = True


def device(index: int = 0) -> torch.device:
    """``torch.device("vdev", index)``."""
    return torch.device(DEVICE_TYPE, index)


register()
