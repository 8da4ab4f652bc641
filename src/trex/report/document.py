"""The portability report as a list of blocks, rendered to Markdown and to one self-contained HTML
page (trex.report.html). Sections, each from its own input files:

    Summary      one paragraph per target cluster: what moving there costs (the plan's fit, step
                 time and MFU; the audit's work before the code leaves CUDA; the fidelity verdicts)
    Audit        lock-in by category and effort, the files that dominate the effort
    Environments the doctor of each cluster the team ran on: device, versions, precision, collectives
    Fidelity     matrix, ladder, seam and compare verdicts with their plots
    Plans        memory per device, fit, step time, tokens/s and MFU per target cluster

Every table and paragraph ends with the file its numbers come from.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field

from trex.device import identity
from trex.logs import plural

GiB = 2 ** 30
EFFORT_WEIGHT = {"mechanical": 1, "moderate": 5, "rewrite": 20}  # as trex audit ranks files


@dataclass
class Block:
    kind: str
    """h1, h2, h3, p, table, img, source."""
    text: str = ""
    header: list[str] = field(default_factory=list)
    rows: list[list[str]] = field(default_factory=list)
    path: str = ""
    """img: the PNG; source: the input file."""


def _num(x, digits: int = 3) -> str:
    """As people read numbers: 1,500 and 26.9 and 0.0123, not 1.5e+03; 2.00e-06 below a thousandth."""
    if x is None:
        return "-"
    if isinstance(x, str):
        return x
    if abs(x) >= 10 ** digits:
        return f"{x:,.0f}"
    if x == 0 or abs(x) >= 1e-3:
        return f"{x:.{digits}g}"
    return f"{x:.2e}"


def _seconds(x: float) -> str:
    """A duration as people read it: 8.23 s, 12.5 ms, 18.3 µs."""
    for scale, unit in ((1, "s"), (1e-3, "ms"), (1e-6, "µs")):
        if x >= scale:
            return f"{x / scale:.3g} {unit}"
    return f"{x / 1e-9:.3g} ns"


# ---- sections --------------------------------------------------------------------------------------
def audit_effort(audit: dict) -> dict:
    """Counts by severity, effort and category of the findings that are not info, and their weight."""
    blocking = [f for f in audit["findings"] if f["severity"] != "info"]
    return {"errors": sum(f["severity"] == "error" for f in blocking),
            "warnings": sum(f["severity"] == "warning" for f in blocking),
            "effort": Counter(f["effort"] for f in blocking),
            "weight": sum(EFFORT_WEIGHT.get(f["effort"], 0) for f in blocking),
            "categories": Counter(f["category"] for f in blocking)}


def audit_section(audit: dict) -> list[Block]:
    s, effort = audit["summary"], audit_effort(audit)
    categories = sorted({f["category"] for f in audit["findings"]})
    rows = []
    for category in categories:
        found = [f for f in audit["findings"] if f["category"] == category]
        sev = Counter(f["severity"] for f in found)
        eff = Counter(f["effort"] for f in found if f["severity"] != "info")
        rows.append([category, str(sev["error"]), str(sev["warning"]), str(sev["info"]),
                     *(str(eff[e]) for e in EFFORT_WEIGHT)])
    files = Counter()
    for f in audit["findings"]:
        if f["severity"] != "info":
            files[f["path"]] += EFFORT_WEIGHT.get(f["effort"], 0)
    blocks = [Block("h2", "Portability audit"),
              Block("p", f"{plural(s['findings'], 'finding')} in {plural(s['files_scanned'], 'file')} ("
                         f"{plural(s['errors'], 'error')}, {plural(s['warnings'], 'warning')}, {s['info']} info; "
                         f"{s['suppressed']} suppressed, "
                         f"{s['allowlisted']} allowlisted). Effort of the error and warning findings: "
                         f"{effort['weight']} points (mechanical 1, moderate 5, rewrite 20 each).")]
    if rows:
        blocks.append(Block("table", header=["category", "error", "warning", "info", *EFFORT_WEIGHT], rows=rows))
    if files:
        blocks.append(Block("table", header=["file", "effort points"],
                            rows=[[f"`{p}`", str(w)] for p, w in files.most_common(8)]))
    return [*blocks, Block("source", path=audit["source"])]


def doctor_section(doctors: list[dict]) -> list[Block]:
    rows = []
    for d in doctors:
        env, prec, coll = d["environment"], d["precision"], d["distributed"]
        fast = [n for n, p in prec.items() if p.get("supported") and p.get("fast")]
        collectives = coll.get("skipped") and "not tested (one process)" or (
            f"{coll.get('backend')} x {coll.get('world_size')}: " + ("correct" if coll.get("ok") else "FAILED"))
        rows.append([d["label"], f"{env.get('device_name', env['device_type'])} ({env['device_type']} x "
                                 f"{env.get('device_count')})", env.get("torch", "-"), env.get("backend", "-"),
                     ", ".join(fast) or "none", collectives, "ok" if d.get("ok") else "NOT OK", f"`{d['source']}`"])
    return [Block("h2", "Environments"),
            Block("p", "`trex doctor` on each cluster: the device, the software, which low precisions are "
                       "supported and fast (measured matmuls), and whether collectives are correct."),
            Block("table", header=["cluster", "device", "torch", "backend", "fast precisions", "collectives", "doctor",
                                   "source"], rows=rows)]


def _plot(png: str, result: dict, sub: str) -> str:
    """A plot a result names: the one beside the result (``sub`` of its folder) when there is one, so
    a copied result shows its own copy; else the path as written."""
    beside = os.path.join(result["dir"], sub, os.path.basename(png))
    return beside if os.path.isfile(beside) else png


def _verdict_rows(result: dict) -> tuple[list[str], list[list[str]], list[str]]:
    """(header, rows, plots) of one fidelity result."""
    data, kind = result["data"], result["kind"]
    if kind == "matrix":
        rows = [[v["variant"], v["profile"], v["verdict"], _num(v.get("loss_mean_rel_err")),
                 _num(v.get("layer_grad_norm_rel_err")), _num(v.get("probe_kl")), v.get("note", "")]
                for v in data["variants"]]
        plots = [_plot(v["plot"], result, "reports") for v in data["variants"] if v.get("plot")]
        return ["variant", "profile", "verdict", "loss mean rel err", "worst layer grad err", "probe KL", "note"], \
            rows, plots
    if kind == "ladder":
        rows = [[f"{r['number']} {r['name']}", r["status"], _departure(r)] for r in data["rungs"]]
        return ["rung", "status", "departs at"], rows, [os.path.join(result["dir"], "ladder.png")]
    if kind == "seams":
        rows = [[str(s["step"]), s["move"], s["profile"], s["verdict"], ", ".join(s["failed"]) or "-"] for s in data]
        return ["step", "move", "profile", "verdict", "failed"], rows, [_plot(s["plot"], result, "fidelity")
                                                                        for s in data if s.get("plot")]
    rows = [[c["measure"], _num(c["value"]), _num(c["threshold"]), c["status"]] for c in data["checks"]
            if c["status"] not in ("off", "n/a")]
    png = os.path.splitext(result["source"])[0] + ".png"
    return ["measure", "value", "threshold", "status"], rows, [png]


def _departure(rung: dict) -> str:
    d = rung.get("departure") or {}
    return d.get("block") or d.get("parameter") or ", ".join(d.get("failed", [])) or ""


def fidelity_said(result: dict) -> str:
    """What a fidelity result compared, and its verdict, in a few words."""
    data, kind = result["data"], result["kind"]
    if kind == "ladder":
        what = f"ladder {' '.join(data['variant_overrides']) or '(an edited model)'} ({data['profile']})"
    elif kind == "matrix":
        what = f"matrix of {len(data['variants'])} variants on {data['environment'].get('device', '?')}"
    elif kind == "seams":
        what = "; ".join(f"seam of {s['move']} ({s['profile']})" for s in data)
    else:
        what = f"compare ({data['profile']['name']})"
    return f"{what}: {fidelity_verdict(result)}"


def fidelity_verdict(result: dict) -> str:
    data, kind = result["data"], result["kind"]
    if kind == "seams":
        return "PASS" if all(s["verdict"] == "PASS" for s in data) else "FAIL"
    return data["verdict"]


def fidelity_section(results: list[dict]) -> list[Block]:
    blocks = [Block("h2", "Convergence fidelity")]
    titles = {"matrix": "Fidelity matrix", "ladder": "Fidelity ladder", "seams": "Seams of a run that moved",
              "compare": "Comparison"}
    for result in results:
        header, rows, plots = _verdict_rows(result)
        where = ", ".join(measured_on(result)) or "a device the result does not state"
        blocks += [Block("h3", f"{titles[result['kind']]} on {where}: {fidelity_verdict(result)}"),
                   Block("table", header=header, rows=rows)]
        blocks += [Block("img", path=p) for p in plots if os.path.isfile(p)]
        blocks.append(Block("source", path=result["source"]))
    return blocks


def plan_row(plan: dict) -> list[str]:
    hw, m, t = plan["hardware"], plan["memory_bytes"], plan["time_s"]
    return [plan["model"], f"{plan['layout']['devices']} x {hw['name']}", f"{plan['seq_len']:,}",
            f"{plan['global_batch_tokens']:,}", plan["layout"]["describe"], "yes" if plan["fits"] else "NO",
            f"{m['total'] / GiB:.1f} / {plan['usable_bytes'] / GiB:.1f}", _seconds(t["total"]),
            _num(plan["tokens_per_s_per_device"]), f"{100 * plan['mfu']:.1f}%", f"`{plan['source']}`"]


def plan_section(plans: list[dict]) -> list[Block]:
    return [Block("h2", "Plans"),
            Block("p", "`trex plan` per target cluster: memory per device (weights, optimizer state and the step's "
                       "peak) against what is usable, step time, throughput and MFU, from the hardware profile and "
                       "the model's FLOPs."),
            Block("table", header=["model", "cluster", "sequence", "tokens/step", "layout", "fits",
                                   "memory / usable GiB", "step time", "tokens/s/device", "MFU", "source"],
                  rows=[plan_row(p) for p in plans]), *drafter_blocks(plans)]


def drafter_blocks(plans: list[dict]) -> list[Block]:
    """The plans of recipes with ``[drafter]``: the drafter's re-fit, per target cluster."""
    refits = [p for p in plans if p.get("drafter")]
    if not refits:
        return []
    rows = []
    for p in refits:
        d = p["drafter"]
        rows.append([p["model"], f"{p['layout']['devices']} x {p['hardware']['name']}",
                     f"{d['phases']} x {d['steps']}", f"{d['memory']['total'] / GiB:.1f} / {p['usable_bytes'] / GiB:.1f}",
                     _seconds(d["time_s"]["total"]), f"{d['phase_s'] / p['time_s']['total']:.1f}"])
    return [Block("p", "The drafter's re-fit (`[drafter]`): memory per device during a phase, time per "
                       "re-fit step, and a phase's length in main steps."),
            Block("table", header=["model", "cluster", "phases x steps", "memory / usable GiB", "re-fit step",
                                   "phase / main step"], rows=rows)]


def _accepted(acceptance: dict, key: str) -> str:
    """One acceptance's mean accepted tokens, or "n/a" and why it was not measured (summary.json's ``reason``)."""
    value = acceptance.get(key, {}).get("mean_accepted")
    if value is not None:
        return f"{value:.2f}"
    reason = acceptance.get(key, {}).get("reason")
    return f"n/a ({reason})" if reason else "n/a"


def refit_section(runs: list[dict]) -> list[Block]:
    """Runs whose ``[drafter]`` re-fitted the drafter: accepted drafted tokens per model step on the held-out
    prompts, (a) the base model with its drafter, (b) the post-trained one with it, (c) re-fitted; (c) - (a)."""
    rows = []
    for r in runs:
        a = r["acceptance"]
        gain = r.get("refit_vs_base")
        rows.append([r["run"], r.get("kind") or "dspark", r["mode"], _accepted(a, "base"), _accepted(a, "post_trained_old"),
                     _accepted(a, "refit"), "n/a" if gain is None else f"{gain:+.2f}",
                     f"{r['steps']} in {_seconds(r['time_s'])} ({r['time_s'] / max(r['main_time_s'], 1e-9):.2f} x the main "
                     f"steps')", f"{r['peak_memory_bytes'] / GiB:.2f}"])
    return [Block("h2", "Drafter re-fit"),
            Block("p", "Speculative decoding after post-training (`[drafter]`): accepted drafted tokens per model step "
                       "on the run's held-out prompts, as `trex fidelity drafter` measures them: (a) the starting model "
                       "with its drafter, (b) the post-trained model with that drafter, (c) with the re-fit one."),
            Block("table", header=["run", "drafter", "mode", "(a) base", "(b) post-trained", "(c) re-fit", "(c) - (a)",
                                   "re-fit steps, time", "re-fit peak GiB"], rows=rows)]


def measured_on(result: dict) -> list[str]:
    """Where a fidelity result was measured: device names (or types, for a CPU) of its runs, in order."""
    data, kind = result["data"], result["kind"]
    if kind == "matrix":
        found = [identity(data.get("environment", {}))]
    elif kind == "seams":
        found = [d for s in data for d in s.get("devices", {}).values()]
    else:
        found = list(data.get("devices", {}).values())
    labels = [d.get("device_name") or d.get("device_type") for d in found]
    return list(dict.fromkeys(x for x in labels if x))


def evidence_for(hardware: dict, fidelity: list[dict]) -> str:
    """The fidelity sentence of one target: the results measured on its hardware, or that there are none."""
    match = [m.lower() for m in hardware.get("match", [])]
    here = [r for r in fidelity if any(m in label.lower() for label in measured_on(r) for m in match)]
    if here:
        return f"Fidelity evidence from {hardware['name']}: {'; '.join(fidelity_said(r) for r in here)}."
    elsewhere = [f"{fidelity_said(r)} (on {', '.join(measured_on(r)) or 'a device the result does not state'})"
                 for r in fidelity]
    return (f"No fidelity evidence from {hardware['name']} yet" +
            (f"; what there is was measured elsewhere: {'; '.join(elsewhere)}." if elsewhere else
             ": nothing shows the loss curve is the same there."))


def audit_for(hardware: dict, audit: dict | None) -> str:
    """The audit sentence of one target: a CUDA target runs the code as it is; others list the work."""
    if audit is None:
        return "No audit was given: the cost of the team's own code is not counted."
    effort, source = audit_effort(audit), f"(source: `{audit['source']}`)"
    found = f"{effort['errors']} error and {effort['warnings']} warning findings"
    where = f"on {hardware['name']}" if hardware.get("name") else "off CUDA"
    if not effort["errors"] + effort["warnings"]:
        return f"The audit finds nothing to change before the code runs {where} {source}."
    if hardware.get("device_type") == "cuda":
        return f"The code runs on CUDA as it is; the audit's {found} are the work before it leaves CUDA {source}."
    kinds = ", ".join(f"{effort['effort'][e]} {e}" for e in EFFORT_WEIGHT)
    return f"Before the code runs {where}: {found}, {effort['weight']} effort points ({kinds}) {source}."


def doctors_on(hardware: dict, doctors: list[dict]) -> list[dict]:
    """The doctor reports whose device name matches the plan's hardware (its profile's ``match``)."""
    names = [m.lower() for m in hardware.get("match", [])]
    return [d for d in doctors if any(m in str(d["environment"].get("device_name", "")).lower() for m in names)]


def target_heading(plan: dict) -> str:
    return f"{plan['model']} on {plan['layout']['devices']} x {plan['hardware']['name']}, {plan['seq_len']:,}-token sequences"


def summary_section(audit: dict | None, doctors: list[dict], fidelity: list[dict], plans: list[dict]) -> list[Block]:
    """One heading and paragraph per target cluster (a plan): its plan, the audit's work and the
    fidelity evidence from that hardware."""
    blocks = [Block("h2", "Summary")]
    headings = Counter(target_heading(p) for p in plans)
    for plan in plans:
        hw, m = plan["hardware"], plan["memory_bytes"]
        heading = target_heading(plan)
        if headings[heading] > 1:  # two plans of one model, cluster and sequence: their layouts tell them apart
            heading = f"{heading}, {plan['layout']['describe']}"
        there = [d["label"] for d in doctors_on(hw, doctors)]
        checked = (f" `trex doctor` ran there: {', '.join(there)}." if there else
                   f" No `trex doctor` report from {hw['name']} yet: run it on that cluster first.")
        memory = (f"{m['total'] / GiB:.1f} of {plan['usable_bytes'] / GiB:.1f} GiB per device (weights, optimizer "
                  "state and the step's peak)")
        fit = f"fits: {memory}" if plan["fits"] else f"does NOT fit: {memory}"
        blocks += [Block("h3", heading),
                   Block("p", f"Layout {plan['layout']['describe']}, {plan['global_batch_tokens']:,} tokens per step. "
                              f"The plan {fit}; {_seconds(plan['time_s']['total'])} per step, "
                              f"{_num(plan['tokens_per_s_per_device'])} tokens/s per device, "
                              f"{100 * plan['mfu']:.1f}% MFU (source: `{plan['source']}`). {audit_for(hw, audit)} "
                              f"{evidence_for(hw, fidelity)}{checked}")]
    if not plans:
        evidence = (f"Fidelity evidence: {'; '.join(fidelity_said(r) for r in fidelity)}." if fidelity else
                    "No fidelity evidence was given: nothing shows the loss curve is the same elsewhere.")
        blocks.append(Block("p", f"No plan was given. {audit_for({}, audit)} {evidence}"))
    return blocks


def unique_headings(blocks: list[Block]) -> list[Block]:
    """The second and later of a repeated heading get (2), (3), ...: every heading can be linked to."""
    seen: Counter = Counter()
    for b in blocks:
        if b.kind in ("h1", "h2", "h3"):
            seen[b.text] += 1
            if seen[b.text] > 1:
                b.text = f"{b.text} ({seen[b.text]})"
    return blocks


def build(title: str, audit: dict | None, doctors: list[dict], fidelity: list[dict], plans: list[dict],
          refits: list[dict] = ()) -> list[Block]:
    blocks = [Block("h1", title), *summary_section(audit, doctors, fidelity, plans)]
    if audit:
        blocks += audit_section(audit)
    if doctors:
        blocks += doctor_section(doctors)
    if fidelity:
        blocks += fidelity_section(fidelity)
    if plans:
        blocks += plan_section(plans)
    if refits:
        blocks += refit_section(list(refits))
    return unique_headings(blocks)


# ---- Markdown ----------------------------------------------------------------------------------------
def markdown(blocks: list[Block], image_path) -> str:
    """``image_path(png)``: how the Markdown refers to a plot (a copy next to it)."""
    out = []
    for b in blocks:
        if b.kind in ("h1", "h2", "h3"):
            out += ["#" * int(b.kind[1]) + " " + b.text, ""]
        elif b.kind == "p":
            out += [b.text, ""]
        elif b.kind == "table":
            out += ["| " + " | ".join(b.header) + " |", "|" + "---|" * len(b.header)]
            out += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in b.rows]
            out.append("")
        elif b.kind == "img":
            out += [f"![{os.path.basename(b.path)}]({image_path(b.path)})", ""]
        elif b.kind == "source":
            out += [f"source: `{b.path}`", ""]
    return "\n".join(out)
