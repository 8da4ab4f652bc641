"""Statistics of a tensor that do not depend on the layout holding it, so that two runs on two clusters,
in two layouts, can compare tensors they never exchange (trex.fidelity.record).

A tensor is seen as its N elements x_i by global flat (row-major) index i, whatever shards, ranks or
devices hold them. Per tensor, :data:`WIDTH` float64 values and one int64 (``BYTES_PER_TENSOR`` bytes):

* ``sumsq`` = sum x_i^2, ``sum`` = sum x_i, ``max_abs`` = max |x_i|: exact (up to float64 summation order).
* ``sketch`` [K]: a CountSketch, sketch[h(i)] += s(i) x_i, with bucket h(i) and sign s(i) from a 32-bit
  integer hash of (the tensor's name, i). It is linear and E <Sx, Sy> = <x, y>, so
  1 - cos(x, y) = |x/|x| - y/|y||^2 / 2 is estimated by |Sx/|x| - Sy/|y||^2 / 2 with a relative standard
  error of at most sqrt(2 / K) (K = 256: 8.8%). It detects a change of direction anywhere in the tensor
  (a block that departs, a sign or scale bug in one slice) but not which elements changed.
* ``samples`` [M]: x at M positions drawn by hash from [0, N) (the same positions on both sides): the
  max-abs error on them is a lower bound of the true max-abs error; it sees a departure that covers
  many elements, and misses one confined to a few unsampled elements (the sketch still sees those
  when they move the direction by more than its error).
* ``checksum``: sum over i of hash(i, the fp32 bits of x_i) mod 2^32. Equal tensors have equal
  checksums; unequal ones collide with probability 2^-32: the bitwise rungs judge by it.

Each rank computes the partial statistics of the pieces it holds, in chunks on the host (float64, any
device), with global indices from the DTensor's placement. A piece is counted once: by the rank whose
copy lies in the sub-mesh holding rank 0, at coordinate 0 of every replicated mesh dimension; plain
tensors (replicated on every rank, such as block outputs) by rank 0. One all-reduce of the table then
gives every rank the statistics of every tensor; no tensor leaves its rank.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

SKETCH = 256  # K, a power of two
SAMPLES = 64  # M
FIELDS = ("sumsq", "sum", "max_abs")
WIDTH = len(FIELDS) + SKETCH + SAMPLES  # float64 values per tensor
BYTES_PER_TENSOR = 8 * (WIDTH + 1)  # and the int64 checksum
CHUNK = 1 << 22  # elements hashed at once (bounded host memory: about 40 bytes an element)
_M32 = 0xFFFFFFFF
_TINY = 1e-30


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash of int64 ``x`` in [0, 2^32) (the constant keeps products below 2^59)."""
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & _M32
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & _M32
    return x ^ (x >> 16)


def _key(name: str, salt: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{salt}:{name}".encode(), digest_size=4).digest(), "little")


def _position_hash(name: str, index: torch.Tensor) -> torch.Tensor:
    """hash(name, i) in [0, 2^32) for int64 global indices ``index`` (any size below 2^63)."""
    lo, hi = index & _M32, index >> 32
    return _mix(_mix(lo ^ _key(name, "lo")) ^ _mix(hi + _key(name, "hi")))


def sample_positions(name: str, numel: int) -> list[int]:
    """The M sampled global indices of a tensor of ``numel`` elements (the same on every side)."""
    j = torch.arange(SAMPLES, dtype=torch.int64)
    high, low = _mix(j ^ _key(name, "s1")), _mix(j ^ _key(name, "s2"))
    return [((int(h) << 32) | int(l)) % numel for h, l in zip(high, low)]


@dataclass
class Piece:
    """What one rank holds of a tensor: ``local`` (any device, any dtype) at ``offset`` of a tensor of
    ``shape``; ``counted``: whether this rank's copy is the one the statistics count."""
    local: torch.Tensor
    shape: tuple[int, ...]
    offset: tuple[int, ...]
    counted: bool


def piece_of(t: torch.Tensor) -> Piece:
    """This rank's piece of ``t``: a DTensor's local shard, or the whole of a plain tensor."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        mesh = t.device_mesh
        if any(p.is_partial() for p in t.placements):
            raise ValueError("a DTensor with a partial placement has no local piece to describe; reduce it first")
        _, offset = compute_local_shape_and_global_offset(t.shape, mesh, t.placements)
        counted = 0 in mesh.mesh.flatten().tolist() and all(
            mesh.get_local_rank(d) == 0 for d, p in enumerate(t.placements) if p.is_replicate())
        return Piece(t.to_local(), tuple(t.shape), tuple(offset), counted)
    counted = not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
    return Piece(t, tuple(t.shape), (0,) * t.dim(), counted)


def partial_stats(name: str, piece: Piece) -> tuple[torch.Tensor, int]:
    """(float64 [WIDTH], checksum) of ``piece``'s elements; zeros when the piece is not counted here.
    Host memory: about 40 bytes per element of one CHUNK."""
    row = torch.zeros(WIDTH, dtype=torch.float64)
    if not piece.counted or piece.local.numel() == 0:
        return row, 0
    shape = piece.shape or (1,)
    local = piece.local.detach().reshape(piece.local.shape or (1,))
    offset = piece.offset or (0,)
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    numel = math.prod(shape)
    piece = Piece(local, shape, offset, piece.counted)
    sketch = row[len(FIELDS):len(FIELDS) + SKETCH]
    samples = row[len(FIELDS) + SKETCH:]
    sampled = []  # (j, the position in the piece) of the sampled elements this piece holds
    for j, p in enumerate(sample_positions(name, numel)):
        at = tuple((p // strides[d]) % shape[d] - offset[d] for d in range(len(shape)))
        if all(0 <= a < n for a, n in zip(at, local.shape)):
            sampled.append((j, at))
    checksum = 0
    for r0, chunk, index in _chunks(piece):
        chunk = chunk.float().cpu().contiguous()
        x = chunk.double().flatten()
        h = _position_hash(name, index.flatten())
        signs = 1.0 - 2.0 * ((h >> 16) & 1).double()
        sketch.index_add_(0, h & (SKETCH - 1), signs * x)
        row[0] += x.square().sum()
        row[1] += x.sum()
        row[2] = max(float(row[2]), float(x.abs().max()))
        bits = chunk.flatten().view(torch.int32).to(torch.int64) & _M32
        checksum = (checksum + int(_mix(bits ^ h).sum())) & _M32
        for j, at in sampled:
            if r0 <= at[0] < r0 + len(chunk):
                samples[j] = float(chunk[(at[0] - r0, *at[1:])])
    return row, checksum


def _chunks(piece: Piece):
    """(first row, rows of ``piece.local`` [r, ...], their global flat indices int64 [r, ...]) in chunks
    of about CHUNK elements."""
    shape = piece.shape or (1,)
    local = piece.local.reshape(piece.local.shape or (1,))
    offset = piece.offset or (0,)
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    rows_per_chunk = max(1, CHUNK // max(1, math.prod(local.shape[1:])))
    for r0 in range(0, local.shape[0], rows_per_chunk):
        chunk = local[r0:r0 + rows_per_chunk]
        index = torch.zeros(chunk.shape, dtype=torch.int64)
        for d, n in enumerate(chunk.shape):
            start = offset[d] + (r0 if d == 0 else 0)
            axis = torch.arange(start, start + n, dtype=torch.int64) * strides[d]
            index += axis.view([n if e == d else 1 for e in range(chunk.dim())])
        yield r0, chunk, index


SYNTHETIC_RANKS = 4  # rank-one terms of a synthetic gradient, each a quarter of the last, over a noise floor


def fill_synthetic(name: str, piece: Piece, rms: float) -> None:
    """Overwrite ``piece.local`` with its part of a pseudo-random gradient of about RMS ``rms``, the same
    in every layout and on every device (up to its dtype's rounding) without exchanging it. Element
    (row, col) of the tensor seen as [numel / last dim, last dim] is sum_k 4^-k r_k(row) c_k(col) +
    4^-SYNTHETIC_RANKS e(row, col), all uniform on [-1, 1] from hashes of (name, k, index): a spread
    spectrum like a real gradient's, so that an orthogonalising optimizer's iterations matter."""
    local = piece.local.view(piece.local.shape or (1,))
    cols = (piece.shape or (1,))[-1]
    weights = [4.0 ** -k for k in range(SYNTHETIC_RANKS + 1)]
    scale = rms / math.sqrt(sum(w * w for w in weights[:-1]) / 9 + weights[-1] ** 2 / 3)  # E z^2 -> rms^2

    def uniform(tag: str, index: torch.Tensor) -> torch.Tensor:
        return _position_hash(f"synthetic:{tag}:{name}", index).double() / float(_M32) * 2.0 - 1.0

    for r0, chunk, index in _chunks(piece):
        row, col = index // cols, index % cols
        z = weights[-1] * uniform("noise", index)
        for k in range(SYNTHETIC_RANKS):
            z += weights[k] * uniform(f"row{k}", row) * uniform(f"col{k}", col)
        local[r0:r0 + len(chunk)].copy_((z * scale).to(dtype=local.dtype, device=local.device))


@dataclass
class Stats:
    """The statistics of named tensors: ``table`` float64 [n, WIDTH] and ``checksums`` int64 [n]."""
    names: list[str]
    table: torch.Tensor
    checksums: torch.Tensor

    def index(self) -> dict[str, int]:
        return {n: i for i, n in enumerate(self.names)}

    def __contains__(self, name: str) -> bool:
        return name in self.index()

    def global_norm(self) -> float:
        return math.sqrt(float(self.table[:, 0].clamp(min=0).sum()))

    @property
    def nbytes(self) -> int:
        return len(self.names) * BYTES_PER_TENSOR


def stats_of(named: list[tuple[str, torch.Tensor | Piece]], device: torch.device | None = None) -> Stats:
    """The statistics of every ``(name, tensor or Piece)``, the same on every rank. Several processes:
    each contributes the pieces it counts, and one all-reduce (sum; max for max_abs) of the
    [n, WIDTH + 1] table, on ``device`` (the process group's), combines them. Every rank must call it
    with the same names in the same order."""
    names = [n for n, _ in named]
    table = torch.zeros(len(named), WIDTH, dtype=torch.float64)
    checksums = torch.zeros(len(named), dtype=torch.int64)
    for k, (name, t) in enumerate(named):
        table[k], checksums[k] = partial_stats(name, t if isinstance(t, Piece) else piece_of(t))
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        device = device or torch.device("cpu")
        summed, peak, sums = table.to(device), table[:, 2].contiguous().to(device), checksums.to(device)
        dist.all_reduce(summed)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        dist.all_reduce(sums)
        table, checksums = summed.cpu(), sums.cpu() & _M32
        table[:, 2] = peak.cpu()
    return Stats(names, table, checksums)


def agreement(run: Stats, ref: Stats, name: str) -> dict[str, float]:
    """trex.fidelity.ladder.agreement's measures for tensor ``name`` from statistics: cosine (estimated
    by the sketch; exactly 1 when the checksums match), max_abs and max_abs_rel over the sampled
    positions, and the exact norms."""
    a, b = run.table[run.index()[name]], ref.table[ref.index()[name]]
    na, nb = math.sqrt(max(float(a[0]), 0.0)), math.sqrt(max(float(b[0]), 0.0))
    if int(run.checksums[run.index()[name]]) == int(ref.checksums[ref.index()[name]]) and float(a[0]) == float(b[0]):
        return {"cosine": 1.0, "max_abs": 0.0, "max_abs_rel": 0.0, "norm": na, "ref_norm": nb}
    s = slice(len(FIELDS), len(FIELDS) + SKETCH)
    diff = a[s] / max(na, _TINY) - b[s] / max(nb, _TINY)
    cosine = 1.0 - float(diff.square().sum()) / 2
    sampled = slice(len(FIELDS) + SKETCH, WIDTH)
    max_abs = float((a[sampled] - b[sampled]).abs().max())
    return {"cosine": cosine, "max_abs": max_abs, "max_abs_rel": max_abs / max(float(b[2]), _TINY),
            "norm": na, "ref_norm": nb}
