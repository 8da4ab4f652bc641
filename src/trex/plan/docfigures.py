"""Figures in a document that come from `trex plan`, so that they cannot drift from the tool.

Each figure sits between markers that say how to make it::

    needs <!--plan --model deepseek-v4-pro --hardware h200-sxm --devices 512 | memory_bytes.total/GiB:.1f-->94.4<!--/plan--> GiB

Before the ``|``: the arguments of ``trex plan`` (``--format json`` is added). After it: a path into
the plan's JSON (dotted keys; a number indexes a ``--search`` list) with an optional scale (``/GiB``,
``/1e9``, ``*100``) and format spec (``:.1f``, ``:,.0f``), or ``[PATH.]verdict`` ("fits" / "does
not fit").
Markdown renders the markers as nothing, so the prose reads as plain text.

    python -m trex.plan.docfigures docs/planning.md           # rewrite every figure from fresh plans
    python -m trex.plan.docfigures docs/planning.md --check   # exit 1 naming each figure that differs

Each distinct command is planned once per run.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import shlex
import sys

from trex import atomic

MARK = re.compile(r"<!--plan (?P<args>[^|>]+?) \| (?P<field>[^>]+?)-->(?P<value>.*?)<!--/plan-->", re.S)
FIELD = re.compile(r"^(?P<path>[\w.]+)(?:(?P<op>[/*])(?P<by>GiB|[\d.e+-]+))?(?::(?P<spec>[^:]+))?$")
SCALES = {"GiB": 2.0 ** 30}


class FigureError(ValueError):
    """A marker that cannot be evaluated: its line, the command or field, and why."""


def plan_json(args: str) -> object:
    """What ``trex plan ARGS --format json`` prints, planned in this process."""
    from trex.plan.cli import register

    parser = argparse.ArgumentParser(prog="trex")
    register(parser.add_subparsers())
    parsed = parser.parse_args(["plan", *shlex.split(args), "--format", "json"])
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = parsed.func(parsed)
    if code == 2:
        raise FigureError(f"trex plan {args}: {err.getvalue().strip()}")
    return json.loads(out.getvalue())


def _at(data: object, path: str, field: str) -> object:
    value = data
    for key in path.split(".") if path else []:
        try:
            value = value[int(key)] if key.isdigit() else value[key]
        except (KeyError, IndexError, TypeError):
            raise FigureError(f"field {field!r}: the plan has no {path}") from None
    return value


def figure(data: object, field: str) -> str:
    """The text of one figure: ``field`` (see the module docstring) evaluated on a plan's JSON."""
    field = field.strip()
    if field == "verdict" or field.endswith(".verdict"):
        return "fits" if _at(data, field[: -len("verdict")].rstrip("."), field)["fits"] else "does not fit"
    m = FIELD.match(field)
    if not m:
        raise FigureError(f"field {field!r}: expected PATH[/GiB|/NUMBER|*NUMBER][:FORMAT] or [PATH.]verdict")
    value = _at(data, m["path"], field)
    if m["op"]:
        by = SCALES.get(m["by"]) or float(m["by"])
        value = value / by if m["op"] == "/" else value * by
    return format(value, m["spec"] or "")


def render(text: str) -> tuple[str, list[str]]:
    """``text`` with every figure made afresh, and one line per figure that changed (``line: was -> is``)."""
    plans: dict[str, object] = {}
    changed: list[str] = []

    def fresh(m: re.Match) -> str:
        line = text.count("\n", 0, m.start()) + 1
        args = " ".join(m["args"].split())
        try:
            if args not in plans:
                plans[args] = plan_json(args)
            value = figure(plans[args], m["field"])
        except FigureError as e:
            raise FigureError(f"line {line}: {e}") from None
        if value != m["value"]:
            changed.append(f"line {line}: {m['field'].strip()} of `trex plan {args}`: {m['value']!r} -> {value!r}")
        return f"<!--plan {m['args']} | {m['field']}-->{value}<!--/plan-->"

    return MARK.sub(fresh, text), changed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trex.plan.docfigures", description=__doc__.split("\n\n")[0])
    p.add_argument("path", help="a Markdown file with <!--plan ... | FIELD-->VALUE<!--/plan--> figures")
    p.add_argument("--check", action="store_true", help="change nothing; exit 1 if a figure differs")
    args = p.parse_args(argv)
    try:
        text = open(args.path, encoding="utf-8").read()
        new, changed = render(text)
    except (OSError, FigureError) as e:
        print(f"{args.path}: {e}", file=sys.stderr)
        return 2
    for line in changed:
        print(f"{args.path}: {line}")
    if args.check:
        return 1 if changed else 0
    if changed:
        atomic.write_text(args.path, new)
    print(f"{args.path}: {len(MARK.findall(new))} figures, {len(changed)} changed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
