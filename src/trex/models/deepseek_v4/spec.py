"""DeepSeek-V4 and DeepSeek-V4.1 as trex.models.registry sees them (the interface:
trex.models.common.architecture)."""

from __future__ import annotations

from trex.models.common.architecture import Architecture, mtp_drafter
from trex.models.deepseek_v4.config_v41 import PASSTHROUGH

_PKG = "trex.models.deepseek_v4"


def _dspark_drafter(cfg) -> str | None:
    return "dspark" if cfg.num_nextn_predict_layers and cfg.dspark_target_layer_ids else None


V4 = Architecture(
    name="deepseek_v4",
    model=f"{_PKG}.model:DeepseekV4",
    decode_cache=f"{_PKG}.decode:DecodeCache",
    split_rule=f"{_PKG}.config",
    flops=f"{_PKG}.flops:flops_v4",
    plan_terms=f"{_PKG}.plan_terms",
    checkpoint_names=f"{_PKG}.checkpoint_names:V4_NAMES",
    drafter_kind=mtp_drafter,
    tp_plan=f"{_PKG}.tp_plan",
    official_config=f"{_PKG}.config:official_config",
)

V41 = Architecture(
    name="deepseek_v41",
    model=f"{_PKG}.model_v41:DeepseekV41",
    decode_cache=f"{_PKG}.decode_v41:V41DecodeCache",
    split_rule=f"{_PKG}.config",
    flops=f"{_PKG}.flops:flops_v41",
    plan_terms=f"{_PKG}.plan_terms",
    checkpoint_names=f"{_PKG}.checkpoint_names:V41_NAMES",
    drafter_kind=_dspark_drafter,
    passthrough=PASSTHROUGH,
    tokenizer_map=f"{_PKG}.engram:tokenizer_map",
    drafter=f"{_PKG}.dspark:DSparkDrafter",
    params=f"{_PKG}.params_v41:v41_params",
    tp_plan=f"{_PKG}.tp_plan_v41",
)
