"""Scale-out on CPU with gloo: a sharded load gives one process's losses, a data configuration that
would hang is caught by the pre-flight check, and the default job runs on two ranks. (Losses at
different layouts: tests/test_migration.py moves one run through them.)"""

from __future__ import annotations

import json
import os
import socket
import subprocess

import pytest
from trex_run import trex

from trex.data.arithmetic import ArithmeticTask, generate, sft_records
from trex.data.records import write_jsonl

pytestmark = pytest.mark.slow
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(nproc: int, args: list[str], timeout: int = 240) -> subprocess.CompletedProcess:
    """`torchrun --nproc-per-node NPROC -m trex ARGS` on the CPU (tests/trex_run.py)."""
    return trex(args, procs=nproc, env={"TREX_DEVICE": "cpu"}, timeout=timeout)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("dist")
    problems, _ = generate(ArithmeticTask(digits=2, n_train=600, n_eval=10))
    write_jsonl(d / "sft.jsonl", sft_records(problems))
    (d / "recipe.toml").write_text("# everything set on the command line\n")
    return d


def _args(data, out, nproc, extra=()):
    rows_per_rank = 4 // nproc
    return ["train", str(data / "recipe.toml"), "--out", str(out), "--set", f'data.paths=["{data}/sft.jsonl"]',
            "--set", 'data.tokenizer="compact"', "--set", "data.seq_len=64",
            "--set", f"data.micro_batch_size={rows_per_rank}", "--set", "train.steps=20", "--set", "optim.lr=3e-3",
            "--set", "train.progress=false", "--set", "model.overrides={sliding_window=16}",
            "--set", "train.balance_alpha=0.01", *extra]


def _losses(out):
    return [json.loads(line)["loss"] for line in open(out / "metrics.jsonl")]


def test_uneven_data_is_caught_by_the_preflight_check(data, tmp_path):
    # each rank reads its own file ($RANK in the path); rank 1's holds fewer rows -> fewer micro-batches
    problems, _ = generate(ArithmeticTask(digits=2, n_train=600, n_eval=10))
    write_jsonl(tmp_path / "part0.jsonl", sft_records(problems))
    write_jsonl(tmp_path / "part1.jsonl", sft_records(problems[:200]))
    args = _args(data, tmp_path / "uneven", 2, ["--set", "parallel.dp_shard=2"])
    args[args.index(f'data.paths=["{data}/sft.jsonl"]')] = f'data.paths=["{tmp_path}/part${{RANK}}.jsonl"]'
    proc = torchrun(2, args, timeout=120)
    assert proc.returncode != 0
    assert "pre-flight check failed" in proc.stderr and "micro_batches_per_epoch differs" in proc.stderr
    assert "ranks [0]" in proc.stderr and "ranks [1]" in proc.stderr


def test_sharded_load_from_a_checkpoint_matches_one_process(data, tmp_path):
    from trex.checkpoint import save_pretrained
    from trex.models import build_model
    from trex.models.deepseek_v4.config import tiny

    ckpt = tmp_path / "ckpt"
    save_pretrained(build_model(tiny(vocab_size=112, sliding_window=16), seed=3), str(ckpt), layout="official",
                    dtype="fp32")
    curves = {}
    for nproc, extra in ((1, []), (2, ["--set", "parallel.dp_shard=2", "--set", "parallel.ep=2"])):
        out = tmp_path / f"from_ckpt_{nproc}"
        args = _args(data, out, nproc, ["--set", f'model.path="{ckpt}"', "--set", "train.steps=3", *extra])
        proc = torchrun(nproc, args) if nproc > 1 else trex(args, env={"TREX_DEVICE": "cpu"})
        assert proc.returncode == 0, proc.stderr[-3000:]
        curves[nproc] = _losses(out)
    for a, b in zip(curves[2], curves[1]):
        assert abs(a - b) <= 1e-4 * abs(b)


def test_the_default_job_runs_on_two_ranks(tmp_path):
    """`torchrun --nproc-per-node 2 -m trex train`, a newcomer's first multi-process try: both stages,
    the model export from the sharded SFT model, and one voice on the console."""
    from trex.checkpoint import load_pretrained

    proc = torchrun(2, ["train", "--steps", "14", "--out", str(tmp_path / "job")], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "job" / "summary.json").read_text())
    assert proc.stdout.count("exact match on 200 held-out problems") == 1  # rank 0 speaks for the job
    assert proc.stderr.count("[3/4] SFT") == 1
    model = load_pretrained(summary["model"])  # written by rank 0 from the gathered shards
    assert sum(p.numel() for p in model.parameters()) > 0
    # SFT's 8 steps: logged at its evaluations (every 8 // 4 steps) and its end, log_every being 10
    assert [json.loads(line)["step"] for line in open(tmp_path / "job" / "sft" / "metrics.jsonl")] == [2, 4, 6, 8]
