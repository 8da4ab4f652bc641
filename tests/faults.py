"""Fault injection for trex: real processes, one fault per trial, timings drawn from a seeded RNG.

Each fault in `FAULTS` is a function ``(lab, rng) -> str`` that injects one fault into real
``trex train`` / ``trex launch`` processes (a few, where a test double would prove nothing, into
``trex.cli.main`` in this process) and asserts the outcome; it returns what it injected and saw. What no
fault touches (the uninterrupted reference runs, a run's resume after its fault) runs at the least CPU through
tests/trex_run.py. The outcome is one of two:

- recovered: the run, stopped by the fault and resumed, ends with every tensor of its final
  checkpoint (weights, optimizer moments) bitwise equal to an uninterrupted run's, and with a
  metrics.jsonl that holds each step once, equal to that run's;
- refused: the fault ends the run with one clean line naming it (the file, the rank, the path), no
  traceback, and the documented exit code (2 user error, 3 non-finite stop, 4 a rank stopped
  answering, 128 + signal).

tests/test_faults.py runs every fault once (slow marker); this file as a script reruns the table of
docs/reliability.md:

    .venv/bin/python tests/faults.py --trials 3 --write docs/reliability.md
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import os
import random
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from unittest import mock

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from arithmetic_data import write_sft
from trex.checkpoint.training import list_checkpoints
from trex.checkpoint.manifest import MANIFEST, SafeFileSystemReader, verify_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS, SAVE_EVERY = 9, 3  # every fault trial: 9 steps, a checkpoint (and an evaluation) every 3
COMPARED = ("loss", "mtp_loss", "grad_norm", "lr", "loss_scale", "tokens", "skipped_steps", "eval_loss")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TREX_DEVICE": "cpu", "PYTHONUNBUFFERED": "1"}


class Failed(AssertionError):
    """A trial whose outcome was not the promised one."""


def check(condition: bool, message: str) -> None:
    if not condition:
        raise Failed(message)


# ---- what a run left behind -------------------------------------------------------------------------
def metrics(out: str) -> list[dict]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def curve(out: str) -> dict[int, dict]:
    """Step -> compared values; asserts each step appears once, in order (a clean curve)."""
    rows = metrics(out)
    steps = [r["step"] for r in rows]
    check(steps == sorted(set(steps)), f"{out}/metrics.jsonl: steps not each once in order: {steps}")
    return {r["step"]: {k: r.get(k) for k in COMPARED} for r in rows}


def checkpoint_tensors(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of a training checkpoint (model and optimizer state), read with DCP."""
    meta = SafeFileSystemReader(path).read_metadata().state_dict_metadata
    tensors = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype)
               for k, m in meta.items() if isinstance(m, TensorStorageMetadata)}
    dcp.load(tensors, storage_reader=SafeFileSystemReader(path), no_dist=True)
    return tensors


def final_tensors(out: str) -> dict[str, torch.Tensor]:
    (step, path), *_ = reversed(list_checkpoints(os.path.join(out, "checkpoints")))
    check(step == STEPS and verify_checkpoint(path).ok, f"{out}: no verified final checkpoint (newest: {path})")
    return checkpoint_tensors(path)


@dataclasses.dataclass
class Reference:
    out: str
    curve: dict[int, dict]
    tensors: dict[str, torch.Tensor]

    def matches(self, out: str) -> str:
        """Assert ``out`` ended bitwise equal to this uninterrupted run; describe what was compared."""
        got = curve(out)
        check(got == self.curve, f"{out}: metrics differ from the uninterrupted run at steps "
                                 f"{[s for s in self.curve if got.get(s) != self.curve[s]]}")
        tensors = final_tensors(out)
        check(tensors.keys() == self.tensors.keys(), f"{out}: the final checkpoint holds other tensors")
        differ = [k for k in tensors if not torch.equal(tensors[k], self.tensors[k])]
        check(not differ, f"{out}: {len(differ)} tensors differ from the uninterrupted run, e.g. {differ[:3]}")
        return f"{len(tensors)} tensors and {len(got)} steps bitwise equal"


# ---- processes --------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """A trex process with its output collected by a thread (so a full pipe never blocks it)."""

    def __init__(self, argv: list[str], preexec_fn=None):
        self.popen = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV,
                                      cwd=ROOT, start_new_session=True, preexec_fn=preexec_fn)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.popen.stdout:
            self.lines.append(line.rstrip("\n"))

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def wait(self, timeout: float = 300) -> int:
        try:
            code = self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.popen.pid, signal.SIGKILL)
            raise Failed(f"still running after {timeout}s:\n{self.output[-3000:]}") from None
        self._reader.join(timeout=10)
        return code

    def wait_until(self, predicate, what: str, timeout: float = 240) -> None:
        deadline = time.time() + timeout
        while not predicate():
            check(self.popen.poll() is None, f"exited ({self.popen.returncode}) before {what}:\n{self.output[-3000:]}")
            check(time.time() < deadline, f"no {what} within {timeout}s")
            time.sleep(0.005)

    def rank_pid(self, rank: int) -> int:
        """The pid of torchrun's worker with RANK=rank (a child of this launcher)."""
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
                with open(f"/proc/{pid}/environ", "rb") as f:
                    env = f.read().split(b"\0")
            except OSError:
                continue
            if parent == self.popen.pid and f"RANK={rank}".encode() in env:
                return int(pid)
        raise Failed(f"no rank {rank} under launcher {self.popen.pid}")


def steps_logged(out: str) -> int:
    try:
        with open(os.path.join(out, "metrics.jsonl")) as f:
            return sum(1 for _ in f)
    except FileNotFoundError:
        return 0


def no_traceback(proc_output: str) -> None:
    check("Traceback" not in proc_output, f"a traceback reached the user:\n{proc_output[-3000:]}")


# ---- the lab: data, recipe, uninterrupted references -----------------------------------------------
class Lab:
    """A directory with a small arithmetic SFT data set, a recipe (STEPS steps, a held-out evaluation
    and a checkpoint every SAVE_EVERY) and the uninterrupted reference runs, made on first use."""

    def __init__(self, root: str):
        self.root = root
        self._refs: dict[int, Reference] = {}
        self._runs = 0
        write_sft(root, n_train=300, held_out="held_out.jsonl")
        self.recipe = os.path.join(root, "recipe.toml")
        with open(self.recipe, "w") as f:
            f.write(f"""
[data]
paths = ["{root}/sft.jsonl"]
tokenizer = "compact"
seq_len = 32
micro_batch_size = 2
[train]
steps = {STEPS}
progress = false
eval_every = 3
[eval]
paths = ["{root}/held_out.jsonl"]
batches = 1
[optim]
lr = 3e-3
[schedule]
warmup_steps = 3
[checkpoint]
save_every = {SAVE_EVERY}
keep_last = 0
[parallel]
heartbeat_timeout_s = 5
[model]
overrides = {{ sliding_window = 16 }}
""")

    def new_out(self, name: str) -> str:
        self._runs += 1
        return os.path.join(self.root, f"{self._runs:03d}-{name}")

    def train(self, out: str, *args: str, world: int = 1, preexec_fn=None, launcher: tuple[str, ...] = ()) -> Proc:
        """``trex train`` of the recipe into ``out``; ``world`` > 1: under ``trex launch`` (with the
        torchrun flags ``launcher``)."""
        if world == 1:
            argv = [sys.executable, "-m", "trex", "train"]
        else:
            argv = [sys.executable, "-m", "trex", "launch", f"--nproc-per-node={world}", f"--master-port={free_port()}",
                    "--shutdown-timeout=10", *launcher, "train"]
        return Proc([*argv, self.recipe, "--out", out, *args], preexec_fn=preexec_fn)

    def _quiet_train(self, out: str, *args: str, world: int = 1) -> list[str]:
        """``trex train`` of the recipe into ``out`` where nothing is injected, at the least CPU
        (tests/trex_run.py: one rank in this process, more forked from a warm one, one compute thread each as
        in the trials' processes, so the same steps bit for bit); asserts it succeeded, returns its output lines."""
        from trex_run import trex

        proc = trex(["train", self.recipe, "--out", out, *args], procs=world, env={"TREX_DEVICE": "cpu"}, cwd=ROOT)
        check(proc.returncode == 0, f"the run into {out} failed:\n{proc.stderr[-3000:]}")
        return (proc.stdout + proc.stderr).splitlines()

    def reference(self, world: int = 1) -> Reference:
        """The uninterrupted run on ``world`` ranks."""
        if world not in self._refs:
            out = self.new_out(f"reference-{world}")
            self._quiet_train(out, world=world)
            self._refs[world] = Reference(out, curve(out), final_tensors(out))
        return self._refs[world]

    def resume(self, out: str, world: int = 1) -> list[str]:
        """``--resume auto`` of a run a fault stopped, to its end (the fault is over: the resumed run is an
        ordinary one); its output lines."""
        return self._quiet_train(out, "--resume", "auto", world=world)


def newest_verified(out: str) -> int:
    ok = [s for s, p in list_checkpoints(os.path.join(out, "checkpoints")) if verify_checkpoint(p).ok]
    return max(ok, default=0)


# ---- faults: signals --------------------------------------------------------------------------------
def kill9_process(lab: Lab, rng: random.Random) -> str:
    ref, at = lab.reference(), rng.randint(2, STEPS - 1)
    out = lab.new_out("kill9-process")
    proc = lab.train(out)
    proc.wait_until(lambda: steps_logged(out) >= at, f"step {at}")
    os.kill(proc.popen.pid, signal.SIGKILL)
    check(proc.wait() == -signal.SIGKILL, "not killed")
    killed_at, resumed_from = steps_logged(out), newest_verified(out)
    lab.resume(out)
    return f"SIGKILL after step {killed_at}, resumed from step {resumed_from}: {ref.matches(out)}"


def kill9_rank(lab: Lab, rng: random.Random) -> str:
    ref, at, rank = lab.reference(2), rng.randint(2, STEPS - 1), rng.randint(0, 1)
    out = lab.new_out("kill9-rank")
    proc = lab.train(out, world=2)
    proc.wait_until(lambda: steps_logged(out) >= at, f"step {at}")
    os.kill(proc.rank_pid(rank), signal.SIGKILL)
    code = proc.wait()
    check(code != 0, "the launcher reported success after a rank was killed")
    killed_at, resumed_from = steps_logged(out), newest_verified(out)
    lab.resume(out, 2)
    return (f"SIGKILL of rank {rank} after step {killed_at} (launcher exit {code}), resumed from step "
            f"{resumed_from}: {ref.matches(out)}")


def kill9_rank_restarted(lab: Lab, rng: random.Random) -> str:
    """One rank killed while step N is saved, under ``trex launch --max-restarts 1 ... --resume auto``:
    torchrun restarts both ranks, which resume from the checkpoint before N (N's if it was published)."""
    ref, rank = lab.reference(2), rng.randint(0, 1)
    save = rng.choice(range(2 * SAVE_EVERY, STEPS, SAVE_EVERY))  # a checkpoint before it: never from step 0
    out = lab.new_out("kill9-rank-restarted")
    ckpts = os.path.join(out, "checkpoints")
    proc = lab.train(out, "--resume", "auto", world=2, launcher=("--standalone", "--max-restarts=1"))
    proc.wait_until(lambda: steps_logged(out) >= 1, "step 1")
    first = [proc.rank_pid(r) for r in (0, 1)]
    proc.wait_until(lambda: os.path.exists(os.path.join(ckpts, f".tmp.step_{save}")), f"the save of step {save}")
    os.kill(first[rank], signal.SIGKILL)
    proc.wait_until(lambda: all(map(_exited, first)), "the end of the first attempt", timeout=60)
    resumed_from = newest_verified(out)  # what the restart finds
    check(resumed_from in (save - SAVE_EVERY, save), f"newest verified checkpoint {resumed_from}")
    code = proc.wait(timeout=180)
    check(code == 0, f"trex launch exit {code} after the restart:\n{proc.output[-3000:]}")
    said = [x for x in proc.lines if "resumed from" in x]
    check(len(said) == 1 and said[0].endswith(f"step_{resumed_from} at step {resumed_from}"),
          f"the restart did not resume from step {resumed_from}: {said}")
    return (f"SIGKILL of rank {rank} during the save of step {save}; torchrun restarted both ranks, which resumed "
            f"from step {resumed_from}: {ref.matches(out)}")


def _sigterm_until_exit(proc: Proc, pid: int, group: bool) -> int:
    """SIGTERM, then a follow-up SIGTERM every 50 ms until the process exits (as schedulers do)."""
    deadline = time.time() + 120
    while proc.popen.poll() is None and time.time() < deadline:
        os.killpg(pid, signal.SIGTERM) if group else os.kill(pid, signal.SIGTERM)
        time.sleep(0.05)
    return proc.wait()


def sigterm_process(lab: Lab, rng: random.Random) -> str:
    ref, at = lab.reference(), rng.randint(2, STEPS - 1)
    out = lab.new_out("sigterm-process")
    proc = lab.train(out)
    proc.wait_until(lambda: steps_logged(out) >= at, f"step {at}")
    code = _sigterm_until_exit(proc, proc.popen.pid, group=False)
    check(code == 143, f"exit {code}, expected 143:\n{proc.output[-2000:]}")
    stopped = json.load(open(os.path.join(out, "summary.json")))
    check(stopped["status"] == "terminated" and newest_verified(out) == stopped["steps_completed"],
          f"after SIGTERM: status {stopped['status']}, checkpoint {newest_verified(out)}")
    lab.resume(out)
    return f"SIGTERM (repeated) after step {stopped['steps_completed']}: exit 143, saved; resumed: {ref.matches(out)}"


def sigterm_launcher(lab: Lab, rng: random.Random) -> str:
    ref, at, group = lab.reference(2), rng.randint(2, STEPS - 1), rng.random() < 0.5
    out = lab.new_out("sigterm-launcher")
    proc = lab.train(out, world=2)
    proc.wait_until(lambda: steps_logged(out) >= at, f"step {at}")
    os.killpg(proc.popen.pid, signal.SIGTERM) if group else os.kill(proc.popen.pid, signal.SIGTERM)
    code = proc.wait()  # torchrun forwards it: every rank gets a follow-up SIGTERM
    check(code == 143, f"trex launch exit {code}, expected 143:\n{proc.output[-2000:]}")
    no_traceback(proc.output)
    stopped = json.load(open(os.path.join(out, "summary.json")))
    check(stopped["status"] == "terminated" and newest_verified(out) == stopped["steps_completed"],
          f"after SIGTERM: status {stopped['status']}, checkpoint {newest_verified(out)}")
    lab.resume(out, 2)
    target = "the launcher's process group" if group else "the launcher"
    return (f"SIGTERM to {target} after step {stopped['steps_completed']}: exit 143, saved; "
            f"resumed: {ref.matches(out)}")


def sigstop_rank(lab: Lab, rng: random.Random) -> str:
    # 6 s: on a loaded 2-core machine (the suite's two workers beside this job) a 3 s timeout once called a
    # healthy rank lost before the SIGSTOP was sent (its peer exited 4 before step 6)
    at, rank, timeout = rng.randint(2, STEPS - 1), rng.randint(0, 1), 6
    out = lab.new_out("sigstop-rank")
    proc = lab.train(out, "--set", f"parallel.heartbeat_timeout_s={timeout}", world=2)
    proc.wait_until(lambda: steps_logged(out) >= at, f"step {at}")
    stopped_pid, watcher = proc.rank_pid(rank), proc.rank_pid(1 - rank)
    os.kill(stopped_pid, signal.SIGSTOP)
    t0 = time.time()
    proc.wait_until(lambda: "stopped answering" in proc.output, "a lost-rank report", timeout=60)
    detected = time.time() - t0
    proc.wait_until(lambda: _exited(watcher), "the reporting rank's exit", timeout=30)
    os.kill(stopped_pid, signal.SIGKILL)  # as an operator would; the launcher alone waits its shutdown timeout
    code = proc.wait()
    line = next(x for x in proc.lines if "stopped answering" in x)
    check(f"rank {rank} stopped answering" in line and "step" in line, f"the report does not name rank {rank}: {line}")
    check(code == 4, f"trex launch exit {code}, expected 4:\n{proc.output[-2000:]}")
    check(detected < timeout + 10, f"named after {detected:.1f}s with a {timeout}s timeout")
    return f"SIGSTOP of rank {rank} at step {at}: named in {detected:.1f}s (timeout {timeout}s), exit 4: {line.strip()}"


def _exited(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def interrupted_save(lab: Lab, rng: random.Random) -> str:
    ref, delay = lab.reference(), rng.uniform(0, 0.01)
    save = rng.choice(range(SAVE_EVERY, STEPS, SAVE_EVERY))
    out = lab.new_out("interrupted-save")
    tmp = os.path.join(out, "checkpoints", f".tmp.step_{save}")
    proc = lab.train(out)
    proc.wait_until(lambda: os.path.exists(tmp), f"the save of step {save}")
    time.sleep(delay)
    os.kill(proc.popen.pid, signal.SIGKILL)
    proc.wait()
    partial = os.path.exists(tmp)
    published = os.path.exists(os.path.join(out, "checkpoints", f"step_{save}", MANIFEST))
    resumed_from = newest_verified(out)
    check(resumed_from == (save if published else save - SAVE_EVERY), f"newest verified {resumed_from}")
    lab.resume(out)
    state = "mid-write (temporary directory left)" if partial else "after the write"
    return (f"SIGKILL {1000 * delay:.1f} ms into the save of step {save}, {state}; resumed from step "
            f"{resumed_from}: {ref.matches(out)}")


# ---- faults: damaged checkpoints --------------------------------------------------------------------
def _damage(path: str, kind: str, rng: random.Random) -> str:
    files = sorted(os.path.relpath(os.path.join(d, n), path) for d, _, names in os.walk(path) for n in names)
    name = rng.choice(files)
    target = os.path.join(path, name)
    size = os.path.getsize(target)
    if kind == "truncated":
        with open(target, "r+b") as f:
            f.truncate(rng.randrange(size))
    elif kind == "flipped":
        offset = rng.randrange(size)
        with open(target, "r+b") as f:
            f.seek(offset)
            byte = f.read(1)[0]
            f.seek(offset)
            f.write(bytes([byte ^ (1 << rng.randrange(8))]))
    else:
        os.remove(target)
    return name


def damaged_checkpoint(kind: str):
    def trial(lab: Lab, rng: random.Random) -> str:
        ref = lab.reference()
        out = lab.new_out(f"{kind}-checkpoint")
        shutil.copytree(ref.out, out)
        ckpts = os.path.join(out, "checkpoints")
        shutil.rmtree(os.path.join(ckpts, f"step_{STEPS}"))  # the run had not finished
        victim = os.path.join(ckpts, f"step_{STEPS - SAVE_EVERY}")
        name = _damage(victim, kind, rng)
        report = verify_checkpoint(victim)
        check(not report.ok, f"verify passed a checkpoint with {name} {kind}")
        explicit = lab.train(out, "--resume", victim)
        code = explicit.wait()
        last = explicit.lines[-1] if explicit.lines else ""
        check(code == 2 and last.startswith("trex train: checkpoint.resume") and victim in last,
              f"--resume of the damaged checkpoint: exit {code}, last line {last!r}")
        no_traceback(explicit.output)
        lines = lab.resume(out)
        check(any("skipping checkpoint" in x for x in lines), "resume auto did not say what it skipped")
        return (f"{name} {kind} in step_{STEPS - SAVE_EVERY}: verify names it ({report.problems[0][:60]}...); "
                f"--resume PATH exit 2; --resume auto skips it, resumes from step {STEPS - 2 * SAVE_EVERY}: "
                f"{ref.matches(out)}")
    return trial


# ---- faults: bad data -------------------------------------------------------------------------------
BAD_RECORDS = {
    "not JSON": b'{"messages": [\n',
    "not an object": b'[1, 2, 3]\n',
    "no messages": b'{"text": "hello"}\n',
    "unknown role": b'{"messages": [{"role": "wizard", "content": "hi"}]}\n',
    "content not a string": b'{"messages": [{"role": "user", "content": 7}]}\n',
    "invalid UTF-8": b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}\n',
}


def bad_record(lab: Lab, rng: random.Random) -> str:
    """Every kind of bad record, each at a random line of an otherwise good file."""
    good = open(os.path.join(lab.root, "sft.jsonl"), "rb").read().splitlines(keepends=True)[:40]
    seen = []
    for kind, record in BAD_RECORDS.items():
        line = rng.randint(1, len(good))
        path = os.path.join(lab.root, f"bad-{len(seen)}.jsonl")
        with open(path, "wb") as f:
            f.writelines(good[:line - 1] + [record] + good[line - 1:])
        out = lab.new_out("bad-record")
        proc = lab.train(out, "--set", f'data.paths=["{path}"]', "--set", "checkpoint.save_every=0")
        code = proc.wait()
        last = proc.lines[-1] if proc.lines else ""
        check(code == 2 and f"{path}:{line}" in last, f"{kind} at line {line}: exit {code}, last line {last!r}")
        no_traceback(proc.output)
        seen.append(f"{kind} (line {line})")
    return "exit 2 naming file:line for " + ", ".join(seen)


# ---- faults: non-finite steps (injected into this process's objective) ------------------------------
def _inject(kind: str, steps: set[int]):
    """Patch the loop's objective so that, at the 1-based ``steps``, the loss (or one gradient) is
    non-finite after the real forward and backward."""
    from trex.train import loop

    real = loop.build_objective

    def build(*args, **kwargs):
        objective = real(*args, **kwargs)
        step = objective.step

        def faulty(model, i, scaler):
            result = step(model, i, scaler)
            if i + 1 in steps:
                if kind == "loss":
                    result = dataclasses.replace(result, loss=result.loss * float("nan"))
                else:
                    next(p for p in model.parameters() if p.grad is not None).grad.view(-1)[0] = float("inf")
            return result
        objective.step = faulty
        return objective
    return mock.patch.object(loop, "build_objective", build)


def _cli(*argv: str) -> tuple[int, str]:
    from trex.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(list(argv))
    return code, err.getvalue()


def nonfinite(kind: str):
    def trial(lab: Lab, rng: random.Random) -> str:
        steps = set(rng.sample(range(2, STEPS, 2), 2))  # never two in a row
        out = lab.new_out(f"nonfinite-{kind}")
        with _inject(kind, steps):
            code, err = _cli("train", lab.recipe, "--out", out, "--set", "checkpoint.save_every=0")
        check(code == 0, f"exit {code}: {err[-2000:]}")
        summary = json.load(open(os.path.join(out, "summary.json")))
        rows = {r["step"]: r for r in metrics(out)}
        events = [int(re.match(r"step (\d+): non-finite", e).group(1)) for e in summary["nonfinite_events"]]
        check(summary["skipped_steps"] == len(steps) and events == sorted(steps),
              f"skipped {summary['skipped_steps']}, events {summary['nonfinite_events']}")
        check(sorted(rows) == list(range(1, STEPS + 1)), "a step is missing from metrics.jsonl")
        ok = [s for s in rows if s not in steps]
        check(all(rows[s]["loss"] == rows[s]["loss"] for s in ok), "a non-injected step logged a NaN loss")
        # then as many in a row as the guard allows, plus one: the run stops with exit 3 and says why
        burst = set(range(3, 3 + 6))
        out2 = lab.new_out(f"nonfinite-{kind}-burst")
        with _inject(kind, burst):
            code2, err2 = _cli("train", lab.recipe, "--out", out2, "--set", "checkpoint.save_every=0",
                               "--set", "precision.max_consecutive_skips=5")
        stopped = json.load(open(os.path.join(out2, "summary.json")))
        check(code2 == 3 and stopped["status"].startswith("stopped") and "Traceback" not in err2,
              f"burst: exit {code2}, status {stopped['status']}")
        return (f"non-finite {kind} at steps {sorted(steps)}: skipped and counted ({summary['skipped_steps']}), "
                f"the run completes; 6 in a row with max_consecutive_skips = 5: exit 3 at step "
                f"{stopped['steps_completed']}")
    return trial


# ---- faults: the disk --------------------------------------------------------------------------------
def _file_size_limit(limit: int):
    def apply() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


def full_disk(lab: Lab, rng: random.Random) -> str:
    out = lab.new_out("full-disk")
    limit = rng.randint(256, 1024) * 1024  # bytes a file may hold: less than a checkpoint's tensors
    proc = lab.train(out, preexec_fn=_file_size_limit(limit))
    code = proc.wait()
    last = proc.lines[-1] if proc.lines else ""
    check(code == 2 and last.startswith("trex train: ") and "checkpoints" in last, f"exit {code}, last {last!r}")
    no_traceback(proc.output)
    check(newest_verified(out) == 0 and not any(
        os.path.exists(os.path.join(p, MANIFEST)) for _, p in list_checkpoints(os.path.join(out, "checkpoints"))),
        "a checkpoint was published from a failed write")
    # no room up front: refused before step 1, naming the directory
    out2 = lab.new_out("no-room")
    usage = shutil.disk_usage(lab.root)
    with mock.patch("trex.checkpoint.training.shutil.disk_usage", return_value=usage._replace(free=1024)):
        code2, err2 = _cli("train", lab.recipe, "--out", out2)
    check(code2 == 2 and "checkpoints" in err2 and "free" in err2 and not os.path.exists(
        os.path.join(out2, "metrics.jsonl")), f"no room: exit {code2}: {err2[-500:]}")
    return (f"files limited to {limit // 1024} KiB: the first save fails, exit 2: {last[:90]}...; nothing "
            f"published. 1 KiB free: refused before step 1, exit 2")


FAULTS = {
    "kill -9 of the process": kill9_process,
    "kill -9 of one rank of two": kill9_rank,
    "kill -9 of one rank during a save, restarted by trex launch --max-restarts": kill9_rank_restarted,
    "SIGTERM to the process": sigterm_process,
    "SIGTERM to the launcher (trex launch)": sigterm_launcher,
    "SIGSTOP of one rank of two": sigstop_rank,
    "kill -9 during a checkpoint write": interrupted_save,
    "truncated checkpoint file": damaged_checkpoint("truncated"),
    "flipped bit in a checkpoint file": damaged_checkpoint("flipped"),
    "missing checkpoint file": damaged_checkpoint("missing"),
    "bad data records": bad_record,
    "non-finite losses": nonfinite("loss"),
    "non-finite gradients": nonfinite("grad"),
    "full disk": full_disk,
}


def run_trial(lab: Lab, fault: str, seed: int) -> tuple[bool, str, float]:
    t0 = time.time()
    try:
        detail, ok = FAULTS[fault](lab, random.Random(f"{fault}/{seed}")), True
    except Failed as e:
        detail, ok = str(e), False
    return ok, detail, time.time() - t0


# ---- the table of docs/reliability.md --------------------------------------------------------------
BEGIN, END = "<!-- faults:begin -->", "<!-- faults:end -->"


def table(results: dict[str, list[tuple[bool, str, float]]], trials: int, seed: int) -> str:
    lines = [BEGIN, f"Measured {time.strftime('%Y-%m-%d')} on {os.cpu_count()} CPU cores, torch {torch.__version__}: "
             f"`python tests/faults.py --trials {trials} --seed {seed}`.", "",
             "| fault | trials | outcome as expected | seconds per trial | what the first trial injected and saw |",
             "|---|---|---|---|---|"]
    for fault, rows in results.items():
        passed = sum(ok for ok, _, _ in rows)
        detail = rows[0][1].replace("|", "/").replace("\n", " ")
        lines.append(f"| {fault} | {len(rows)} | {passed}/{len(rows)} | {sum(s for _, _, s in rows) / len(rows):.0f} "
                     f"| {detail} |")
    return "\n".join([*lines, END])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=3, help="trials per fault")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", help="a regular expression: run the faults whose name matches")
    parser.add_argument("--write", help="replace the table between the fault markers of this Markdown file")
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory(prefix="trex-faults-") as root:
        lab = Lab(root)
        for fault in (f for f in FAULTS if not args.only or re.search(args.only, f)):
            results[fault] = [run_trial(lab, fault, args.seed * 1000 + t) for t in range(args.trials)]
            for ok, detail, seconds in results[fault]:
                print(f"{'ok  ' if ok else 'FAIL'} {fault} ({seconds:.0f}s): {detail}", flush=True)
    text = table(results, args.trials, args.seed)
    if args.write:
        with open(args.write) as f:
            doc = f.read()
        check(BEGIN in doc and END in doc, f"{args.write} has no {BEGIN} ... {END} markers")
        with open(args.write, "w") as f:
            f.write(doc[:doc.index(BEGIN)] + text + doc[doc.index(END) + len(END):])
    else:
        print(text)
    return 0 if all(ok for rows in results.values() for ok, _, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
