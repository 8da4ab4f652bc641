"""``torch.Generator(device="vdev")``.

A generator for a PrivateUse1 device comes from the C++ hook ``getNewGenerator``, which a backend
registered from Python cannot provide ("You should register PrivateUse1HooksInterface ... and
implement getNewGenerator"). Device-agnostic code does create device generators (e.g.
``torch.Generator(device=param.device).manual_seed(seed)`` for initialisation), so
``torch.Generator`` is replaced by a thin factory: for "vdev" it returns a ``VDevGenerator``, a CPU
generator (its own state, seeded independently) whose ``.device`` reads ``vdev:i``; every other
device gets the ordinary ``torch._C.Generator``. ``isinstance(g, torch.Generator)`` keeps working
for all generators. Random ops on vdev run the CPU kernels, so a ``VDevGenerator`` seeded with s
draws exactly what ``torch.Generator().manual_seed(s)`` draws on CPU. Set
``TREX_VDEV_PATCH_GENERATOR=0`` before the import to leave ``torch.Generator`` alone.
"""

from __future__ import annotations

import torch

from trex_vdev._tensor import DEVICE_TYPE, _normalize_device

_CGenerator = torch._C.Generator


class VDevGenerator(_CGenerator):
    """A CPU generator that reports a vdev device."""

    def __init__(self, device=None):  # the C type ignores __init__ arguments once built
        pass

    @property
    def device(self) -> torch.device:
        return self._vdev_device

    def __repr__(self) -> str:
        return f"<VDevGenerator device={self._vdev_device} (CPU generator)>"

    def __reduce__(self):
        return (_rebuild, (str(self._vdev_device), self.get_state()))


def _rebuild(device, state):
    g = new_generator(device)
    g.set_state(state)
    return g


def new_generator(device) -> VDevGenerator:
    g = _CGenerator.__new__(VDevGenerator, "cpu")
    g._vdev_device = _normalize_device(device)
    return g


class _GeneratorMeta(type):
    def __instancecheck__(cls, obj):
        return isinstance(obj, _CGenerator)

    def __subclasscheck__(cls, sub):
        return issubclass(sub, _CGenerator)

    def __call__(cls, device="cpu"):
        dev = torch.device(device) if not isinstance(device, torch.device) else device
        if dev.type == DEVICE_TYPE:
            return new_generator(dev)
        return _CGenerator(device)


class Generator(metaclass=_GeneratorMeta):
    """Stands in for ``torch.Generator``: ``Generator(device="vdev")`` gives a ``VDevGenerator``."""

    __doc__ = _CGenerator.__doc__


def patch() -> None:
    if torch.Generator is _CGenerator:
        torch.Generator = Generator
