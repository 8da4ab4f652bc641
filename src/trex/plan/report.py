"""Plans as text tables or JSON."""

from __future__ import annotations

import dataclasses

from trex.logs import plural
from trex.plan.planner import GiB, Plan


def no_fit_reasons(plan: Plan) -> list[str]:
    """Why a plan does not fit, each with its numbers; empty when it fits."""
    m, out = plan.memory, []
    if m.total > plan.usable_bytes:
        out.append(f"needs {m.total / GiB:.1f} GiB per device (weights {m.weights / GiB:.1f}, optimizer state "
                   f"{m.optimizer / GiB:.1f}, step peak {m.step_peak / GiB:.1f}), {plan.usable_bytes / GiB:.1f} usable")
    if plan.host_fits is False:
        per_device = plan.hardware.host_memory_gib / plan.hardware.devices_per_node
        out.append(f"offloaded optimizer state {m.optimizer_host / GiB:.1f} GiB per device, host memory "
                   f"{per_device:.1f} GiB per device")
    return out


def plan_dict(plan: Plan, model: str) -> dict:
    """The plan as JSON; ``model`` is what it was asked for (a preset name or a config path)."""
    f = plan.facts
    return {
        "model": model,
        "layout": {**dataclasses.asdict(plan.layout), "devices": plan.layout.devices,
                   "describe": plan.layout.describe()},
        "seq_len": plan.seq_len,
        "global_batch_tokens": plan.global_batch_tokens,
        "hardware": {"name": plan.hardware.name, "unit": plan.hardware.unit, "device_type": plan.hardware.device_type,
                     "match": plan.hardware.match,
                     "memory_gib": plan.hardware.memory_gib, "source": plan.hardware.source},
        # total: the main model (DeepSeek's published figure; by_type splits it), total_with_mtp: every parameter
        "parameters": {"total": f.total, "total_with_mtp": f.total + f.mtp, "active": f.active, "mtp": f.mtp,
                       "trainable": f.trainable,
                       "muon": f.muon, "adamw": f.adamw, "by_type": f.by_type,
                       "engram_tables": f.engram_tables, "engram_rows": f.engram_rows},
        "memory_bytes": plan.memory.as_dict(),
        "usable_bytes": plan.usable_bytes,
        "fits": plan.fits,
        "reasons": no_fit_reasons(plan),
        "time_s": plan.time.as_dict(),
        "flops_per_token": plan.flops_per_token,
        "tokens_per_s_per_device": plan.tokens_per_s_per_device,
        "mfu": plan.mfu,
        "assumptions": dataclasses.asdict(plan.assumptions),
        "notes": plan.notes,
        **({"drafter": plan.drafter.as_dict()} if plan.drafter is not None else {}),
    }


def _gib(x: float) -> str:
    return f"{x / GiB:8.1f} GiB"


def plan_table(plan: Plan, model: str) -> str:
    f, m, t, hw = plan.facts, plan.memory, plan.time, plan.hardware
    lines = [
        f"model       {model}",
        f"layout      {plan.layout.describe()}  ({plan.layout.devices} x {hw.name}, one {hw.unit} each)",
        f"batch       {plan.global_batch_tokens:,} tokens per step, sequences of {plan.seq_len}",
        f"parameters  {(f.total + f.mtp) / 1e9:.1f}B total = {f.total / 1e9:.1f}B main model ({f.active / 1e9:.1f}B "
        f"active per token) + {f.mtp / 1e9:.1f}B MTP; {f.trainable / 1e9:.1f}B of them trained ({f.muon / 1e9:.1f}B "
        f"Muon, {f.adamw / 1e9:.2f}B AdamW)",
        "            " + ", ".join(f"{k} {v / 1e9:.2f}B" for k, v in f.by_type.items() if v),
    ]
    if f.engram_tables:
        mode = "trained (row-wise AdaGrad)" if plan.layout.train_engram else "frozen"
        lines.append(f"            Engram tables {f.engram_rows:,} rows, {f.engram_tables / 1e9:.2f}B: {mode}, split by "
                     f"rows over all {plural(plan.layout.devices, 'device')} (counted apart from the trained)")
    if f.indexer:
        mode = ("trained (its KL to the main attention, the sparse stage; whole on every TP rank)"
                if plan.layout.train_indexer else "frozen (train.indexer_loss > 0 trains it)")
        lines.append(f"            lightning indexer {f.indexer / 1e9:.2f}B: {mode}")
    lines.append("memory per device")
    for key, value in m.as_dict().items():
        if key not in ("total", "optimizer_host", "step_peak"):
            lines.append(f"  {key:20s}{_gib(value)}")
    lines.append(f"  {'step peak':20s}{_gib(m.step_peak)}   the larger of backward ({_gib(m.backward_peak).strip()}: "
                 f"activations, gathered, transient, accumulated, backward_gradients) and optimizer ({_gib(m.optimizer_peak).strip()}: "
                 "gradients, workspace)")
    lines.append(f"  {'total':20s}{_gib(m.total)}   weights + optimizer + step peak, of {_gib(plan.usable_bytes).strip()} usable "
                 f"({hw.memory_gib:g} GiB less headroom): {'FITS' if plan.fits else 'DOES NOT FIT'}")
    if m.optimizer_host:
        lines.append(f"  {'in host memory':20s}{_gib(m.optimizer_host)}")
    lines.append("time per step")
    for key, value in t.as_dict().items():
        lines.append(f"  {key:20s}{value:10.2f} s")
    lines.append(f"throughput  {plan.tokens_per_s_per_device:,.0f} tokens/s per device, MFU {plan.mfu:.1%} "
                 f"({plan.flops_per_token / 1e9:.1f} GFLOP/token, {hw.peak_tflops[plan.assumptions.dtype]:g} "
                 f"TFLOP/s {plan.assumptions.dtype} per {hw.unit})")
    a = plan.assumptions
    lines.append(f"assumptions compute efficiency {a.compute_efficiency:.0%}, FSDP overlap {a.fsdp_overlap:.0%}, "
                 f"EP overlap {a.ep_overlap:.0%}, CP overlap {a.cp_overlap:.0%}, "
                 f"{f'TP overlap {a.tp_overlap:.0%}, ' if plan.layout.tp > 1 else ''}links {hw.intra_node_gbps:g}/{hw.inter_node_gbps:g} GB/s "
                 f"intra/inter node, {hw.devices_per_node} per node")
    if plan.drafter is not None:
        lines += _drafter_lines(plan)
    lines += [f"does not fit: {r}" for r in no_fit_reasons(plan)]
    lines += [f"note        {n}" for n in plan.notes]
    return "\n".join(lines)


def _drafter_lines(plan: Plan) -> list[str]:
    """The [drafter] re-fit: its memory per device during a phase and its time per step (trex.plan.drafter)."""
    d, usable = plan.drafter, plan.usable_bytes
    m, t = d.memory, d.time_s
    fits = "FITS" if m["total"] <= usable else "DOES NOT FIT"
    what = "the MTP modules" if d.kind == "mtp" else "the DSpark stages"
    lines = [f"drafter re-fit  {plural(d.phases, 'phase')} of {plural(d.steps, 'step')}; {what} {d.parameters / 1e9:.2f}B "
             f"({d.active / 1e9:.2f}B active), {d.tokens_per_device:,} drafted tokens per step per device",
             "  memory per device during a phase"]
    for key in ("main", "weights", "gradients", "optimizer", "gathered", "continuation", "activations"):
        lines.append(f"    {key:18s}{_gib(m[key])}")
    lines.append(f"    {'total':18s}{_gib(m['total'])}   of {_gib(usable).strip()} usable: {fits}")
    lines.append(f"  time per step   {t['total']:.3f} s (target continuation {t['target']:.3f}, drafter {t['drafter']:.3f}, "
                 f"FSDP {t['fsdp_comm']:.3f}); a phase {d.phase_s:.1f} s = {d.phase_s / plan.time.total:.1f} main steps")
    return lines


def search_table(plans: list[Plan], top: int) -> str:
    head = "| rank | layout | memory GiB | step s | tokens/s/device | MFU |"
    rows = [head, "|---|---|---|---|---|---|"]
    for i, p in enumerate(plans[:top], 1):
        rows.append(f"| {i} | {p.layout.describe()} | {p.memory.total / GiB:.1f} | {p.time.total:.2f} | "
                    f"{p.tokens_per_s_per_device:,.0f} | {p.mfu:.1%} |")
    return "\n".join(rows)
