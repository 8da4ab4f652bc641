"""`trex report`: one Markdown + self-contained HTML report from the audit, doctor, fidelity and plan
outputs; every number names its file; bad inputs are one line; the committed example is current."""

from __future__ import annotations

import base64
import json
import os
import re
from html.parser import HTMLParser

import pytest

from trex.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOLDEN = os.path.join(ROOT, "fidelity", "golden", "default_cpu_fp32.json")
EXAMPLE = os.path.join(ROOT, "docs", "report")
VOID = {"meta", "img", "br", "hr", "link", "input"}


class Page(HTMLParser):
    """Checks that tags nest and close, and collects the images and any external reference."""

    def __init__(self):
        super().__init__()
        self.stack, self.images, self.external, self.errors = [], [], [], []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        for key in ("src", "href"):
            if key in attrs and not attrs[key].startswith("data:"):
                self.external.append(attrs[key])
        if tag == "img":
            self.images.append(attrs["src"])
        if tag not in VOID:
            self.stack.append(tag)

    def handle_endtag(self, tag):
        if not self.stack or self.stack.pop() != tag:
            self.errors.append(f"</{tag}> does not close the open tag")


def check_page(path: str) -> Page:
    page = Page()
    page.feed(open(path, encoding="utf-8").read())
    page.close()
    assert not page.errors and not page.stack, (page.errors, page.stack)
    assert not page.external  # self-contained: nothing to fetch
    for src in page.images:
        head, data = src.split(",", 1)
        assert head == "data:image/png;base64" and base64.b64decode(data)[:8] == b"\x89PNG\r\n\x1a\n"
    return page


@pytest.fixture
def inputs(tmp_path, capsys):
    """Real outputs of the other commands: an audit with findings, this machine's doctor, a plan that
    fits and one that does not, and a comparison (its JSON and plot)."""
    audit = tmp_path / "audit.json"
    main(["audit", os.path.join(ROOT, "tests", "fixtures", "audit", "cuda_repo"), "--no-config", "--format", "json",
          "-o", str(audit)])
    capsys.readouterr()
    plans = []
    for name, args in (("fits", ["--model", "tiny", "--hardware", "h200-sxm", "--devices", "8"]),
                       ("too_big", ["--model", "deepseek-v4-pro", "--hardware", "h200-sxm", "--devices", "8",
                                    "--layout", "dp_shard=8,ep=8,micro_batch=1"]),
                       ("ascend", ["--model", "tiny", "--hardware", "ascend-910c-die", "--devices", "16", "--seq", "2048"]),
                       ("ascend_ep2", ["--model", "tiny", "--hardware", "ascend-910c-die", "--devices", "16", "--seq",
                                       "2048", "--layout", "dp_shard=16,ep=2"])):
        main(["plan", *args, "--format", "json"])
        plans.append(tmp_path / f"plan_{name}.json")
        plans[-1].write_text(capsys.readouterr().out)
    main(["doctor", "--format", "json"])
    doctor = tmp_path / "doctor.json"
    doctor.write_text(capsys.readouterr().out)
    assert main(["fidelity", "compare", GOLDEN, GOLDEN, "--profile", "bitwise", "--out", str(tmp_path / "cmp")]) == 0
    capsys.readouterr()
    return {"audit": audit, "plans": plans, "doctor": doctor, "compare": tmp_path / "cmp" / "bitwise_vs_default_cpu_fp32.json"}


def test_the_report_gathers_every_input_and_names_its_source(inputs, tmp_path, capsys):
    out = tmp_path / "report"
    code = main(["report", "--out", str(out), "--audit", str(inputs["audit"]), "--doctor", f"laptop={inputs['doctor']}",
                 "--fidelity", str(inputs["compare"]), "--fidelity", os.path.join(EXAMPLE, "inputs", "ladder_bf16"),
                 *[a for p in inputs["plans"] for a in ("--plan", str(p))]])
    assert code == 0, capsys.readouterr().err
    md = (out / "report.md").read_text()
    for heading in ("## Summary", "## Portability audit", "## Environments", "## Convergence fidelity", "## Plans"):
        assert heading in md
    audit = json.loads(inputs["audit"].read_text())
    assert f"{audit['summary']['findings']} findings in {audit['summary']['files_scanned']} files" in md
    fits, too_big = (json.loads(p.read_text()) for p in inputs["plans"][:2])
    assert "The plan fits" in md and "does NOT fit" in md and not too_big["fits"] and fits["fits"]
    assert "No `trex doctor` report from h200-sxm yet" in md  # the laptop is not an H200
    for path in (inputs["audit"], inputs["doctor"], inputs["compare"], *inputs["plans"]):
        assert f"`{path}`" in md  # every input is cited where its numbers are
    assert "compare (bitwise): PASS" in md and "ladder precision.dtype=\"bf16\" (precision): PASS" in md
    images = re.findall(r"!\[[^]]*\]\((images/[^)]+)\)", md)
    assert len(images) == 2 and all((out / i).is_file() for i in images)
    page = check_page(str(out / "report.html"))
    assert len(page.images) == 2


def _summary_paragraphs(md: str) -> dict[str, str]:
    """heading -> paragraph of each target in the report's Summary."""
    summary = md.split("## Summary", 1)[1].split("\n## ", 1)[0]
    parts = re.split(r"^### (.+)$", summary, flags=re.M)[1:]
    return {parts[i]: parts[i + 1].strip() for i in range(0, len(parts), 2)}


def _step_time(seconds: float) -> str:
    scale = next(x for x in (1, 1e-3, 1e-6, 1e-9) if seconds >= x)
    return f"{seconds / scale:.3g}"


def _numbers(text: str) -> list[str]:
    return re.findall(r"(?<![\w.])\d[\d,]*(?:\.\d+)?%?", text)


def test_each_target_states_its_plans_own_numbers_and_only_its_own_evidence(inputs, tmp_path, capsys):
    """Every number in a target's paragraph is its plan's (memory is the plan's total against usable, as
    its verdict judges), the audit's, or part of its heading; the fidelity evidence is attributed to the
    device it was measured on; headings are unique; a CUDA target runs the code as it is."""
    compare = json.loads(inputs["compare"].read_text())
    on_h200 = tmp_path / "compare_h200.json"  # the same comparison, as if both runs were on H200s
    on_h200.write_text(json.dumps({**compare, "devices": {
        side: {"device_type": "cuda", "device_name": "NVIDIA H200"} for side in ("run", "reference")}}))
    out = tmp_path / "report"
    assert main(["report", "--out", str(out), "--audit", str(inputs["audit"]), "--fidelity", str(inputs["compare"]),
                 "--fidelity", str(on_h200), *[a for p in inputs["plans"] for a in ("--plan", str(p))]]) == 0
    capsys.readouterr()
    md = (out / "report.md").read_text()
    paragraphs = _summary_paragraphs(md)
    plans = [json.loads(p.read_text()) for p in inputs["plans"]]
    assert len(paragraphs) == len(plans)  # one heading each
    headings = re.findall(r"^#+ (.+)$", md, flags=re.M)
    assert len(headings) == len(set(headings)), headings
    audit = json.loads(inputs["audit"].read_text())
    blocking = [f for f in audit["findings"] if f["severity"] != "info"]
    audit_numbers = {str(len(blocking)), str(sum(f["severity"] == "error" for f in blocking)),
                     str(sum(f["severity"] == "warning" for f in blocking))}
    audit_numbers |= {str(sum(f["effort"] == e for f in blocking)) for e in ("mechanical", "moderate", "rewrite")}
    audit_numbers.add(str(sum({"mechanical": 1, "moderate": 5, "rewrite": 20}[f["effort"]] for f in blocking)))
    GiB = 2 ** 30
    for plan in plans:
        base = f"{plan['model']} on {plan['layout']['devices']} x {plan['hardware']['name']}, {plan['seq_len']:,}-token sequences"
        heading, = (h for h in paragraphs if h == base or h == f"{base}, {plan['layout']['describe']}")
        para = paragraphs[heading]
        total, usable = plan["memory_bytes"]["total"] / GiB, plan["usable_bytes"] / GiB
        assert f"{total:.1f} of {usable:.1f} GiB per device" in para
        assert ("The plan fits" in para) == plan["fits"] and ("does NOT fit" in para) == (not plan["fits"])
        assert (total <= usable) == plan["fits"]  # the figure stated is the one the verdict judges
        assert f"{plan['global_batch_tokens']:,} tokens per step" in para and plan["layout"]["describe"] in para
        assert f"{100 * plan['mfu']:.1f}% MFU" in para and "e+" not in para
        own = {f"{total:.1f}", f"{usable:.1f}", f"{plan['global_batch_tokens']:,}", f"{100 * plan['mfu']:.1f}%",
               _step_time(plan["time_s"]["total"]), f"{plan['tokens_per_s_per_device']:,.0f}"
               if plan["tokens_per_s_per_device"] >= 1000 else f"{plan['tokens_per_s_per_device']:.3g}"}
        said = re.sub(r"`[^`]*`", "", para).replace(plan["layout"]["describe"], "").replace(plan["hardware"]["name"], "")
        said = re.sub(r"\(on [^)]*\)|compare \(bitwise\)", "", said)
        assert set(_numbers(said)) <= own | audit_numbers, (heading, set(_numbers(said)) - own - audit_numbers)
        if plan["hardware"]["name"] == "h200-sxm":
            assert "The code runs on CUDA as it is" in para and "Fidelity evidence from h200-sxm: compare" in para
        else:
            assert f"Before the code runs on {plan['hardware']['name']}" in para
            assert f"No fidelity evidence from {plan['hardware']['name']} yet" in para and "(on cpu)" in para
            assert "(on NVIDIA H200)" in para


@pytest.mark.parametrize("args, message", [
    (["--plan", "nope.json"], "nope.json: no such file"),
    (["--doctor", "x.json"], "expected CLUSTER=FILE"),
    (["--fidelity", GOLDEN], "not a fidelity result"),
    ([], "nothing to report"),
])
def test_bad_inputs_are_one_line(tmp_path, capsys, args, message):
    assert main(["report", "--out", str(tmp_path / "r"), *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_the_committed_example_is_what_the_committed_inputs_give(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    inputs = "docs/report/inputs"
    assert main(["report", "--out", str(tmp_path / "r"), "--title", "trex: portability report of its own runs",
                 "--audit", f"{inputs}/audit_trex_src.json", "--doctor", f"this CPU machine={inputs}/doctor_cpu.json",
                 "--fidelity", f"{inputs}/ladder_bf16", "--fidelity", f"{inputs}/moving",
                 "--plan", f"{inputs}/plan_pro_h200_512.json", "--plan", f"{inputs}/plan_pro_910c_1024.json"]) == 0
    assert (tmp_path / "r" / "report.md").read_text() == open(os.path.join(EXAMPLE, "report.md")).read()
    assert (tmp_path / "r" / "report.html").read_text() == open(os.path.join(EXAMPLE, "report.html")).read()
    check_page(os.path.join(EXAMPLE, "report.html"))
