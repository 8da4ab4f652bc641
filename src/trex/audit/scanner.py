"""Walk the paths, read each file once, dispatch it to its scanner, then apply suppressions,
severity overrides and the allowlist.

Files that cannot be read, decoded or parsed are recorded in ``AuditResult.skipped`` with the
reason and do not stop the run. Directory symlinks are followed once: a directory already seen
(same device and inode) is not entered again, so symlink loops end.
"""

from __future__ import annotations

import ast
import fnmatch
import io
import os
import re
import time
import tokenize
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace

from trex.audit import file_scan, rules
from trex.audit.config import AuditConfig
from trex.audit.model import AuditResult, Finding, SkippedFile
from trex.audit.python_scan import scan_python

_SUPPRESS = re.compile(r"#\s*trex:\s*ignore(?:\[([^\]]*)\])?")
_REQUIREMENT_FILES = ("*requirements*.txt", "*requirements*.in", "constraints*.txt", "setup.cfg",
                      "environment*.yml", "environment*.yaml", "conda*.yml", "conda*.yaml")
_SHELL_FILES = ("*.sh", "*.bash", "Dockerfile", "Dockerfile.*", "*.dockerfile", "Containerfile")
_BINARY_SNIFF = 8192


def file_kind(path: str) -> str | None:
    """Which scanner reads this file: python, cuda, pyproject, requirements, shell, or None."""
    name = os.path.basename(path)
    if name.endswith((".py", ".pyi")):
        return "python"
    if name.endswith(rules.CUDA_SOURCE_SUFFIXES):
        return "cuda"
    if name == "pyproject.toml":
        return "pyproject"
    if any(fnmatch.fnmatchcase(name, p) for p in _REQUIREMENT_FILES) or (
            name.endswith(".txt") and os.path.basename(os.path.dirname(path)) == "requirements"):
        return "requirements"
    if any(fnmatch.fnmatchcase(name, p) for p in _SHELL_FILES):
        return "shell"
    return None


def iter_files(paths: Iterable[str], config: AuditConfig) -> Iterator[str]:
    """Files under ``paths`` that the audit reads, in a stable order."""
    seen_dirs: set[tuple[int, int]] = set()
    for root in paths:
        if os.path.isfile(root):
            if file_kind(root):
                yield os.path.normpath(root)
            continue
        if not os.path.isdir(root):
            raise FileNotFoundError(f"{root!r} is neither a file nor a directory")
        for directory, dirnames, filenames in os.walk(root, followlinks=True):
            st = os.stat(directory)
            if (st.st_dev, st.st_ino) in seen_dirs:
                dirnames[:] = []
                continue
            seen_dirs.add((st.st_dev, st.st_ino))
            dirnames[:] = sorted(d for d in dirnames
                                 if not config.is_excluded(os.path.join(directory, d), is_dir=True))
            for name in sorted(filenames):
                path = os.path.normpath(os.path.join(directory, name))
                if file_kind(path) and not config.is_excluded(path) and config.is_included(path):
                    yield path


def _decode_python(data: bytes) -> str:
    """Source text honouring the PEP 263 coding cookie and a UTF-8 BOM."""
    encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
    return data.decode(encoding)


@dataclass
class FileScan:
    """What one file contributed: findings left after inline suppressions, and the counts."""

    findings: list[Finding] = field(default_factory=list)
    suppressed: int = 0
    allowlisted: int = 0  # imports of allowlisted modules
    cuda_lines: int = 0
    skipped: SkippedFile | None = None


def scan_file(path: str, config: AuditConfig) -> FileScan:
    kind = file_kind(path)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        return FileScan(skipped=SkippedFile(path, f"unreadable: {exc.strerror or exc}"))
    if b"\0" in data[:_BINARY_SNIFF]:
        return FileScan(skipped=SkippedFile(path, "binary file"))
    try:
        text = _decode_python(data) if kind == "python" else data.decode("utf-8", errors="replace")
    except (SyntaxError, UnicodeDecodeError, LookupError) as exc:
        return FileScan(skipped=SkippedFile(path, f"cannot decode: {exc}"))
    lines = text.splitlines()
    scan = FileScan()
    if kind == "python":
        try:
            tree = ast.parse(text, filename=path)
        except SyntaxError as exc:
            return FileScan(skipped=SkippedFile(path, f"does not parse: line {exc.lineno}: {exc.msg}"))
        except (ValueError, RecursionError, MemoryError) as exc:
            return FileScan(skipped=SkippedFile(path, f"does not parse: {type(exc).__name__}"))
        findings, scan.allowlisted = scan_python(path, tree, lines, config.allow_modules,
                                                 is_setup_script=os.path.basename(path) == "setup.py")
    elif kind == "pyproject":
        try:
            findings = file_scan.scan_pyproject(path, text, lines)
        except ValueError as exc:  # tomllib.TOMLDecodeError is a ValueError
            return FileScan(skipped=SkippedFile(path, f"does not parse: {exc}"))
    elif kind == "cuda":
        findings, scan.cuda_lines = file_scan.scan_cuda_source(path, lines), len(lines)
    elif kind == "requirements":
        findings = file_scan.scan_requirement_lines(path, lines)
    else:
        findings = file_scan.scan_shell(path, lines)
    for finding in findings:
        line_text = lines[finding.line - 1] if 0 < finding.line <= len(lines) else ""
        if is_suppressed(finding, line_text):
            scan.suppressed += 1
        else:
            scan.findings.append(finding)
    return scan


def is_suppressed(finding: Finding, line_text: str) -> bool:
    """``# trex: ignore`` silences every rule on the line; ``# trex: ignore[TRX104,nvtx]`` those named."""
    for match in _SUPPRESS.finditer(line_text):
        if match.group(1) is None:
            return True
        names = {n.strip() for n in match.group(1).split(",")}
        if finding.rule.id in names or finding.rule.name in names:
            return True
    return False


def run_audit(paths: Iterable[str], config: AuditConfig | None = None) -> AuditResult:
    """Scan files and directories; the config decides what is read, reported and how severe."""
    config = config or AuditConfig()
    result = AuditResult()
    t0 = time.perf_counter()
    for path in iter_files(paths, config):
        scan = scan_file(path, config)
        result.files_scanned += 1
        if scan.skipped:
            result.skipped.append(scan.skipped)
            continue
        result.cuda_source_lines += scan.cuda_lines
        result.suppressed += scan.suppressed
        result.allowlisted += scan.allowlisted
        if config.is_allowlisted(path):
            result.allowlisted += len(scan.findings)
            continue
        for finding in scan.findings:
            override = config.severity.get(finding.rule.id)
            if override is not None and not finding.guarded:
                finding = replace(finding, severity=override)
            result.findings.append(finding)
    result.seconds = time.perf_counter() - t0
    return result
