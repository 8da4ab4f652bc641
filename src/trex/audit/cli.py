"""``trex audit PATH...``: registered through ``trex.cli.COMMAND_MODULES``."""

from __future__ import annotations

import argparse
import os
import sys

from trex import atomic, logs
from trex.audit import reports, sarif
from trex.audit.config import AuditConfig, find_config, load_config, parse_fail_on
from trex.audit.scanner import run_audit

FORMATS = {
    "text": reports.to_text,
    "json": reports.to_json,
    "markdown": reports.to_markdown,
    "sarif": sarif.to_sarif,
}


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "audit", help="find CUDA-only code, kernels and packages and say what replaces them",
        description="Static portability audit. Exit status 1 when a finding reaches --fail-on, 2 on bad usage.")
    p.add_argument("paths", nargs="+", metavar="PATH", help="files or directories to scan")
    p.add_argument("--format", choices=sorted(FORMATS), default="text",
                   help="report format; sarif for code-scanning tools (default: %(default)s)")
    p.add_argument("--config", default=None,
                   help="config file (default: the nearest trex-audit.toml in the current directory or above)")
    p.add_argument("--no-config", action="store_true", help="ignore any trex-audit.toml")
    p.add_argument("--fail-on", default=None, metavar="SEVERITY",
                   help="info, warning, error or none (default: the config's fail_on, else error)")
    p.add_argument("--output", "-o", default=None, help="write the report to this file instead of stdout")
    p.set_defaults(func=_cmd_audit)


def _cmd_audit(args: argparse.Namespace) -> int:
    """Exit 0 clean, 1 a finding reached --fail-on, 2 a usage fault (a bad path, config or -o)."""
    try:
        _check_output(args.output)
        config = _config(args)
        fail_on = parse_fail_on(args.fail_on) if args.fail_on is not None else config.fail_on
        result = run_audit(args.paths, config)
    except (ValueError, FileNotFoundError) as exc:
        print(f"trex audit: {exc}", file=sys.stderr)
        return 2
    report = FORMATS[args.format](result)
    if args.output:
        try:
            atomic.write_text(args.output, report + "\n")
        except OSError as exc:
            print(f"trex audit: -o {logs.os_error_line(exc)}", file=sys.stderr)
            return 2
    else:
        print(report)
    worst = result.worst()
    return 1 if fail_on is not None and worst is not None and worst >= fail_on else 0


def _check_output(path: str | None) -> None:
    """-o is checked before the scan: its folder must exist and be writable (2, not the findings' 1)."""
    if path is None:
        return
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(f"-o {path}: no such directory {folder}")
    if not os.access(folder, os.W_OK) or os.path.isdir(path):
        raise ValueError(f"-o {path}: cannot write there ({'a directory' if os.path.isdir(path) else 'not writable'})")


def _config(args: argparse.Namespace) -> AuditConfig:
    if args.no_config:
        return AuditConfig()
    path = args.config or find_config()
    if path is None:
        return AuditConfig()
    return load_config(path)


