"""Exact parameter counts from the model itself (built on the meta device for full sizes), with the family's
correction (``Architecture.params``) for what the model alone does not say."""

from __future__ import annotations

from trex.models.common.params import ParamCount
from trex.models.registry import AnyConfig, architecture


def count_parameters(cfg: AnyConfig) -> ParamCount:
    """Counted on the model built on the meta device (no memory): inactive = the routed experts a token
    skips in each MoE layer of the main model (E - k of each layer's E; V3's dense first layers have
    none); then the family's correction (V4.1: Engram rows not read, the DSpark stages)."""
    from trex.models.build import build_model
    from trex.models.common.moe import Experts

    model = build_model(cfg, device="meta")
    total = mtp = 0
    for name, p in model.named_parameters():
        if name.startswith("mtp."):
            mtp += p.numel()
        else:
            total += p.numel()
    inactive = 0
    for name, module in model.named_modules():
        if isinstance(module, Experts) and not name.startswith("mtp."):
            n = module.w1.shape[0]
            per_expert = sum(w.numel() for w in (module.w1, module.w2, module.w3)) // n
            inactive += (n - cfg.num_experts_per_tok) * per_expert
    counted = ParamCount(total=total, active=total - inactive, mtp=mtp)
    correct = architecture(cfg).load("params")
    return correct(cfg, model, counted) if correct else counted
