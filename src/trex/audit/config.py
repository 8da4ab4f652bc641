"""The audit config file (``trex-audit.toml``), read with the standard library's tomllib.

    [audit]
    include = ["src/**"]                 # optional: only these paths (default: everything)
    exclude = ["tests/fixtures/**"]      # never read
    allow_paths = ["src/trex/device.py"] # read, but findings there are counted, not reported
    allow_modules = ["triton"]           # imports of these modules are allowed
    fail_on = "error"                    # default for --fail-on

    [audit.severity]                     # per-rule overrides
    TRX202 = "info"

Globs are relative to the directory holding the config file; ``*`` and ``**`` both match across
``/``, and a pattern ending in ``/`` matches everything below that directory.
"""

from __future__ import annotations

import fnmatch
import os
import tomllib
from dataclasses import dataclass, field

from trex.audit.model import Severity
from trex.audit.rules import RULES

CONFIG_NAME = "trex-audit.toml"
DEFAULT_EXCLUDES = (".git/", ".hg/", ".venv/", "venv/", "node_modules/", "__pycache__/", ".tox/",
                    ".mypy_cache/", ".pytest_cache/", "*.egg-info/")
_KEYS = {"include", "exclude", "allow_paths", "allow_modules", "fail_on", "severity"}


@dataclass(frozen=True)
class AuditConfig:
    root: str = "."  # globs are relative to this directory
    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    allow_paths: tuple[str, ...] = ()
    allow_modules: frozenset[str] = frozenset()
    fail_on: Severity | None = Severity.ERROR  # None: never fail
    severity: dict[str, Severity] = field(default_factory=dict)
    source: str | None = None  # the file this came from

    def relative(self, path: str) -> str:
        rel = os.path.relpath(os.path.abspath(path), os.path.abspath(self.root))
        return rel.replace(os.sep, "/")

    def is_excluded(self, path: str, is_dir: bool = False) -> bool:
        rel = self.relative(path)
        name = os.path.basename(path)
        for pattern in DEFAULT_EXCLUDES:
            if is_dir and fnmatch.fnmatchcase(name + "/", pattern):
                return True
        return _matches(rel, self.exclude, is_dir)

    def is_included(self, path: str) -> bool:
        return not self.include or _matches(self.relative(path), self.include, False)

    def is_allowlisted(self, path: str) -> bool:
        return _matches(self.relative(path), self.allow_paths, False)


def _matches(rel: str, patterns: tuple[str, ...], is_dir: bool) -> bool:
    candidate = rel + "/" if is_dir else rel
    for pattern in patterns:
        if pattern.endswith("/") and (candidate.startswith(pattern) or candidate == pattern):
            return True
        for text in {rel, candidate}:
            if fnmatch.fnmatchcase(text, pattern) or fnmatch.fnmatchcase(text, pattern.replace("**/", "")):
                return True
    return False


def parse_fail_on(value: str) -> Severity | None:
    return None if value.strip().lower() == "none" else Severity.parse(value)


def load_config(path: str) -> AuditConfig:
    """Read a config file; errors name the file and the offending key."""
    with open(path, "rb") as f:
        try:
            data = tomllib.load(f)
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"{path}: not valid TOML: {exc}") from None
    section = data.get("audit", {})
    unknown = set(section) - _KEYS
    if unknown:
        raise ValueError(f"{path}: unknown key(s) in [audit]: {sorted(unknown)}; expected {sorted(_KEYS)}")

    def strings(key: str) -> tuple[str, ...]:
        value = section.get(key, [])
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ValueError(f"{path}: [audit].{key} must be a list of strings, got {value!r}")
        return tuple(value)

    severity = {}
    for rule_id, level in section.get("severity", {}).items():
        if rule_id not in RULES:
            raise ValueError(f"{path}: [audit.severity] names unknown rule {rule_id!r}")
        try:
            severity[rule_id] = Severity.parse(str(level))
        except ValueError as exc:
            raise ValueError(f"{path}: [audit.severity].{rule_id}: {exc}") from None
    try:
        fail_on = parse_fail_on(str(section.get("fail_on", "error")))
    except ValueError as exc:
        raise ValueError(f"{path}: [audit].fail_on: {exc}") from None
    return AuditConfig(
        root=os.path.dirname(os.path.abspath(path)), include=strings("include"), exclude=strings("exclude"),
        allow_paths=strings("allow_paths"), allow_modules=frozenset(strings("allow_modules")),
        fail_on=fail_on, severity=severity, source=path)


def find_config(start: str = ".") -> str | None:
    """The nearest trex-audit.toml in ``start`` or its parents."""
    directory = os.path.abspath(start)
    while True:
        candidate = os.path.join(directory, CONFIG_NAME)
        if os.path.isfile(candidate):
            return candidate
        parent = os.path.dirname(directory)
        if parent == directory:
            return None
        directory = parent
