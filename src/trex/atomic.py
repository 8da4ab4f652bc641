"""Atomic file writes: a reader sees the old file or the whole new one, never part of either.

``replacing(path)`` yields a temporary path in the same folder, unique to the call (so processes
writing one file at once, every rank of a job, each publish a complete file), and renames it over
``path`` when the block ends without error; on any error the temporary file is removed and the
error propagates. The published file has the permissions of any file the process creates (0666
less the umask, so 0644 under the usual 022), not ``mkstemp``'s private 0600: a teammate or a
dashboard reads a run's summary and plots like the rest of its directory. ``write_text`` and ``write_json`` are the common cases; ``fsync=True`` makes the
bytes durable before the rename (checkpoint manifests).

``strict_json`` is the JSON a command prints (``--format json``): what any parser reads, a non-finite
number as null where ``json.dumps`` would write a bare ``NaN`` or ``Infinity``.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import secrets
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def replacing(path: str | os.PathLike, suffix: str = ".tmp") -> Iterator[str]:
    """Yield a temporary path to write; it becomes ``path`` when the block succeeds. ``suffix``
    keeps an extension that a writer reads the format from (``".png"`` for matplotlib)."""
    path = os.fspath(path)
    folder, name = os.path.split(os.path.abspath(path))
    while True:  # O_EXCL: the name is this call's alone; mode 0o666 lets the umask decide, as open() does
        tmp = os.path.join(folder, f".{name}.{secrets.token_hex(4)}{suffix}")
        try:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            break
        except FileExistsError:
            continue
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_text(path: str | os.PathLike, text: str, fsync: bool = False) -> None:
    with replacing(path) as tmp:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            if fsync:
                f.flush()
                os.fsync(f.fileno())


def strict_json(obj: Any, indent: int | None = 2, default: Any = None) -> str:
    """``obj`` as strict JSON: NaN and +/-Infinity (floats in dicts, lists and tuples) become null."""

    def finite(value: Any) -> Any:
        if isinstance(value, float):
            return value if math.isfinite(value) else None
        if isinstance(value, dict):
            return {k: finite(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [finite(v) for v in value]
        return value

    return json.dumps(finite(obj), indent=indent, allow_nan=False,
                      default=None if default is None else lambda o: finite(default(o)))


def write_json(path: str | os.PathLike, obj: Any, indent: int = 2, fsync: bool = False,
               default: Any = None) -> None:
    write_text(path, json.dumps(obj, indent=indent, default=default), fsync=fsync)


def fsync_dir(path: str | os.PathLike) -> None:
    """Flush a directory's entries (a rename into it, a new file) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
