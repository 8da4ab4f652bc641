"""`trex report --out DIR [--audit F] [--doctor NAME=F ...] [--fidelity PATH ...] [--plan F ...] [--drafter RUN ...]`."""

from __future__ import annotations

import argparse
import os
import shutil
import sys

from trex import atomic, logs


def register(sub) -> None:
    p = sub.add_parser("report", help="one portability report (Markdown + self-contained HTML) from the audit, "
                                      "doctor, fidelity and plan outputs")
    p.add_argument("--out", required=True, help="directory for report.md, report.html and the plots")
    p.add_argument("--title", default="Portability report", help="the report's title (default: %(default)s)")
    p.add_argument("--audit", help="`trex audit CODE --format json -o FILE` output")
    p.add_argument("--doctor", action="append", default=[], metavar="CLUSTER=FILE",
                   help="`trex doctor --format json` output of one cluster; repeatable")
    p.add_argument("--fidelity", action="append", default=[], metavar="PATH",
                   help="a fidelity matrix/ladder --out, a run judged by `trex fidelity seam`, or a compare report "
                        "JSON; repeatable")
    p.add_argument("--plan", action="append", default=[], metavar="FILE",
                   help="`trex plan ... --format json` output of one target cluster; repeatable")
    p.add_argument("--drafter", action="append", default=[], metavar="RUN",
                   help="a `trex train` run directory whose [drafter] re-fitted its drafter: acceptance (a), (b), (c) "
                        "and the re-fit's cost; repeatable")
    p.set_defaults(func=_report)


def write(out: str, title: str, audit: str | None, doctors: list[str], fidelity: list[str], plans: list[str],
          refits: list[str] = ()) -> dict:
    """Read the inputs, write ``out/report.md``, ``out/report.html`` and ``out/images/``; returns their paths."""
    from trex.report.document import build, markdown
    from trex.report.html import render
    from trex.report.sources import ReportInputError, read_audit, read_doctor, read_drafter, read_fidelity, read_plan

    if not (audit or doctors or fidelity or plans or refits):
        raise ReportInputError("nothing to report: give --audit, --doctor, --fidelity, --plan or --drafter")
    parsed = []
    for item in doctors:
        label, sep, path = item.partition("=")
        if not sep or not label:
            raise ReportInputError(f"--doctor {item!r}: expected CLUSTER=FILE")
        parsed.append(read_doctor(label, path))
    blocks = build(title, read_audit(audit) if audit else None, parsed, [read_fidelity(p) for p in fidelity],
                   [read_plan(p) for p in plans], [read_drafter(p) for p in refits])
    os.makedirs(os.path.join(out, "images"), exist_ok=True)
    copies: dict[str, str] = {}

    def image(png: str) -> str:  # a copy next to report.md, named uniquely
        if png not in copies:
            name = f"{len(copies):02d}_{os.path.basename(png)}"
            shutil.copyfile(png, os.path.join(out, "images", name))
            copies[png] = f"images/{name}"
        return copies[png]

    paths = {"md": os.path.join(out, "report.md"), "html": os.path.join(out, "report.html")}
    atomic.write_text(paths["md"], markdown(blocks, image))
    atomic.write_text(paths["html"], render(blocks, title))
    return paths


def _report(args: argparse.Namespace) -> int:
    from trex.report.sources import ReportInputError

    try:
        paths = write(args.out, args.title, args.audit, args.doctor, args.fidelity, args.plan, args.drafter)
    except ReportInputError as e:
        print(f"trex report: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"trex report: {logs.os_error_line(e)}", file=sys.stderr)
        return 2
    print(f"report: {paths['md']}  {paths['html']}")
    return 0
