"""What the audit produces: rules, findings, skipped files and the result of one run."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace


class Severity(enum.IntEnum):
    """How much a finding blocks a move off NVIDIA hardware.

    error: fails on other accelerators (an import, a call or a build that needs CUDA).
    warning: runs, but does the wrong thing or loses something (a flag, a tuning variable).
    info: device-aware code that falls back (a guarded branch, an optional import).
    """

    INFO = 0
    WARNING = 1
    ERROR = 2

    @classmethod
    def parse(cls, name: str) -> "Severity":
        try:
            return cls[name.strip().upper()]
        except KeyError:
            raise ValueError(f"unknown severity {name!r}; expected one of info, warning, error") from None

    @property
    def label(self) -> str:
        return self.name.lower()


class Effort(str, enum.Enum):
    """How much work replacing a finding takes."""

    MECHANICAL = "mechanical"  # search-and-replace with a portable call
    MODERATE = "moderate"  # a different API or library, same design
    REWRITE = "rewrite"  # a kernel or extension to port or re-implement

    @property
    def weight(self) -> int:
        """Relative cost used to rank files by effort (mechanical = 1)."""
        return {"mechanical": 1, "moderate": 5, "rewrite": 20}[self.value]


@dataclass(frozen=True)
class Rule:
    id: str
    name: str
    category: str
    severity: Severity
    effort: Effort
    summary: str  # what the rule looks for
    replacement: str  # the portable or Ascend replacement, in general terms


@dataclass(frozen=True)
class Finding:
    """One hit of a rule. ``line``/``column`` are 1-based; ``column`` 0 means the whole line."""

    rule: Rule
    path: str
    line: int
    column: int
    message: str
    replacement: str
    snippet: str = ""
    severity: Severity | None = None  # None: the rule's own severity
    guarded: bool = False  # inside a fallback branch or an optional import
    effort: Effort | None = None  # None: the rule's own effort (a library can differ from its rule)

    @property
    def effective_severity(self) -> Severity:
        return self.rule.severity if self.severity is None else self.severity

    @property
    def effective_effort(self) -> Effort:
        return self.rule.effort if self.effort is None else self.effort

    def with_severity(self, severity: Severity) -> "Finding":
        return replace(self, severity=severity)

    def to_dict(self) -> dict:
        return {
            "rule": self.rule.id,
            "name": self.rule.name,
            "category": self.rule.category,
            "severity": self.effective_severity.label,
            "effort": self.effective_effort.value,
            "path": self.path,
            "line": self.line,
            "column": self.column,
            "message": self.message,
            "replacement": self.replacement,
            "snippet": self.snippet,
            "guarded": self.guarded,
        }


@dataclass(frozen=True)
class SkippedFile:
    path: str
    reason: str


@dataclass
class AuditResult:
    findings: list[Finding] = field(default_factory=list)
    skipped: list[SkippedFile] = field(default_factory=list)
    files_scanned: int = 0
    suppressed: int = 0  # silenced by `# trex: ignore[...]`
    allowlisted: int = 0  # inside allowlisted paths or modules
    cuda_source_lines: int = 0  # total lines of .cu/.cuh files
    seconds: float = 0.0

    def worst(self) -> Severity | None:
        return max((f.effective_severity for f in self.findings), default=None)

    def sorted_findings(self) -> list[Finding]:
        return sorted(self.findings, key=lambda f: (f.path, f.line, f.column, f.rule.id))
