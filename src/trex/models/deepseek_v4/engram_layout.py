"""Engram's hash tables' layout (DeepSeek-V4.1): the primes each (layer, n-gram, head) takes modulo, and
where each range starts in its layer's table (the rule: trex.models.deepseek_v4.engram's docstring, **Primes**).

Arithmetic only, without torch, so that V41Config validates its table sizes (``engram_num_embeddings``)
without importing the model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

_WITNESSES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)  # deterministic for n < 3.3e24


def is_prime(n: int) -> bool:
    """Miller-Rabin with the first twelve primes as witnesses: exact for every n below 3.3 * 10^24."""
    if n < 2:
        return False
    for p in _WITNESSES:
        if n % p == 0:
            return n == p
    d, r = n - 1, 0
    while d % 2 == 0:
        d, r = d // 2, r + 1
    for a in _WITNESSES:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


@dataclass(frozen=True)
class EngramLayout:
    """The hash tables' bucket layout. primes[l][n][j]: the modulus of layer l's (n+2)-gram head j;
    offsets: the same shape, where each range starts in the layer's table; rows[l] = sum(primes[l])."""

    layer_ids: tuple[int, ...]
    max_ngram: int
    n_heads: int
    primes: tuple[tuple[tuple[int, ...], ...], ...]

    @classmethod
    def build(cls, layer_ids: Sequence[int], max_ngram: int, n_heads: int, vocab_size: int) -> "EngramLayout":
        seen: set[int] = set()
        primes = []
        for _ in layer_ids:
            per_ngram = []
            for _ in range(max_ngram - 1):
                sizes, current = [], vocab_size - 1
                for _ in range(n_heads):
                    current += 1
                    while current in seen or not is_prime(current):
                        current += 1
                    seen.add(current)
                    sizes.append(current)
                per_ngram.append(tuple(sizes))
            primes.append(tuple(per_ngram))
        return cls(tuple(layer_ids), max_ngram, n_heads, tuple(primes))

    @property
    def rows(self) -> tuple[int, ...]:
        return tuple(sum(sum(per_ngram) for per_ngram in layer) for layer in self.primes)

    @property
    def columns(self) -> int:
        """Hash ids (table rows read) per position and layer."""
        return (self.max_ngram - 1) * self.n_heads

    def moduli(self) -> torch.Tensor:
        """[layers, columns] int64: each column's prime."""
        import torch  # the layout itself is arithmetic: a config validates it without torch

        return torch.tensor([[p for per_ngram in layer for p in per_ngram] for layer in self.primes], dtype=torch.long,
                            device="cpu")

    def offsets(self) -> torch.Tensor:
        """[layers, columns] int64: where each column's range starts in its layer's table."""
        m = self.moduli()
        return m.cumsum(dim=1) - m
