"""The DeepSeek-V3 family (V3, R1, V3.1, V3.2, Kimi-K2, Moonlight) as trex.models.registry sees it (the
interface: trex.models.common.architecture)."""

from __future__ import annotations

from trex.models.common.architecture import Architecture, mtp_drafter

_PKG = "trex.models.deepseek_v3"


V3 = Architecture(
    name="deepseek_v3",
    model=f"{_PKG}.model:DeepseekV3",
    decode_cache=f"{_PKG}.decode:V3DecodeCache",
    split_rule=f"{_PKG}.config",
    flops=f"{_PKG}.flops:flops_v3",
    plan_terms=f"{_PKG}.plan_terms",
    checkpoint_names=f"{_PKG}.checkpoint_names:V3_NAMES",
    drafter_kind=mtp_drafter,
    tp_plan=f"{_PKG}.tp_plan",
)
