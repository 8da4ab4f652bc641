"""Human and machine readable audit reports: text, JSON and a markdown posture summary.
SARIF lives in sarif.py."""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from itertools import groupby

from trex.audit.model import AuditResult, Effort, Severity
from trex.logs import plural
from trex.audit.rules import CATEGORIES, RULES


def summary(result: AuditResult) -> dict:
    by_severity = Counter(f.effective_severity.label for f in result.findings)
    return {
        "files_scanned": result.files_scanned,
        "findings": len(result.findings),
        "errors": by_severity["error"],
        "warnings": by_severity["warning"],
        "info": by_severity["info"],
        "suppressed": result.suppressed,
        "allowlisted": result.allowlisted,
        "skipped": len(result.skipped),
        "cuda_source_lines": result.cuda_source_lines,
        "seconds": round(result.seconds, 3),
    }


def _summary_line(result: AuditResult) -> str:
    s = summary(result)
    cuda_lines = f"; {s['cuda_source_lines']} lines of CUDA sources" if s["cuda_source_lines"] else ""
    return (f"{plural(s['findings'], 'finding')} ({plural(s['errors'], 'error')}, {plural(s['warnings'], 'warning')}, "
            f"{s['info']} info) in {plural(s['files_scanned'], 'file')} scanned; {s['suppressed']} suppressed, "
            f"{s['allowlisted']} allowlisted, "
            f"{s['skipped']} skipped{cuda_lines}; {s['seconds']:.2f}s")


def to_text(result: AuditResult) -> str:
    out = []
    for path, group in groupby(result.sorted_findings(), key=lambda f: f.path):
        out.append(path)
        for f in group:
            where = f"{f.line}:{f.column}" if f.column else f"{f.line}"
            out.append(f"  {where:>8}  {f.effective_severity.label:<7} {f.rule.id} {f.message}")
            if f.snippet:
                out.append(f"{'':>12}| {f.snippet}")
            out.append(f"{'':>12}-> {f.replacement}")
        out.append("")
    if result.skipped:
        out.append(f"skipped {len(result.skipped)} file(s):")
        out.extend(f"  {s.path}: {s.reason}" for s in result.skipped)
        out.append("")
    out.append(_summary_line(result))
    return "\n".join(out)


def to_json(result: AuditResult) -> str:
    return json.dumps({
        "tool": "trex-audit",
        "summary": summary(result),
        "findings": [f.to_dict() for f in result.sorted_findings()],
        "skipped": [{"path": s.path, "reason": s.reason} for s in result.skipped],
    }, indent=2)


def effort_by_file(result: AuditResult) -> list[tuple[str, int]]:
    """Files ranked by summed effort weight of their non-info findings (mechanical 1, moderate 5, rewrite 20)."""
    weights: dict[str, int] = defaultdict(int)
    for f in result.findings:
        if f.effective_severity > Severity.INFO:
            weights[f.path] += f.effective_effort.weight
    return sorted(weights.items(), key=lambda kv: (-kv[1], kv[0]))


def to_markdown(result: AuditResult, top_files: int = 10) -> str:
    blocking = [f for f in result.findings if f.effective_severity > Severity.INFO]
    out = ["# Portability audit", "", _summary_line(result), "", "## Posture", "",
           "| category | error | warning | info | mechanical | moderate | rewrite |",
           "|---|---:|---:|---:|---:|---:|---:|"]
    for category in CATEGORIES:
        found = [f for f in result.findings if f.rule.category == category]
        sev = Counter(f.effective_severity.label for f in found)
        eff = Counter(f.effective_effort.value for f in found if f.effective_severity > Severity.INFO)
        out.append(f"| {category} | {sev['error']} | {sev['warning']} | {sev['info']} | "
                   + " | ".join(str(eff[e.value]) for e in Effort) + " |")
    total_weight = sum(f.effective_effort.weight for f in blocking)
    out += ["", "Effort counts exclude info-level findings (guarded code that already falls back).", ""]
    if result.cuda_source_lines:
        n = sum(1 for f in result.findings if f.rule.id == "TRX403")
        out += [f"CUDA sources: {n} file(s), {result.cuda_source_lines} lines.", ""]
    ranked = effort_by_file(result)[:top_files]
    if ranked:
        out += ["## Files that dominate the effort", "",
                "Weight: mechanical 1, moderate 5, rewrite 20 per finding.", "",
                "| file | weight | share |", "|---|---:|---:|"]
        out += [f"| `{path}` | {w} | {100 * w / total_weight:.0f}% |" for path, w in ranked]
        out.append("")
    rule_counts = Counter(f.rule.id for f in result.findings)
    if rule_counts:
        out += ["## Findings by rule", "", "| rule | name | count | replace with |", "|---|---|---:|---|"]
        for rule_id in sorted(rule_counts):
            rule = RULES[rule_id]
            out.append(f"| {rule_id} | {rule.name} | {rule_counts[rule_id]} | {rule.replacement} |")
        out.append("")
    if result.skipped:
        out += ["## Skipped files", ""] + [f"- `{s.path}`: {s.reason}" for s in result.skipped] + [""]
    return "\n".join(out)
