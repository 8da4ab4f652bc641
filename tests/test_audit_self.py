"""trex audits itself: `trex audit src/` with the project's trex-audit.toml reports nothing.

Only the device layer (src/trex/device.py) and the audit's own rule tables may name a vendor;
this test fails as soon as code elsewhere in src/ does.
"""

from __future__ import annotations

from pathlib import Path

from trex import cli
from trex.audit import AuditConfig, load_config, run_audit

ROOT = Path(__file__).resolve().parents[1]


def test_project_audit_of_src_reports_nothing(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    code = cli.main(["audit", "src/"])
    out = capsys.readouterr().out
    assert code == 0, out
    result = run_audit(["src/"], load_config("trex-audit.toml"))
    assert result.findings == [], [f"{f.path}:{f.line} {f.rule.id} {f.message}" for f in result.findings]
    assert result.skipped == []


def test_allowlist_covers_only_the_device_layer_and_the_audit_tables(monkeypatch):
    monkeypatch.chdir(ROOT)
    config = load_config("trex-audit.toml")
    assert set(config.allow_paths) == {"src/trex/device.py", "src/trex/audit/"}
    # without the allowlist, the device layer does name vendors: the allowlist is load-bearing
    unallowed = run_audit(["src/trex/device.py"], AuditConfig())
    assert unallowed.findings
