"""Scanners for the files around the Python code: requirements, pyproject, setup.cfg, conda
environments, shell scripts, Dockerfiles and CUDA sources.

Each scanner takes the path and the file's lines and returns findings; line numbers are 1-based.
"""

from __future__ import annotations

import re
import tomllib

from trex.audit import rules
from trex.audit.model import Finding

_REQUIREMENT_NAME = re.compile(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)")
_QUOTED = re.compile(r"\"([^\"]*)\"|'([^']*)'")


def normalize(name: str) -> str:
    """PEP 503 project name: lower case, runs of -_. become one dash."""
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_hits(text: str) -> list[tuple[str, str, str | None]]:
    """(rule id, message, replacement) for one requirement line or string such as 'flash-attn==2.6'."""
    hits: list[tuple[str, str, str | None]] = []
    match = _REQUIREMENT_NAME.match(text)
    name = normalize(match.group(1)) if match else ""
    if name in rules.CUDA_ONLY_REQUIREMENTS:
        module = rules.CUDA_ONLY_REQUIREMENTS[name]
        hits.append(("TRX504", f"requirement {name} only runs on CUDA", rules.CUDA_LIBRARIES[module][2]))
    elif rules.CUDA_PYTHON_PACKAGES.fullmatch(name):
        hits.append(("TRX502", f"requirement {name} binds the CUDA runtime", None))
    elif rules.NVIDIA_PACKAGE.fullmatch(name):
        hits.append(("TRX501", f"requirement {name} is an NVIDIA runtime wheel", None))
    local = rules.CUDA_LOCAL_VERSION.search(text)
    if local:
        hits.append(("TRX503", f"{name or 'wheel'} pinned to a CUDA build ({local.group(0)})", None))
    elif rules.CUDA_WHEEL_INDEX.search(text):
        hits.append(("TRX503", "CUDA wheel index", None))
    return hits


def _finding(rule_id: str, path: str, line: int, message: str, replacement: str | None,
             lines: list[str]) -> Finding:
    rule = rules.RULES[rule_id]
    snippet = lines[line - 1].strip()[:200] if 0 < line <= len(lines) else ""
    return Finding(rule=rule, path=path, line=line, column=0, message=message,
                   replacement=replacement or rule.replacement, snippet=snippet)


def scan_requirement_lines(path: str, lines: list[str]) -> list[Finding]:
    """requirements*.txt, constraints, setup.cfg, environment.yml: one requirement per line."""
    findings = []
    for number, raw in enumerate(lines, 1):
        text = raw.split(" #", 1)[0].strip()
        if not text or text.startswith("#") or text.startswith("["):
            continue
        text = text.lstrip("- ").strip()  # yaml list items
        if "=" in text and not re.match(r"[\w.\-\[\], ]+(==|>=|<=|~=|!=|===)", text):
            text = text.split("=", 1)[1].strip()  # setup.cfg "install_requires = flash-attn"
        for rule_id, message, replacement in requirement_hits(text):
            findings.append(_finding(rule_id, path, number, message, replacement, lines))
    return findings


def scan_pyproject(path: str, text: str, lines: list[str]) -> list[Finding]:
    """Requirement strings of [project], [build-system], [dependency-groups] and Poetry tables."""
    data = tomllib.loads(text)  # a TOMLDecodeError is reported by the caller as unparsable
    project = data.get("project", {})
    requirements: set[str] = set(project.get("dependencies", []))
    for group in project.get("optional-dependencies", {}).values():
        requirements.update(group)
    requirements.update(data.get("build-system", {}).get("requires", []))
    for group in data.get("dependency-groups", {}).values():
        requirements.update(r for r in group if isinstance(r, str))
    poetry = data.get("tool", {}).get("poetry", {})
    poetry_names = set(poetry.get("dependencies", {}))
    for group in poetry.get("group", {}).values():
        poetry_names.update(group.get("dependencies", {}))

    findings = []
    for number, line in enumerate(lines, 1):
        candidates = [a or b for a, b in _QUOTED.findall(line) if (a or b) in requirements]
        key = line.split("=", 1)[0].strip().strip("\"'")
        if "=" in line and key in poetry_names:
            candidates.append(key + line.split("=", 1)[1].strip().strip("\"'"))
        hits = [h for c in candidates for h in requirement_hits(c)]
        if not hits and rules.CUDA_WHEEL_INDEX.search(line):
            hits = [("TRX503", "CUDA wheel index", None)]
        for rule_id, message, replacement in hits:
            findings.append(_finding(rule_id, path, number, message, replacement, lines))
    return findings


def scan_shell(path: str, lines: list[str]) -> list[Finding]:
    """Shell scripts and Dockerfiles: NCCL variables, CUDA_VISIBLE_DEVICES, CUDA-only packages that
    pip/uv/conda install, CUDA wheels and CUDA base images."""
    findings = []
    for number, line in enumerate(lines, 1):
        code = line.split("#", 1)[0] if not line.lstrip().startswith("#") else ""
        if not code.strip():
            continue
        for name in rules.NCCL_ENV_IN_TEXT.findall(code):
            findings.append(_finding("TRX202", path, number, f"{name} only tunes NCCL", None, lines))
        if rules.VISIBLE_DEVICES_IN_TEXT.search(code):
            findings.append(_finding("TRX112", path, number, f"{rules.VISIBLE_DEVICES} selects devices on CUDA only",
                                     None, lines))
        install = rules.PIP_INSTALL.search(code)
        if install:  # each requirement of the command, as a requirements file line would be judged
            for word in install["args"].split():
                if word in ("&&", "||", ";", "|"):  # the next command
                    break
                if word.startswith("-") or word == "\\":
                    continue
                for rule_id, message, replacement in requirement_hits(word.strip("'\"")):
                    if rule_id != "TRX503":  # wheel indexes and local versions are caught for the whole line below
                        findings.append(_finding(rule_id, path, number, message, replacement, lines))
        if rules.CUDA_BASE_IMAGE.match(code):
            findings.append(_finding("TRX505", path, number, "CUDA base image", None, lines))
        if rules.CUDA_WHEEL_INDEX.search(code) or rules.CUDA_LOCAL_VERSION.search(code):
            findings.append(_finding("TRX503", path, number, "CUDA wheel or wheel index", None, lines))
    return findings


def scan_cuda_source(path: str, lines: list[str]) -> list[Finding]:
    """One finding per .cu/.cuh file, with its line count."""
    return [_finding("TRX403", path, 1, f"CUDA source file ({len(lines)} lines)", None, lines)]
