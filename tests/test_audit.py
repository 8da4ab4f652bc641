"""trex audit on fixture mini-repositories.

Expected findings are written next to the code they are about, as ``expect: RULE[:severity]``
comments in tests/fixtures/audit/*; a test compares them both ways, so a missed finding (recall)
and an extra one (false positive) both fail.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections import Counter
from pathlib import Path

import jsonschema
import pytest

from trex import cli
from trex.audit import AuditConfig, Severity, load_config, run_audit
from trex.audit.reports import to_markdown
from trex.audit.rules import CATEGORIES, RULES
from trex.audit.sarif import to_sarif

FIXTURES = Path(__file__).parent / "fixtures" / "audit"
CUDA_REPO = FIXTURES / "cuda_repo"
PORTABLE_REPO = FIXTURES / "portable_repo"
_EXPECT = re.compile(r"expect: (.+?)\s*$")
_TOKEN = re.compile(r"(TRX\d{3})(?::(info|warning|error))?")


def expected(repo: Path) -> Counter:
    """Counter of (relative path, line, rule, severity or None) from the fixture annotations."""
    out: Counter = Counter()
    for path in repo.rglob("*"):
        if not path.is_file():
            continue
        text = path.read_bytes().decode("latin-1")
        for number, line in enumerate(text.splitlines(), 1):
            match = _EXPECT.search(line)
            if match:
                for rule, severity in _TOKEN.findall(match.group(1)):
                    out[(path.relative_to(repo).as_posix(), number, rule, severity or None)] += 1
    return out


def found(repo: Path, result) -> Counter:
    return Counter((Path(f.path).relative_to(repo).as_posix(), f.line, f.rule.id, f.effective_severity.label)
                   for f in result.findings)


def compare(repo: Path) -> tuple[list, list]:
    """(missed, unexpected): expectations without a finding, findings without an expectation."""
    want = expected(repo)
    got = found(repo, run_audit([str(repo)], AuditConfig()))
    missed, unexpected = [], list((got - Counter()).elements())
    for (path, line, rule, severity), n in want.items():
        for _ in range(n):
            match = next((k for k in unexpected if k[:3] == (path, line, rule) and severity in (None, k[3])), None)
            if match is None:
                missed.append((path, line, rule, severity))
            else:
                unexpected.remove(match)
    return missed, unexpected


@pytest.mark.parametrize("repo", [CUDA_REPO, PORTABLE_REPO], ids=lambda p: p.name)
def test_findings_match_annotations(repo):
    missed, unexpected = compare(repo)
    assert not missed, f"recall: expected findings not reported: {missed}"
    assert not unexpected, f"false positives: reported without an annotation: {unexpected}"


def test_every_rule_has_a_positive_fixture():
    covered = {rule for (_, _, rule, _) in expected(CUDA_REPO)}
    assert covered == set(RULES), f"rules without a fixture: {sorted(set(RULES) - covered)}"


def test_device_agnostic_code_reports_nothing_above_info():
    result = run_audit([str(PORTABLE_REPO)], AuditConfig())
    assert result.files_scanned == 3
    assert result.worst() in (None, Severity.INFO)


def test_unparsable_and_binary_files_are_reported_and_skipped():
    result = run_audit([str(CUDA_REPO)], AuditConfig())
    reasons = {Path(s.path).name: s.reason for s in result.skipped}
    assert set(reasons) == {"broken.py", "blob.py"}
    assert reasons["broken.py"].startswith("does not parse: line 1")
    assert reasons["blob.py"] == "binary file"
    assert not any(Path(f.path).name in reasons for f in result.findings)


def test_bad_encoding_is_skipped_and_bom_is_read(tmp_path):
    (tmp_path / "bom.py").write_bytes(b"\xef\xbb\xbfimport torch\ntorch.cuda.synchronize()\n")
    (tmp_path / "bad.py").write_bytes(b"x = '\xff\xfe not utf-8'\n")
    result = run_audit([str(tmp_path)], AuditConfig())
    assert [(Path(f.path).name, f.line, f.rule.id) for f in result.findings] == [("bom.py", 2, "TRX101")]
    assert [Path(s.path).name for s in result.skipped] == ["bad.py"]
    assert "decode" in result.skipped[0].reason


def test_inline_suppressions_by_id_name_list_and_bare():
    result = run_audit([str(CUDA_REPO / "suppressed.py")], AuditConfig())
    # lines 4-7 hold 1 + 1 + 1 + 2 findings, all silenced; line 8 silences a rule that is not there
    assert result.suppressed == 5
    assert [(f.line, f.rule.id) for f in result.findings] == [(8, "TRX103")]


def test_config_exclude_allowlist_modules_and_severity(tmp_path):
    config_path = tmp_path / "trex-audit.toml"
    config_path.write_text(
        '[audit]\nexclude = ["ext/", "*.sh"]\nallow_paths = ["train_dist.py"]\n'
        'allow_modules = ["triton"]\n[audit.severity]\nTRX106 = "error"\nTRX301 = "warning"\n')
    config = load_config(str(config_path))
    config = dataclasses.replace(config, root=str(CUDA_REPO))
    result = run_audit([str(CUDA_REPO)], config)
    baseline = run_audit([str(CUDA_REPO)], AuditConfig())
    paths = {Path(f.path).relative_to(CUDA_REPO).as_posix() for f in result.findings}
    assert not any(p.startswith("ext/") or p.endswith(".sh") for p in paths)
    assert "train_dist.py" not in paths
    dist_findings = sum(1 for f in baseline.findings if Path(f.path).name == "train_dist.py")
    # allowlisted: every train_dist.py finding plus the two triton imports
    assert result.allowlisted == dist_findings + 2
    kernels = [f for f in result.findings if Path(f.path).name == "kernels.py"]
    assert not any("triton" in f.message and f.rule.id == "TRX301" for f in kernels)
    assert all(f.effective_severity == Severity.ERROR for f in result.findings if f.rule.id == "TRX106")
    unguarded_301 = [f for f in result.findings if f.rule.id == "TRX301" and not f.guarded]
    assert unguarded_301 and all(f.effective_severity == Severity.WARNING for f in unguarded_301)


def test_config_include_limits_the_scan(tmp_path):
    config_path = tmp_path / "trex-audit.toml"
    config_path.write_text('[audit]\ninclude = ["ext/*.py"]\n')
    config = dataclasses.replace(load_config(str(config_path)), root=str(CUDA_REPO))
    result = run_audit([str(CUDA_REPO)], config)
    assert result.files_scanned == 2
    assert {Path(f.path).name for f in result.findings} == {"setup.py", "build_jit.py"}


@pytest.mark.parametrize("body, complaint", [
    ('[audit]\nexlude = ["x"]\n', "unknown key"),
    ('[audit]\nexclude = "x"\n', "list of strings"),
    ('[audit.severity]\nTRX999 = "error"\n', "unknown rule"),
    ('[audit.severity]\nTRX101 = "fatal"\n', "unknown severity"),
    ('[audit\n', "not valid TOML"),
])
def test_bad_config_names_file_and_problem(tmp_path, body, complaint):
    path = tmp_path / "trex-audit.toml"
    path.write_text(body)
    with pytest.raises(ValueError, match=complaint) as info:
        load_config(str(path))
    assert str(path) in str(info.value)


def test_symlink_loops_end_and_files_are_read_once(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "a.py").write_text("import torch\ntorch.cuda.synchronize()\n")
    (pkg / "loop").symlink_to(pkg, target_is_directory=True)
    (tmp_path / "alias").symlink_to(pkg, target_is_directory=True)
    result = run_audit([str(tmp_path)], AuditConfig())
    assert result.files_scanned == 1
    assert len(result.findings) == 1


def test_cli_exit_code_follows_fail_on(capsys):
    assert cli.main(["audit", "--no-config", str(CUDA_REPO)]) == 1
    assert cli.main(["audit", "--no-config", "--fail-on", "none", str(CUDA_REPO)]) == 0
    assert cli.main(["audit", "--no-config", "--fail-on", "warning", str(PORTABLE_REPO)]) == 0
    assert cli.main(["audit", "--no-config", "--fail-on", "info", str(PORTABLE_REPO)]) == 1
    assert cli.main(["audit", "--no-config", str(CUDA_REPO / "missing")]) == 2
    capsys.readouterr()


def test_cli_text_groups_by_file_with_the_offending_line(capsys):
    cli.main(["audit", "--no-config", str(CUDA_REPO / "train_dist.py")])
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].endswith("train_dist.py")
    assert 'dist.init_process_group("nccl", rank=rank, world_size=world)' in out
    assert "get_default_backend_for_device" in out  # the replacement is shown


def test_cli_json_matches_the_audit(capsys):
    cli.main(["audit", "--no-config", "--format", "json", "--fail-on", "none", str(CUDA_REPO)])
    report = json.loads(capsys.readouterr().out)
    result = run_audit([str(CUDA_REPO)], AuditConfig())
    assert report["summary"]["findings"] == len(result.findings) == len(report["findings"])
    assert {s["path"] for s in report["skipped"]} == {s.path for s in result.skipped}
    first = report["findings"][0]
    assert set(first) >= {"rule", "category", "severity", "effort", "path", "line", "message", "replacement"}


def test_sarif_validates_against_the_2_1_0_schema(tmp_path):
    schema = json.loads((FIXTURES / "sarif-schema-2.1.0.json").read_text())
    result = run_audit([str(CUDA_REPO)], AuditConfig())
    log = json.loads(to_sarif(result))
    jsonschema.validate(log, schema)
    run = log["runs"][0]
    assert len(run["results"]) == len(result.findings)
    rules = run["tool"]["driver"]["rules"]
    for res in run["results"]:
        assert rules[res["ruleIndex"]]["id"] == res["ruleId"]
        assert res["level"] in {"error", "warning", "note"}
    assert len(run["invocations"][0]["toolExecutionNotifications"]) == len(result.skipped)
    levels = Counter(r["level"] for r in run["results"])
    assert levels["note"] == sum(1 for f in result.findings if f.effective_severity == Severity.INFO)


def test_sarif_schema_rejects_a_broken_log():
    """The schema check is real: a result without a message is refused."""
    schema = json.loads((FIXTURES / "sarif-schema-2.1.0.json").read_text())
    log = json.loads(to_sarif(run_audit([str(CUDA_REPO / "kernels.py")], AuditConfig())))
    del log["runs"][0]["results"][0]["message"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(log, schema)


def test_markdown_posture_table_counts_by_category():
    result = run_audit([str(CUDA_REPO)], AuditConfig())
    md = to_markdown(result)
    rows = {line.split("|")[1].strip(): [int(c) for c in line.strip("|").split("|")[1:]]
            for line in md.splitlines() if line.startswith("| ") and line.split("|")[1].strip() in CATEGORIES}
    assert set(rows) == set(CATEGORIES)
    for category, (errors, warnings, infos, *_) in rows.items():
        mine = [f for f in result.findings if f.rule.category == category]
        assert (errors, warnings, infos) == (
            sum(f.effective_severity == Severity.ERROR for f in mine),
            sum(f.effective_severity == Severity.WARNING for f in mine),
            sum(f.effective_severity == Severity.INFO for f in mine))
    # kernels.py holds the rewrite-class kernels and most library imports: it dominates the effort
    dominate = md.split("## Files that dominate the effort")[1]
    assert dominate.index("kernels.py") < dominate.index("train_device.py")
    assert "CUDA sources: 2 file(s), 8 lines." in md


def test_cli_writes_report_atomically(tmp_path, capsys):
    out = tmp_path / "audit.sarif"
    assert cli.main(["audit", "--no-config", "--format", "sarif", "-o", str(out), "--fail-on", "none",
                     str(PORTABLE_REPO)]) == 0
    assert json.loads(out.read_text())["version"] == "2.1.0"
    assert os.listdir(tmp_path) == ["audit.sarif"]
    capsys.readouterr()


def test_docs_list_every_rule():
    text = (Path(__file__).parents[1] / "docs" / "audit.md").read_text()
    for rule in RULES.values():
        assert f"| {rule.id} | {rule.name} | {rule.category} | {rule.severity.label} |" in text, rule.id


def test_a_package_importing_itself_is_not_lock_in(tmp_path):
    """Auditing liger_kernel's own source: its imports of liger_kernel are not findings; its triton
    kernels still are."""
    pkg = tmp_path / "liger_kernel"
    (pkg / "ops").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from liger_kernel.ops import rms_norm\n")
    (pkg / "ops" / "__init__.py").write_text("")
    (pkg / "ops" / "rms_norm.py").write_text("import triton\nfrom liger_kernel.ops.utils import ensure\n")
    (tmp_path / "user.py").write_text("import liger_kernel\n")  # a user of the package: lock-in
    findings = run_audit([str(tmp_path)]).findings
    located = sorted((os.path.relpath(f.path, tmp_path), f.rule.id) for f in findings)
    assert located == [("liger_kernel/ops/rms_norm.py", "TRX301"), ("user.py", "TRX301")], located
