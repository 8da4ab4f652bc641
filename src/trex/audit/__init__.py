"""``trex audit``: find the code, kernels and packages in a training stack that only run on CUDA,
and say what to replace each with. Static: Python is read as an AST, never imported or run.

    from trex.audit import run_audit, load_config
    result = run_audit(["src/"], load_config("trex-audit.toml"))
"""

from trex.audit.config import AuditConfig, find_config, load_config
from trex.audit.model import AuditResult, Finding, Severity
from trex.audit.scanner import run_audit

__all__ = ["AuditConfig", "AuditResult", "Finding", "Severity", "find_config", "load_config", "run_audit"]
