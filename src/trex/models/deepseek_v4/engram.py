"""Engram (DeepSeek-V4.1): n-gram hash lookups written into the residual streams before a few blocks.

The hashing is defined exactly by DeepSeek's ``inference/engram.py``; this module computes the same
ids from the same inputs:

- **Token map.** Every id of the checkpoint's tokenizer is decoded on its own and normalised (NFKC,
  NFD, accents stripped, lower case, runs of whitespace to one space, stripped, a token that is only
  whitespace kept as one space); ids whose text normalises alike share a compressed id, numbered in
  order of first appearance. A text with U+FFFD (a partial UTF-8 byte) is keyed by its raw token.
  The count must equal ``engram_compressed_vocab_size``: every multiplier depends on it.
- **Multipliers.** Per Engram layer L: ``numpy.random.default_rng(10007 * L).integers(0,
  (2^63 - 1) // V_c // 2, size=max_ngram)`` times 2 plus 1 (odd, and small enough that id x
  multiplier never overflows int64).
- **Hash.** Position t takes the compressed ids of tokens t, t-1, ..., t-(max_ngram-1); a slot before
  the start of the token's document, or at or past a masked (image) token, holds the pad token's id
  (blocking is cumulative). ``h = id_0 * mul_0``, then for n = 1 .. max_ngram-1: ``h ^= id_n * mul_n``
  and the (n+1)-gram's head j takes row ``h % prime[n][j] + offset[n][j]`` of the layer's table.
- **Primes.** Each (layer, n-gram, head) takes the next prime above the previous one, starting again
  from ``engram_vocab_size - 1`` for every n-gram, never reusing one (across layers too); offsets are
  the running sum, so the table has sum(primes) rows (V4.1-Flash: 384,006,168 and 384,016,682).

The lookup: the ``(max_ngram - 1) * n_heads`` rows [.., head_dim] are concatenated and ``wkv`` maps them
to one key per hc stream and one value shared by the streams; each stream's gate is
``sigmoid(signed_sqrt(<h * q_weight * k_weight, key> * rsqrt(mean h^2 + eps) * rsqrt(mean key^2 + eps)
/ sqrt(d)))`` and the stream becomes ``h + gate * value`` (fp32, cast back). No short convolution.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from trex.kernels import quantize
from trex.models.common.architecture import TokenMap
from trex.models.common.linear import QuantLinear, QuantSim
from trex.models.deepseek_v4.engram_layout import EngramLayout


def hash_multipliers(layer_ids: Sequence[int], max_ngram: int, compressed_vocab: int) -> torch.Tensor:
    """[layers, max_ngram] int64 odd multipliers (see the module docstring)."""
    bound = max(1, (np.iinfo(np.int64).max // compressed_vocab) // 2)
    rows = [np.random.default_rng(10007 * layer).integers(0, bound, size=(max_ngram,), dtype=np.int64) * 2 + 1
            for layer in layer_ids]
    return torch.from_numpy(np.stack(rows)) if rows else torch.zeros(0, max_ngram, dtype=torch.long, device="cpu")


def _normaliser():
    """The token map's normalisation, built from the tokenizers library as DeepSeek's code builds it."""
    from tokenizers import Regex, normalizers

    sentinel = "\ue000"  # keeps a token that is only whitespace as one space through Strip()
    return normalizers.Sequence([
        normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "), normalizers.Replace(Regex(r"^ $"), sentinel),
        normalizers.Strip(), normalizers.Replace(sentinel, " "),
    ])


def compressed_token_map(tokenizer) -> tuple[list[int], int]:
    """A ``tokenizers.Tokenizer`` (the checkpoint's tokenizer.json) -> (compressed id of every token id,
    the number of compressed ids). Ids run over the whole vocabulary, added tokens included."""
    normaliser = _normaliser()
    key_to_new: dict[str, int] = {}
    lookup = []
    for token_id in range(tokenizer.get_vocab_size(with_added_tokens=True)):
        text = tokenizer.decode([token_id], skip_special_tokens=False)
        if "\ufffd" in text:
            key = tokenizer.id_to_token(token_id)
        else:
            key = normaliser.normalize_str(text) or text
        lookup.append(key_to_new.setdefault(key, len(key_to_new)))
    return lookup, len(key_to_new)


def tokenizer_map(cfg, tokenizer) -> TokenMap | None:
    """``Architecture.tokenizer_map`` of DeepSeek-V4.1: ``compressed_token_map`` of ``tokenizer`` when ``cfg`` has
    Engram layers (which fixes ``engram_compressed_vocab_size``), else None."""
    if not cfg.engram_layer_ids:
        return None
    token_map, compressed = compressed_token_map(tokenizer)
    return TokenMap(token_map, compressed, {"engram_compressed_vocab_size": compressed})


def ngram_hashes(compressed: torch.Tensor, pos: torch.Tensor, live: torch.Tensor | None, pad_id: int,
                 multipliers: torch.Tensor, moduli: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Hash ids of the n-grams ending at every position.

    compressed: [B, S] compressed token ids; pos: [B, S] position within its document (look-back
    stops at the document's start); live: [B, S] bool or None, False for tokens no n-gram may span
    (image spans); multipliers [L, n_max], moduli and offsets [L, cols] int64 -> [B, S, L, cols] int64."""
    n_max = multipliers.shape[1]
    if live is not None:
        compressed = torch.where(live, compressed, -1)
    blocked = torch.zeros_like(compressed, dtype=torch.bool)
    tokens = []
    for shift in range(n_max):
        source = F.pad(compressed, (shift, 0), value=-1)[:, : compressed.shape[1]]
        blocked = blocked | (pos < shift) | (source < 0)
        tokens.append(torch.where(blocked, pad_id, source))
    products = torch.stack(tokens, dim=-1).unsqueeze(2) * multipliers  # [B, S, L, n_max]
    rolling, hashes = products[..., 0], []
    n_heads = moduli.shape[1] // (n_max - 1)
    for n in range(1, n_max):
        rolling = torch.bitwise_xor(rolling, products[..., n])
        hashes.append(rolling.unsqueeze(-1) % moduli[:, (n - 1) * n_heads:n * n_heads])
    return torch.cat(hashes, dim=-1) + offsets


class NgramHasher:
    """The hashing's constants for a model's Engram layers: derived from the config and the tokenizer, so
    neither parameters nor buffers (no checkpoint holds them and materialising a model from the meta
    device leaves them intact); kept on the CPU, with one copy per device they are used on.

    token_map: compressed id of every token id (identity until ``set_token_map``; ``ready`` says whether
    it is the real one); pad_id: the compressed id that fills look-back slots before a document's start
    (a Python int, read once when the map is set: the hashing reads nothing back from a tensor)."""

    def __init__(self, layout: EngramLayout, compressed_vocab: int, vocab_size: int, pad_token: int):
        self.compressed_vocab, self.pad_token = compressed_vocab, pad_token
        self.multipliers = hash_multipliers(layout.layer_ids, layout.max_ngram, compressed_vocab)
        self.moduli, self.offsets = layout.moduli(), layout.offsets()
        self.token_map = torch.arange(vocab_size, device="cpu")  # on the CPU even when the model is built on meta
        self.pad_id = pad_token
        self.ready = compressed_vocab == vocab_size  # the identity is the map only when nothing merges
        self._on: dict[torch.device, tuple[torch.Tensor, ...]] = {}

    def set_token_map(self, token_map: Sequence[int], compressed_vocab: int) -> None:
        if compressed_vocab != self.compressed_vocab:
            raise ValueError(f"the tokenizer compresses to {compressed_vocab} ids but the config's "
                             f"engram_compressed_vocab_size is {self.compressed_vocab}: Engram's hashes need the "
                             f"checkpoint's own tokenizer")
        table = torch.arange(max(len(self.token_map), len(token_map)), device="cpu")
        table[: len(token_map)] = torch.tensor(list(token_map), device="cpu")
        self.token_map, self.ready, self._on = table, True, {}
        self.pad_id = int(table[self.pad_token])

    def __call__(self, input_ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """input_ids, pos (within the document): [B, S] -> [B, S, layers, cols] table rows."""
        if not self.ready:
            raise ValueError("this V4.1 config's Engram hashes ids through its tokenizer's compressed token map "
                             "(engram_compressed_vocab_size differs from vocab_size): set it with "
                             "set_engram_token_map (a checkpoint's loader reads it from its tokenizer.json)")
        dev = input_ids.device
        if dev not in self._on:
            self._on[dev] = tuple(t.to(dev) for t in (self.token_map, self.multipliers, self.moduli, self.offsets))
        token_map, multipliers, moduli, offsets = self._on[dev]
        return ngram_hashes(token_map[input_ids], pos, None, self.pad_id, multipliers, moduli, offsets)


class Engram(nn.Module):
    """One layer's table [rows, head_dim], its ``wkv`` [(hc + 1) * d, cols * head_dim] and the gate's
    q_weight, k_weight [hc, d] (only their product is used). The released checkpoint stores the table in
    FP8 with a scale per row and ``block`` columns, and ``wkv`` in FP8 with ``block`` x ``block`` scales: with
    ``quant.linears`` the rows a forward looks up go through that rounding (a row's blocks are its own, so
    rounding the looked-up rows is rounding the table)."""

    quant = QuantSim()
    sharded_table = "embed"  # trex.parallel.engram splits this nn.Embedding's rows over every rank

    def __init__(self, rows: int, columns: int, head_dim: int, dim: int, hc: int, eps: float, block: int):
        super().__init__()
        self.dim, self.hc, self.eps, self.block = dim, hc, eps, block
        self.embed = nn.Embedding(rows, head_dim)
        self.wkv = QuantLinear(columns * head_dim, dim * (hc + 1), block=block)
        self.q_weight = nn.Parameter(torch.ones(hc, dim))
        self.k_weight = nn.Parameter(torch.ones(hc, dim))

    def optimizer_rules(self) -> dict[str, tuple[str, list[int]]]:
        """{parameter: (optimizer rule, row blocks)} (trex.train.optim.classify): the table row-wise, the gate's
        per-stream channel gains as gains."""
        return {"embed.weight": ("engram_table", []), "q_weight": ("gains_biases", []),
                "k_weight": ("gains_biases", [])}

    def forward(self, X: torch.Tensor, hash_ids: torch.Tensor, live: torch.Tensor | None = None) -> torch.Tensor:
        """X: [B, S, hc, d]; hash_ids: [B, S, cols]; live: [B, S] (False: the stream passes unchanged)
        -> [B, S, hc, d] in X's dtype."""
        rows = self.embed(hash_ids)
        if self.quant.linears:
            rows = quantize.fake_fp8_weight(rows, (1, self.block))
        rows = rows.flatten(-2).to(X.dtype)
        key, value = self.wkv(rows).split([self.hc * self.dim, self.dim], dim=-1)
        key = key.float().unflatten(-1, (self.hc, self.dim))
        h = X.float()
        rstd = torch.rsqrt(h.square().mean(-1) + self.eps) * torch.rsqrt(key.square().mean(-1) + self.eps)
        dot = (h * (self.q_weight.float() * self.k_weight.float()) * key).sum(-1) * rstd * self.dim**-0.5
        gate = torch.sigmoid(torch.copysign(dot.abs().clamp_min(1e-6).sqrt(), dot))
        if live is not None:
            gate = gate.masked_fill(~live.unsqueeze(-1), 0.0)
        return (h + gate.unsqueeze(-1) * value.float().unsqueeze(-2)).to(X.dtype)
