"""Cluster planning: will a full-parameter post-training run fit, how fast, on how many devices.

    from trex.plan import Layout, make_plan, search
    plan = make_plan(get_preset("deepseek-v4-pro"), Layout(dp_shard=512, ep=64), 4096, load_profiles()["h200-sxm"])
    plan.fits, plan.memory.total, plan.time.total, plan.mfu

See docs/planning.md. Command line: ``trex plan``. The names load on first use (trex.lazy).
"""

from trex.lazy import lazy_exports

__all__ = ["Layout", "ModelFacts", "Plan", "PlanError", "TimeAssumptions", "make_plan", "fewest_devices",
           "parse_layout", "search"]
__getattr__ = lazy_exports(__name__, {
    "Layout": "layout", "PlanError": "layout", "parse_layout": "layout", "ModelFacts": "model_facts",
    "Plan": "planner", "make_plan": "planner", "fewest_devices": "planner", "search": "planner",
    "TimeAssumptions": "timing"})
