"""`--help` says what every option is and what it defaults to; user messages read as written by hand.

The walk starts at the real `trex` parser and finds every subcommand (nested ones too) from the
parser itself, so a command added later is checked without being listed here.
"""

from __future__ import annotations

import argparse

import pytest

from trex import logs
from trex.cli import build_parser, main


def commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ("trex",)):
    """(command words, parser) of ``parser`` and every subcommand below it, depth first."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from commands(sub, (*path, name))


def option(path: tuple[str, ...], flag: str) -> argparse.Action:
    parser = dict(commands(build_parser()))[path]
    return parser._option_string_actions[flag]


def has_default(action: argparse.Action) -> bool:
    """An option whose value, when it is not given, is something (not None, off, empty)."""
    return not (action.default is None or action.default is False or action.default == [] or action.default == ""
                or action.default is argparse.SUPPRESS)


def help_problems(path: tuple[str, ...], parser: argparse.ArgumentParser) -> list[str]:
    """What is missing from one command's help: an option or subcommand without help text, an
    option whose help does not show its default."""
    problems, formatter = [], parser._get_formatter()
    command = " ".join(path)
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        if isinstance(action, argparse._SubParsersAction):
            problems += [f"{command} {sub.dest}: no help text" for sub in action._choices_actions if not sub.help]
            continue
        name = "/".join(action.option_strings) or action.dest
        text = formatter._expand_help(action) if action.help else ""  # %(default)s filled in
        if not text.strip():
            problems.append(f"{command} {name}: no help text")
        elif has_default(action) and not ("default" in text and str(action.default) in text):
            problems.append(f"{command} {name}: the help does not show the default {action.default!r}: {text!r}")
    return problems


def test_every_option_of_every_command_has_help_with_its_default():
    bad = argparse.ArgumentParser(prog="x")  # first, that the check sees what it should
    sub = bad.add_subparsers().add_parser("y", help="a command")
    sub.add_argument("--bare", default=None)
    sub.add_argument("--hidden", type=int, default=7, help="how many")
    sub.add_argument("--shown", type=int, default=7, help="how many (default: %(default)s)")
    sub.add_argument("--flag", action="store_true", help="a switch, off unless given")
    assert [p for path, parser in commands(bad, ("x",)) for p in help_problems(path, parser)] == [
        "x y --bare: no help text", "x y --hidden: the help does not show the default 7: 'how many'"]

    found = list(commands(build_parser()))
    assert {("trex", "ckpt", "convert"), ("trex", "data", "prepare"), ("trex", "fidelity", "compare")} <= {
        path for path, _ in found}  # the walk reaches nested subcommands
    problems = [p for path, parser in found for p in help_problems(path, parser)]
    assert problems == [], "\n".join(problems)
    for _, parser in found:
        parser.format_help()  # every help string formats (a stray % would raise here)


def test_plan_help_states_the_planners_own_assumptions():
    from trex.plan.timing import TimeAssumptions

    assume = TimeAssumptions()
    for flag, value in (("--efficiency", assume.compute_efficiency), ("--fsdp-overlap", assume.fsdp_overlap),
                        ("--ep-overlap", assume.ep_overlap)):
        assert option(("trex", "plan"), flag).help.endswith(f"(default: {value:g})"), flag


def test_every_profile_option_offers_every_fidelity_profile():
    from trex.fidelity.profiles import PROFILES

    assert "migration" in PROFILES
    profiles = [(path, parser._option_string_actions["--profile"]) for path, parser in commands(build_parser())
                if "--profile" in parser._option_string_actions]
    assert ("trex", "fidelity", "compare") in [path for path, _ in profiles]
    for path, action in profiles:
        assert list(action.choices) == list(PROFILES), path


def test_launch_help_describes_trex_launcher_before_torchruns_options(capsys):
    from trex.launch import SHUTDOWN_TIMEOUT_S, TREX_EXIT_CODES

    with pytest.raises(SystemExit) as done:
        main(["launch", "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    torchrun_options = out.index("\n  --nproc-per-node")  # its entry in the option list, not the usage line
    table = out.index("exit codes:")
    assert out.index("torchrun for trex commands") < table < torchrun_options
    for code, meaning in [*TREX_EXIT_CODES.items(), ("0", "every rank completed"), ("128+N", "143 SIGTERM")]:
        at = out.index(meaning)
        assert table < at < torchrun_options and str(code) in out[out.rindex("\n", 0, at):at], code
    assert f"defaults to {SHUTDOWN_TIMEOUT_S} s" in out and "COMMAND" in out


@pytest.mark.parametrize("command", ["convert", "export"])
def test_ckpt_errors_name_their_command(command, tmp_path, capsys):
    assert main(["ckpt", command, str(tmp_path / "missing"), str(tmp_path / "out"), "--layout", "hf"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"trex ckpt {command}: ") and err.count("\n") == 1 and "Traceback" not in err, err


def test_a_count_of_one_is_singular(tmp_path, capsys):
    from trex.data.records import describe_skips

    assert [logs.plural(n, "rank") for n in (0, 1, 2, 1200)] == ["0 ranks", "1 rank", "2 ranks", "1,200 ranks"]
    assert logs.plural(1, "process", "processes") == "1 process" and logs.plural(3, "process", "processes") == \
        "3 processes"
    assert describe_skips({"skipped": 1, "skipped_by_reason": {"malformed_json": 1}, "truncated": 1,
                           "first_seen": {"malformed_json": "a.jsonl:3", "truncated": "a.jsonl:4"}}) == (
        "skipped 1 bad record: 1 malformed_json (first a.jsonl:3); truncated 1 record to seq_len (first a.jsonl:4)")
    one = tmp_path / "one.py"
    one.write_text("x = 1\n")
    assert main(["audit", str(one), "--no-config"]) == 0
    assert "0 findings (0 errors, 0 warnings, 0 info) in 1 file scanned" in capsys.readouterr().out
