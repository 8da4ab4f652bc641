"""SARIF 2.1.0 output, as read by code-scanning tools (GitHub, VS Code SARIF viewer).

Locations are relative to ``%SRCROOT%``, the directory the audit ran from; skipped files become
tool execution notifications.
"""

from __future__ import annotations

import json
import os
import pathlib
from urllib.parse import quote

from trex import __version__
from trex.audit.model import AuditResult, Severity
from trex.audit.rules import RULES

SCHEMA_URI = "https://json.schemastore.org/sarif-2.1.0.json"
_LEVEL = {Severity.ERROR: "error", Severity.WARNING: "warning", Severity.INFO: "note"}


def _uri(path: str) -> str:
    return quote(pathlib.PurePath(os.path.relpath(path)).as_posix() if os.path.isabs(path)
                 else pathlib.PurePath(path).as_posix())


def _location(path: str, line: int, column: int) -> dict:
    region = {"startLine": max(line, 1)}
    if column > 0:
        region["startColumn"] = column
    return {"physicalLocation": {"artifactLocation": {"uri": _uri(path), "uriBaseId": "%SRCROOT%"},
                                 "region": region}}


def to_sarif(result: AuditResult, root: str = ".") -> str:
    rule_ids = sorted(RULES)
    index = {rule_id: i for i, rule_id in enumerate(rule_ids)}
    rules = [{
        "id": r.id,
        "name": r.name,
        "shortDescription": {"text": r.summary},
        "fullDescription": {"text": f"{r.summary}. Replace with: {r.replacement}"},
        "help": {"text": r.replacement},
        "defaultConfiguration": {"level": _LEVEL[r.severity]},
        "properties": {"category": r.category, "effort": r.effort.value, "tags": ["portability", r.category]},
    } for r in (RULES[i] for i in rule_ids)]
    results = [{
        "ruleId": f.rule.id,
        "ruleIndex": index[f.rule.id],
        "level": _LEVEL[f.effective_severity],
        "message": {"text": f"{f.message}. Replace with: {f.replacement}"},
        "locations": [_location(f.path, f.line, f.column)],
        "properties": {"category": f.rule.category, "effort": f.effective_effort.value, "guarded": f.guarded},
    } for f in result.sorted_findings()]
    notifications = [{
        "level": "warning",
        "message": {"text": f"skipped: {s.reason}"},
        "locations": [_location(s.path, 1, 0)],
    } for s in result.skipped]
    log = {
        "$schema": SCHEMA_URI,
        "version": "2.1.0",
        "runs": [{
            "tool": {"driver": {"name": "trex-audit", "version": __version__, "rules": rules}},
            "originalUriBaseIds": {"%SRCROOT%": {"uri": pathlib.Path(root).resolve().as_uri() + "/"}},
            "invocations": [{"executionSuccessful": True, "toolExecutionNotifications": notifications}],
            "results": results,
        }],
    }
    return json.dumps(log, indent=2)
