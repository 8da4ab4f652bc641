"""Cluster planning: will a full-parameter post-training run fit, how fast, on how many devices.

    from trex.plan import Layout, make_plan, search, model_facts
    plan = make_plan(get_preset("deepseek-v4-pro"), Layout(dp_shard=512, ep=64), 4096, load_profiles()["h200-sxm"])
    plan.fits, plan.memory.total, plan.time.total, plan.mfu

See docs/planning.md. Command line: ``trex plan``.
"""

from trex.plan.layout import Layout, PlanError, parse_layout
from trex.plan.model_facts import ModelFacts, model_facts
from trex.plan.planner import Plan, make_plan, fewest_devices, search
from trex.plan.timing import TimeAssumptions

__all__ = ["Layout", "ModelFacts", "Plan", "PlanError", "TimeAssumptions", "make_plan", "fewest_devices",
           "model_facts", "parse_layout", "search"]
