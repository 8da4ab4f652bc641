"""What a recipe names by a string (a reward, an environment): a built-in name, a name an installed
package registers under an entry-point group, or a ``module:attribute`` path imported from the Python
path (the user's own code, named in their own recipe; nothing is ever imported from data or checkpoints)."""

from __future__ import annotations

import importlib
import importlib.metadata


def load_plugin(spec: str, builtin: dict, group: str, kind: str, expected: str):
    """The object ``spec`` names (``builtin[spec]``, the entry point ``spec`` of ``group``, or
    ``module:attribute``); ValueError naming the ``kind`` and ``spec`` when it names none.
    ``expected`` says what a ``module:attribute`` path must name (e.g. "module:function")."""
    if spec in builtin:
        return builtin[spec]
    if ":" in spec:
        module_name, _, attr = spec.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:
            raise ValueError(f"{kind} {spec!r}: cannot import module {module_name!r} ({e}); expected "
                             f"{expected} with the module on the Python path") from None
        found = getattr(module, attr, None)
        if found is None:
            raise ValueError(f"{kind} {spec!r}: module {module_name!r} has no attribute {attr!r}")
        return found
    found = [ep for ep in importlib.metadata.entry_points(group=group) if ep.name == spec]
    if not found:
        registered = sorted(ep.name for ep in importlib.metadata.entry_points(group=group))
        raise ValueError(f"{kind} {spec!r}: not a built-in ({', '.join(builtin)}), not registered under the "
                         f"entry-point group {group!r} (registered: {registered or 'none'}) and not a "
                         f"{expected} path")
    return found[0].load()
