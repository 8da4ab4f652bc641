"""Every shell command in README.md and docs/*.md works as written.

The fenced ```bash blocks of each document run in order in a sandbox of their own (the repo's
.venv, src/ and copies of recipes/ and fidelity/), with `trex` on PATH. A block preceded by

    <!-- doc-test: skip: REASON -->

is not run (it needs a cluster or an accelerator, or minutes of training that another test
covers), but its commands are still checked as far as they can be here: a trex command parses
(subcommand, flags and values, through trex's own argparse and torchrun's), a script or make
target it names exists. The placeholders SRC, DST, PATH, RUN, REFERENCE and path/to/... stand for
what the sandbox provides: a tiny HF checkpoint, a fresh destination, the committed golden fidelity
file (as a run and as its reference), the trex sources. `recipe.toml` is a copy of recipes/fidelity_default.toml (20 steps)
writing to runs/x. The sandbox's `trex` (bare or `.venv/bin/trex`) is a child forked from one process that
has imported trex (tests/trex_zygote.py): the shell line, its pipes, redirections and exit code are as
written, without ~3.5 CPU seconds of imports per command.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re
import shlex
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest
import trex_zygote

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["README.md", *sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))]
SKIP = re.compile(r"<!--\s*doc-test:\s*skip:\s*(?P<reason>.*?)\s*-->")
FENCE = re.compile(r"^```(?P<lang>\w*)\s*$")
PLACEHOLDERS = {  # whole words in a command -> what the sandbox has there
    "SRC": "hf_tiny", "DST": "dst", "PATH": "hf_tiny", "RUN": "fidelity/golden/default_cpu_fp32.json",
    "REFERENCE": "fidelity/golden/default_cpu_fp32.json",
    "path/to/your/training/code": "src", "path/to/stack": "src",
}
LONG_S = 120  # a runnable block whose commands take more CPU seconds than this should be marked and covered
# by a focused test (CPU time, not wall time: under `make test` another test worker shares the cores)
CPU_TIMES = "\n__rc=$?; times >&2; exit $__rc"  # bash's `times`: its own, then its children's user and sys
_TIMES = re.compile(r"^(\d+)m([\d.]+)s (\d+)m([\d.]+)s$")


@dataclasses.dataclass
class Block:
    doc: str
    line: int  # 1-based line of the opening fence
    commands: list[str]
    skip: str | None  # the marker's reason


def blocks(doc: str) -> list[Block]:
    """The ```bash blocks of ``doc``, each as its commands (continuations and heredocs joined)."""
    lines = open(os.path.join(ROOT, doc), encoding="utf-8").read().splitlines()
    found, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start, j = i, i + 1
        while not FENCE.match(lines[j]):
            j += 1
        if m["lang"] in ("bash", "sh"):
            prev = next((lines[k] for k in range(start - 1, -1, -1) if lines[k].strip()), "")
            skip = SKIP.search(prev)
            found.append(Block(doc, start + 1, commands(lines[start + 1:j]), skip["reason"] if skip else None))
        i = j + 1
    return found


def commands(body: list[str]) -> list[str]:
    out, pending, heredoc = [], "", None
    for line in body:
        if heredoc is not None:
            pending += "\n" + line
            if line.strip() == heredoc:
                out.append(pending)
                pending, heredoc = "", None
            continue
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        pending = f"{pending} {line.strip()}" if pending else line.strip()
        if pending.endswith("\\"):
            pending = pending[:-1].rstrip()
            continue
        h = re.search(r"<<-?'?(\w+)'?", pending)
        if h:
            heredoc = h.group(1)
            continue
        out.append(pending)
        pending = ""
    assert not pending and heredoc is None, f"unterminated command: {pending!r}"
    return out


def substitute(cmd: str) -> str:
    for word, value in PLACEHOLDERS.items():
        cmd = re.sub(rf"(?<![\w/.-]){re.escape(word)}(?![\w/])", value, cmd)
    return cmd


def check_parses(cmd: str) -> None:
    """What can be checked of a command that is not run: it parses, and what it names exists."""
    from trex.cli import build_parser
    from trex.launch import torchrun_args

    tokens = shlex.split(substitute(cmd).split("<<")[0], comments=True)
    for i, token in enumerate(tokens):  # `A || test $? -eq 1` (an expected exit code): A is the command
        if token in ("||", "&&", "|", ";"):
            tokens = tokens[:i]
            break
    while tokens and re.match(r"^[A-Z_]+=", tokens[0]):
        tokens.pop(0)
    head, rest = os.path.basename(tokens[0]), tokens[1:]
    if head == "python" and rest[:2] == ["-m", "torch.distributed.run"]:
        head, rest = "torchrun", rest[2:]
    if head == "torchrun":
        from torch.distributed.run import get_args_parser

        args = get_args_parser().parse_args(rest)
        assert args.module and args.training_script == "trex", f"`{cmd}` does not run trex"
        head, rest = "trex", args.training_script_args
    elif head == "trex" and rest[:1] == ["launch"]:
        rest = torchrun_args(rest[1:]).training_script_args
    if head == "trex":
        try:
            build_parser().parse_args(rest)
        except SystemExit as e:
            raise AssertionError(f"`{cmd}` does not parse (exit {e.code})") from None
    elif head == "make":
        targets = re.findall(r"^([\w-]+):", open(os.path.join(ROOT, "Makefile")).read(), re.M)
        assert rest[0] in targets, f"make {rest[0]}: no such target"
    elif head in ("bash", "sbatch", "python", "python3"):
        script = next((t for t in rest if t.endswith((".sh", ".py"))), None)
        if script:
            assert os.path.exists(os.path.join(ROOT, script)), f"{script}: no such file"


def sandbox(path: str, zygote: str | None = None) -> dict:
    """A working directory shaped like a checkout, and the environment to run commands in it. With
    ``zygote`` (a tests/trex_zygote.py server's socket) its ``.venv/bin/trex`` is that server's client:
    each command is a child forked from a process that has imported trex (tests/trex_zygote.py)."""
    venv = os.path.join(ROOT, ".venv")
    if zygote is None:
        os.symlink(venv, os.path.join(path, ".venv"))
    else:
        os.makedirs(os.path.join(path, ".venv", "bin"))
        for name in os.listdir(venv):
            if name != "bin":
                os.symlink(os.path.join(venv, name), os.path.join(path, ".venv", name))
        for name in os.listdir(os.path.join(venv, "bin")):
            if name != "trex":
                os.symlink(os.path.join(venv, "bin", name), os.path.join(path, ".venv", "bin", name))
        trex_zygote.write_client(os.path.join(path, ".venv", "bin"))
    os.symlink(os.path.join(ROOT, "src"), os.path.join(path, "src"))
    for name in ("recipes", "fidelity", "scripts", "bench", "Makefile", "pyproject.toml", "trex-audit.toml"):
        src = os.path.join(ROOT, name)
        (shutil.copytree if os.path.isdir(src) else shutil.copy)(src, os.path.join(path, name))
    text = open(os.path.join(ROOT, "recipes", "fidelity_default.toml")).read()
    text = re.sub(r'(?m)^out = .*$', 'out = "runs/x"', text)
    with open(os.path.join(path, "recipe.toml"), "w") as f:
        f.write(text)
    env = {**os.environ, "PATH": f"{os.path.join(path, '.venv', 'bin')}:{os.environ['PATH']}",
           "OMP_NUM_THREADS": "1", "COLUMNS": "100"}
    if zygote is not None:
        env.update(TREX_ZYGOTE=zygote, TREX_ZYGOTE_CPU=os.path.join(path, ".zygote-cpu"))
    return env


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """What the placeholders name, built once: a tiny HF checkpoint (RUN is the committed golden file)."""
    d = tmp_path_factory.mktemp("doc-assets")
    from trex.checkpoint import save_pretrained
    from trex.models import build_model
    from trex.models.deepseek_v4.config import tiny

    save_pretrained(build_model(tiny(), seed=0), d / "hf_tiny", layout="hf", dtype="fp32")
    return d


def test_the_documents_have_commands_and_the_markers_give_reasons():
    every = [b for doc in DOCS for b in blocks(doc)]
    assert len(every) > 20 and sum(len(b.commands) for b in every) > 60
    assert all(b.skip for b in every if b.skip is not None), "a skip marker needs a reason"
    assert sum(b.skip is None for b in every) > len(every) / 3  # most documented commands run


def test_skipped_commands_still_parse():
    checked = 0
    for doc in DOCS:
        for b in blocks(doc):
            if b.skip is not None:
                for cmd in b.commands:
                    try:
                        check_parses(cmd)
                    except AssertionError as e:
                        raise AssertionError(f"{doc}:{b.line}: {e}") from None
                    checked += 1
    assert checked > 10


def run_doc(doc: str, assets, sandbox_dir, zygote: str | None = None) -> str | None:
    """Run the runnable blocks of ``doc`` in order in a fresh sandbox; None, or what went wrong."""
    os.makedirs(sandbox_dir)
    env = sandbox(str(sandbox_dir), zygote)
    shutil.copytree(assets / "hf_tiny", os.path.join(sandbox_dir, "hf_tiny"))
    for b in blocks(doc):
        if b.skip is not None:
            continue
        took = 0.0
        for cmd in b.commands:
            proc = subprocess.run(["bash", "-c", substitute(cmd) + CPU_TIMES], cwd=sandbox_dir, env=env,
                                  capture_output=True, text=True, timeout=LONG_S * 4)
            if proc.returncode != 0:
                return f"{doc}:{b.line}: `{cmd}` exited {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
            children = _TIMES.match(proc.stderr.rstrip().splitlines()[-1])
            took += 60 * int(children[1]) + float(children[2]) + 60 * int(children[3]) + float(children[4])
            if zygote is not None and os.path.exists(env["TREX_ZYGOTE_CPU"]):  # the zygote's children
                with open(env["TREX_ZYGOTE_CPU"]) as f:
                    took += sum(float(line) for line in f)
                os.remove(env["TREX_ZYGOTE_CPU"])
        if took > LONG_S:
            return f"{doc}:{b.line}: the block took {took:.0f} CPU seconds; mark it and test it elsewhere"
    return None


@pytest.mark.slow
def test_documented_commands_run(assets, tmp_path):
    # each document in its own sandbox, two at a time (each command runs on one thread); every `trex` a child of
    # one warm process (tests/trex_zygote.py), which spares each ~3.5 CPU seconds of imports: the one that
    # tests/trex_run.py starts for this test process (one thread, as the documents' commands), not one more
    from trex_run import zygote_socket

    docs = [d for d in DOCS if any(b.skip is None for b in blocks(d))]
    zygote = zygote_socket()
    with ThreadPoolExecutor(max_workers=min(2, os.cpu_count() or 1)) as pool:
        failures = [f for f in pool.map(lambda d: run_doc(d, assets, tmp_path / d.replace("/", "_"), zygote), docs)
                    if f]
    assert not failures, "\n\n".join(failures)


@pytest.mark.parametrize("cmd", ["trex train recipe.toml --steps-per-save 3", "trex ckpt convrt SRC DST",
                                 "torchrun --nproc-per-node 8 -m trex train r.toml --no-such-flag",
                                 "trex launch --nproc-per-node 2 bogus", "make bogus", "bash bench/nothing.sh"])
def test_a_drifted_command_is_caught(cmd, capsys):
    with pytest.raises((AssertionError, SystemExit)):
        check_parses(cmd)
