"""Which part of each parameter a rank owns, for loading only that part.

A *shard function* maps (trex key, full shape) to the ``Region`` this rank holds. With a
``DeviceMesh`` and DTensor placements, ``local_region`` gives the region torch's ``Shard(d)``
placement assigns to this rank (``torch.chunk`` sizes: ceil(n / k) per rank, the last ones
shorter or empty); ``Replicate`` keeps the whole dim.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from trex.checkpoint.reader import Region, full_region

ShardFn = Callable[[str, tuple[int, ...]], Region]


def chunk_range(n: int, parts: int, index: int) -> tuple[int, int]:
    """[start, stop) of chunk ``index`` when n items are split like ``torch.chunk`` into ``parts``."""
    size = -(-n // parts)
    return min(index * size, n), min((index + 1) * size, n)


def local_region(shape: Sequence[int], mesh, placements: Sequence) -> Region:
    """Region of a tensor of ``shape`` that this rank of ``mesh`` holds under ``placements``
    (one per mesh dim; ``Shard(d)`` splits dim d, applied in mesh-dim order)."""
    from torch.distributed.tensor import Replicate, Shard

    region = list(full_region(shape))
    coordinate = mesh.get_coordinate()
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, Shard):
            a, b = region[placement.dim]
            lo, hi = chunk_range(b - a, mesh.size(mesh_dim), coordinate[mesh_dim])
            region[placement.dim] = (a + lo, a + hi)
        elif not isinstance(placement, Replicate):
            raise ValueError(f"placement {placement} is not supported for loading (use Shard or Replicate)")
    return tuple(region)


def default_placements(mesh, shape: Sequence[int]) -> list:
    """Shard(0) on every mesh dim for tensors with at least as many rows as ranks, else Replicate."""
    from torch.distributed.tensor import Replicate, Shard

    if shape and shape[0] >= mesh.size():
        return [Shard(0)] * mesh.ndim
    return [Replicate()] * mesh.ndim
