"""Write a sharded safetensors checkpoint directory atomically.

Everything (shards, ``model.safetensors.index.json``, ``config.json``) is written into a hidden
sibling directory ``.<name>.tmp-<id>`` and renamed onto the destination only once complete and
fsynced, so a crash mid-save leaves no directory that looks like a finished checkpoint (only the
temporary one, which the next save of the same destination removes).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from collections.abc import Callable

from trex import atomic
from trex.checkpoint.errors import CheckpointError
from trex.checkpoint.safetensors_io import PlannedTensor, write_safetensors

_CHECKPOINT_MARKERS = ("config.json", "model.safetensors.index.json")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B)?\s*$", re.IGNORECASE)
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(size: int | str) -> int:
    """Bytes in "5GB" (decimal, like transformers), "512MiB" (binary) or a plain integer."""
    if isinstance(size, int):
        return size
    m = _SIZE.match(size)
    if not m:
        raise ValueError(f"max_shard_size {size!r}: expected e.g. 5GB, 500MB, 2GiB or a number of bytes")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "B").upper()])


def assign_shards(groups: list[list[PlannedTensor]], max_bytes: int) -> list[list[PlannedTensor]]:
    """Fill shards in order up to ``max_bytes``; a group (weight + scale) is never split, and a
    group larger than the limit gets a shard of its own."""
    shards: list[list[PlannedTensor]] = [[]]
    size = 0
    for group in groups:
        nbytes = sum(t.nbytes for t in group)
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].extend(group)
        size += nbytes
    return shards


def check_destination(path: str, overwrite: bool, sources: tuple[str | None, ...] = ()) -> None:
    """Raise CheckpointError unless writing ``path`` destroys nothing by accident: checked before any
    reading, converting or progress bar, and again by the writer.

    - ``path`` must not resolve (symlinks followed) to one of ``sources`` (what is being read: the
      checkpoint converted or exported, the one a model was loaded from), lie inside one, or hold one.
    - An existing non-empty ``path`` is replaced only with ``overwrite``, and only when it is a
      checkpoint directory (it has ``config.json`` or a safetensors index): ``--overwrite`` with a
      mistyped destination never removes a folder of other things.
    """
    dst = os.path.realpath(path)
    for src in sources:
        if src is None:
            continue
        real = os.path.realpath(src)
        if dst == real or os.path.commonpath([dst, real]) in (dst, real):
            how = "is" if dst == real else "lies inside" if os.path.commonpath([dst, real]) == real else "holds"
            raise CheckpointError(f"{os.path.abspath(path)}: the destination {how} the source {os.path.abspath(src)}; "
                                  "write to a new directory (the source is read while the copy is written)")
    if not os.path.lexists(path) or (os.path.isdir(path) and not os.listdir(path)):
        return
    if not overwrite:
        raise CheckpointError(f"{os.path.abspath(path)}: already exists; choose a new directory, or replace it "
                              "with --overwrite (overwrite=True from Python)")
    if not (os.path.isdir(path) and any(os.path.exists(os.path.join(path, f)) for f in _CHECKPOINT_MARKERS)):
        raise CheckpointError(f"{os.path.abspath(path)}: --overwrite replaces only a checkpoint directory (one with "
                              f"{' or '.join(_CHECKPOINT_MARKERS)}), and this is not one; choose a new directory")


def write_checkpoint(path: str, groups: list[list[PlannedTensor]], config: dict, max_shard_size: int | str = "5GB",
                     overwrite: bool = False, on_written: Callable[[PlannedTensor], None] | None = None,
                     metadata: dict[str, str] | None = None, sources: tuple[str | None, ...] = (),
                     copies: dict[str, str] | None = None) -> list[str]:
    """Write ``groups`` as ``model-0000i-of-0000n.safetensors`` + index + ``config.json`` into
    ``path`` atomically; returns the shard file names. ``sources``: directories being read, which
    ``path`` may not be, lie in or hold (`check_destination`). ``copies``: name in ``path`` -> a file or
    directory copied there as it is (the source checkpoint's tokenizer)."""
    path = os.path.abspath(path)
    check_destination(path, overwrite, sources)
    names = [t.name for g in groups for t in g]
    dup = sorted({n for n in names if names.count(n) > 1}) if len(set(names)) != len(names) else []
    if dup:
        raise CheckpointError(f"{path}: tensor name(s) planned twice: {dup[:5]}")
    parent, base = os.path.split(path)
    os.makedirs(parent, exist_ok=True)
    for stale in os.listdir(parent):  # temporaries of earlier saves that crashed
        if stale.startswith(f".{base}.tmp-"):
            shutil.rmtree(os.path.join(parent, stale), ignore_errors=True)
    tmp = os.path.join(parent, f".{base}.tmp-{uuid.uuid4().hex[:8]}")
    os.makedirs(tmp)
    try:
        shards = assign_shards(groups, parse_size(max_shard_size))
        files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        weight_map: dict[str, str] = {}
        for file, shard in zip(files, shards):
            write_safetensors(os.path.join(tmp, file), shard, metadata=metadata, on_written=on_written)
            weight_map.update({t.name: file for t in shard})
        total = sum(t.nbytes for shard in shards for t in shard)
        _write_json(os.path.join(tmp, "model.safetensors.index.json"),
                    {"metadata": {"total_size": total}, "weight_map": weight_map})
        _write_json(os.path.join(tmp, "config.json"), config)
        for name, source in (copies or {}).items():
            (shutil.copytree if os.path.isdir(source) else shutil.copy2)(source, os.path.join(tmp, name))
        atomic.fsync_dir(tmp)
        _publish(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return files


def _write_json(path: str, obj: dict) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def _publish(tmp: str, path: str) -> None:
    """Rename the finished ``tmp`` onto ``path``; an existing ``path`` is moved aside first and
    removed only after the new one is in place."""
    old = None
    if os.path.lexists(path):
        old = f"{tmp}.old"
        os.rename(path, old)
    os.rename(tmp, path)
    atomic.fsync_dir(os.path.dirname(path))
    if old is not None:
        shutil.rmtree(old, ignore_errors=True) if os.path.isdir(old) else os.remove(old)
