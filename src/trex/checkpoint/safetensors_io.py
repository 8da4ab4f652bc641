"""Streaming safetensors reader and writer with bounded memory.

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON
(``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``) and the
tensor bytes, offsets relative to the end of the header.

``SafetensorsFile`` validates the whole header when opened (JSON, known dtypes, byte counts that
match the shapes, offsets inside the file, so a truncated file fails before any data is read)
and reads one tensor, or a range of its first dim, with plain ``readinto``: no memory map, so
resident memory stays at the tensors the caller holds. ``write_safetensors`` writes tensors one
at a time from producers, so a shard never has to be in memory at once.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from trex.checkpoint.errors import CheckpointError

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
_MAX_HEADER = 100 * 1024 * 1024


class SafetensorsError(CheckpointError):
    """A malformed or truncated safetensors file; the message names the file and tensor."""


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: dtype, shape and absolute byte range in the file."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


class SafetensorsFile:
    """Read-only view of one safetensors file; tensors are read on demand."""

    def __init__(self, path: str):
        self.path = path
        self.tensors: dict[str, TensorInfo] = {}
        self.metadata: dict[str, str] = {}
        try:
            size = os.path.getsize(path)
            with open(path, "rb") as f:
                head = f.read(8)
                if len(head) < 8:
                    raise SafetensorsError(f"{path}: truncated safetensors file ({size} bytes, no header)")
                (n,) = struct.unpack("<Q", head)
                if n > min(_MAX_HEADER, size - 8):
                    raise SafetensorsError(f"{path}: header length {n} exceeds the file size {size} "
                                           f"(truncated or not a safetensors file)")
                raw = f.read(n)
        except OSError as e:
            raise SafetensorsError(f"{path}: cannot read ({e})") from None
        try:
            header = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise SafetensorsError(f"{path}: header is not valid JSON ({e})") from None
        if not isinstance(header, dict):
            raise SafetensorsError(f"{path}: header is not a JSON object")
        self.metadata = header.pop("__metadata__", None) or {}
        start = 8 + n
        for name, entry in header.items():
            self.tensors[name] = self._parse_entry(name, entry, start, size)

    def _parse_entry(self, name: str, entry: dict, start: int, size: int) -> TensorInfo:
        where = f"{self.path}: tensor {name}"
        try:
            dtype_name, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise SafetensorsError(f"{where}: header entry lacks dtype/shape/data_offsets: {entry!r}") from None
        if dtype_name not in DTYPES:
            raise SafetensorsError(f"{where}: unsupported dtype {dtype_name!r}")
        dtype = DTYPES[dtype_name]
        numel = 1
        for d in shape:
            numel *= int(d)
        if end - begin != numel * dtype.itemsize or begin < 0:
            raise SafetensorsError(f"{where}: data_offsets [{begin}, {end}] hold {end - begin} bytes but shape "
                                   f"{list(shape)} of {dtype_name} needs {numel * dtype.itemsize}")
        if start + end > size:
            raise SafetensorsError(f"{where}: data ends at byte {start + end} but the file has only {size} bytes "
                                   f"(truncated file)")
        return TensorInfo(dtype, tuple(int(d) for d in shape), start + begin, start + end)

    def keys(self) -> list[str]:
        return list(self.tensors)

    def read(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """The tensor ``name`` (CPU), or only its first-dim range ``rows`` = (start, stop)."""
        info = self.tensors[name]
        begin, shape = info.begin, info.shape
        if rows is not None:
            row_bytes = info.nbytes // max(shape[0], 1)
            begin += rows[0] * row_bytes
            shape = (rows[1] - rows[0], *shape[1:])
        out = torch.empty(shape, dtype=info.dtype)
        buf = out.reshape(-1).view(torch.uint8).numpy() if out.numel() else None
        if buf is not None:
            with open(self.path, "rb") as f:
                f.seek(begin)
                got = f.readinto(buf)
            if got != buf.nbytes:
                raise SafetensorsError(f"{self.path}: tensor {name}: read {got} of {buf.nbytes} bytes "
                                       f"(file truncated while reading)")
        return out


@dataclass(frozen=True)
class PlannedTensor:
    """A tensor to write: its name, dtype, shape, and a function that produces it when its turn comes."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    produce: Callable[[], torch.Tensor]

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n


def write_safetensors(path: str, tensors: Iterable[PlannedTensor], metadata: dict[str, str] | None = None,
                      on_written: Callable[[PlannedTensor], None] | None = None) -> None:
    """Write ``tensors`` to ``path`` in order, producing and releasing one at a time, then fsync.

    Each produced tensor must have its planned dtype and shape (checked: a mismatch is a bug).
    """
    tensors = list(tensors)
    header: dict[str, object] = {"__metadata__": {"format": "pt", **(metadata or {})}}
    offset = 0
    for t in tensors:
        header[t.name] = {"dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape),
                          "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for t in tensors:
            value = t.produce()
            if value.dtype != t.dtype or tuple(value.shape) != t.shape:
                raise RuntimeError(f"{path}: {t.name}: produced {value.dtype} {tuple(value.shape)}, "
                                   f"planned {t.dtype} {t.shape}")
            value = value.detach().to("cpu").contiguous()
            if value.numel():
                f.write(memoryview(value.reshape(-1).view(torch.uint8).numpy()))
            del value
            if on_written is not None:
                on_written(t)
        f.flush()
        os.fsync(f.fileno())
