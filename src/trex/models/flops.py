"""Model FLOPs per token of any architecture, the numerator of MFU (docs/mfu.md): each family counts its own
(``Architecture.flops``: trex.models.deepseek_v4.flops, trex.models.deepseek_v3.flops; the conventions and the
record, trex.models.common.flops)."""

from __future__ import annotations

from trex.models.common.flops import FlopsPerToken
from trex.models.registry import AnyConfig, architecture


def flops_per_token(cfg: AnyConfig, seq_len: int, training: bool = True, with_mtp: bool = True) -> FlopsPerToken:
    """Model FLOPs per token for sequences (or packed documents) of ``seq_len`` tokens: training counts each
    trained matmul three times (forward, input gradient, weight gradient); ``with_mtp`` adds the MTP modules."""
    return architecture(cfg).load("flops")(cfg, seq_len, training, with_mtp)
