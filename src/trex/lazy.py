"""Package exports that load on first use (PEP 562), so that what needs none of a package's heavy
modules (``trex --help``, ``trex audit``, a config's arithmetic) does not import torch.

    __getattr__ = lazy_exports(__name__, {"build_model": "build", ...})

``from package import build_model`` then imports ``package.build`` when first asked.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable


def lazy_exports(package: str, exports: dict[str, str]) -> Callable[[str], object]:
    """A module ``__getattr__`` for ``package``: name -> the submodule (relative to the package) defining it.

    A name may not be a submodule's too: importing the submodule binds its name on the package to the
    module, and ``__getattr__`` would never be asked."""
    clash = set(exports) & set(exports.values())
    if clash:
        raise ValueError(f"{package}: {sorted(clash)} name a submodule and an export")

    def __getattr__(name: str) -> object:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{exports[name]}"), name)

    return __getattr__
