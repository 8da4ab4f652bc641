"""docs/planning.md's figures are the planner's: each is written between markers by
trex.plan.docfigures, and a figure that differs from a fresh plan fails here."""

from __future__ import annotations

import os

import pytest

from trex.plan import docfigures

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, "docs", "planning.md")


@pytest.mark.slow
def test_every_figure_in_the_planning_doc_is_the_planners():
    text = open(DOC, encoding="utf-8").read()
    assert len(docfigures.MARK.findall(text)) > 80  # the tables and the prose's numbers
    _, changed = docfigures.render(text)
    assert not changed, "run `python -m trex.plan.docfigures docs/planning.md`:\n" + "\n".join(changed)


def test_a_drifted_figure_is_named_and_rewritten(tmp_path, capsys):
    doc = tmp_path / "p.md"
    args = "--model deepseek-v4-flash --hardware h200-sxm --devices 64 --layout dp_shard=64,ep=64"
    doc.write_text(f"It needs <!--plan {args} | memory_bytes.total/GiB:.1f-->1.0<!--/plan--> GiB and "
                   f"<!--plan {args} | verdict-->fits<!--/plan-->.\n")  # it does not: 319 GiB
    assert docfigures.main([str(doc), "--check"]) == 1
    out = capsys.readouterr().out
    assert "line 1: memory_bytes.total/GiB:.1f" in out and "'1.0' ->" in out and "'fits' -> 'does not fit'" in out
    assert docfigures.main([str(doc)]) == 0 and docfigures.main([str(doc), "--check"]) == 0
    assert "1.0<" not in doc.read_text()


@pytest.mark.parametrize("marker, message", [
    ("<!--plan --model nope --hardware h200-sxm --devices 8 | fits-->x<!--/plan-->", "line 2: trex plan --model nope"),
    ("<!--plan --model tiny --hardware h200-sxm --devices 8 | no.such-->x<!--/plan-->", "the plan has no no.such"),
    ("<!--plan --model tiny --hardware h200-sxm --devices 8 | fits; rm-->x<!--/plan-->", "expected PATH"),
])
def test_a_bad_marker_is_one_line(tmp_path, capsys, marker, message):
    doc = tmp_path / "p.md"
    doc.write_text(f"text\n{marker}\n")
    assert docfigures.main([str(doc), "--check"]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_no_page_says_trex_does_not_build_a_model_it_builds():
    """V3.2 is built (trex.models.deepseek_v3.dsa; tests/test_parity_v32.py): no page may say it is not."""
    import re

    from trex.models.registry import get_preset

    get_preset("deepseek-v3.2")  # the claim would be true again without the preset
    pages = [os.path.join(ROOT, "docs", n) for n in os.listdir(os.path.join(ROOT, "docs")) if n.endswith(".md")]
    said = [(p, m.group(0)) for p in [*pages, os.path.join(ROOT, "README.md")] if os.path.exists(p)
            for m in re.finditer(r"(does not|doesn't|cannot) (yet )?build (the )?(DeepSeek-)?V3\.2[^.]*",
                                 open(p, encoding="utf-8").read())]
    assert not said, said
