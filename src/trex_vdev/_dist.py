"""torch.distributed for vdev: collectives on vdev tensors run on gloo, unchanged.

No process-group backend of its own is needed. A c10d collective is a dispatcher op
(``c10d::allreduce_`` etc.); called with vdev tensors it reaches ``VDevTensor.__torch_dispatch__``
like any other op, which hands gloo the CPU tensors underneath (in place, so the vdev tensors see
the result) and passes the Work object through, so ``async_op=True`` + ``wait()`` work too.
Checked with two processes: all_reduce, broadcast, all_gather(_into_tensor), reduce_scatter_tensor,
all_to_all_single, barrier, async all_reduce, and DistributedDataParallel (same weights as on CPU);
DTensor and FSDP2 (``fully_shard``) too, through trex's 2-process ``dp_shard=2`` run (what they
need from the plugin besides collectives is listed in the package docstring).

What ``setup()`` adds is the registration a device plugin is expected to make
(``Backend.default_device_backend_map`` is documented as the place where "3rd-party devices can
register the default backend"): gloo is the default backend for "vdev", so
``dist.get_default_backend_for_device("vdev") == "gloo"`` and ``init_process_group()`` without a
backend picks gloo; and gloo is listed as supporting "vdev", so ``init_process_group("gloo")`` also
registers it for the vdev device type of the process group.
A custom Python ``Backend`` subclass (``Backend.register_backend(..., devices=["vdev"])``) is not
needed; it would also not be reached for vdev tensors, which are unwrapped before c10d picks a
backend.
"""

from __future__ import annotations

from trex_vdev._tensor import DEVICE_TYPE


def setup() -> bool:
    try:
        import torch.distributed as dist
    except ImportError:
        return False
    if not dist.is_available():
        return False
    backend = dist.Backend
    backend.default_device_backend_map.setdefault(DEVICE_TYPE, backend.GLOO)
    devices = backend.backend_capability.setdefault(backend.GLOO, ["cpu"])
    if DEVICE_TYPE not in devices:
        devices.append(DEVICE_TYPE)
    return True
