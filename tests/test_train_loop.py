"""The training loop: exact gradient accumulation, run outputs, skipped steps, interruption,
the CLI, and the default job on a shortened schedule."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch

from trex.cli import main
from trex.data import Batch
from trex.data.arithmetic import ArithmeticTask, cpt_records, generate, sft_records
from trex.data.records import write_jsonl
from trex.models import build_model
from trex.models.deepseek_v4.config import tiny
from trex.precision import DynamicLossScaler, NonFiniteError
from trex.recipe import load
from trex.train.config import TrainRecipe, TrainSection
from trex.train.loop import accumulate_gradients, train


def _batch(ids, labels, docs):
    return Batch(ids, labels, docs, 0, ids.numel(), torch.ones_like(ids, dtype=torch.bool))


def test_gradient_accumulation_equals_one_large_batch():
    torch.manual_seed(0)
    model = build_model(tiny(), seed=0).double()
    ids = torch.randint(0, 256, (4, 24))
    labels = ids.clone()
    labels[:, :5] = -100
    labels[1, :] = -100  # uneven numbers of loss tokens between rows
    labels[1, 20:] = ids[1, 20:]
    docs = torch.zeros_like(ids)
    docs[2, 11:] = 1
    cfg = TrainSection(mtp_weight=0.3, balance_alpha=0.01)
    scaler = DynamicLossScaler(enabled=False)

    accumulate_gradients(model, [_batch(ids, labels, docs)], cfg, scaler)
    big = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    halves = [_batch(ids[i:i + 2], labels[i:i + 2], docs[i:i + 2]) for i in (0, 2)]
    accumulate_gradients(model, halves, cfg, scaler)
    small = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert big.keys() == small.keys()
    for name, g in big.items():
        if "gate.weight" in name or ".hc_" in name:  # the balance loss is per sequence: equal by construction
            pass
        torch.testing.assert_close(small[name], g, atol=1e-6, rtol=1e-6, msg=name)


@pytest.fixture(scope="module")
def arithmetic_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    train_p, held = generate(ArithmeticTask(digits=2, n_train=400, n_eval=40))
    write_jsonl(d / "sft.jsonl", sft_records(train_p))
    write_jsonl(d / "heldout.jsonl", sft_records(held))
    write_jsonl(d / "cpt.jsonl", cpt_records(train_p, 8))
    # one malformed line and one conversation without an assistant turn, to be skipped and counted
    with open(d / "sft.jsonl", "a") as f:
        f.write("{not json\n")
        f.write(json.dumps({"messages": [{"role": "user", "content": "1+1"}]}) + "\n")
    return d


def _recipe(files, out, *extra):
    return load(TrainRecipe, overrides=[
        f'data.paths=["{files}/sft.jsonl"]', 'data.tokenizer="compact"', "data.seq_len=64",
        "data.micro_batch_size=4", 'data.bad_record_policy="skip"', "train.steps=6", "train.grad_accum=2",
        f'train.out="{out}"', "optim.lr=3e-3", "train.eval_every=3", f'eval.paths=["{files}/heldout.jsonl"]',
        "eval.batches=1", "train.progress=false", 'model.overrides={sliding_window=16}', *extra])


def test_run_writes_every_output_and_learns(arithmetic_files, tmp_path):
    out = tmp_path / "run"
    result = train(_recipe(arithmetic_files, out))
    for name in ("config.toml", "metrics.jsonl", "summary.json", "loss.png"):
        assert (out / name).exists(), name
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(out / "tensorboard"))
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    required = {"loss", "grad_norm", "lr", "tokens_per_s", "mfu", "mem_peak_bytes", "loss_scale", "skipped_steps"}
    assert required <= rows[0].keys()
    assert rows[-1]["loss"] < rows[0]["loss"]
    assert rows[0]["mfu"] > 0 and rows[0]["mem_peak_bytes"] > 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps_completed"] == 6
    assert summary["data"]["skipped"] == 2
    assert set(summary["data"]["skipped_by_reason"]) == {"malformed_json", "no_assistant_turn"}
    assert summary["skipped_steps"] == 0 and "final" in summary["eval_loss"]
    assert summary["precision"]["name"] == "fp32"
    assert load(TrainRecipe, str(out / "config.toml")).train.steps == 6  # the resolved config reloads
    assert result.model.training


def test_non_finite_steps_are_skipped_counted_and_stop_the_run(arithmetic_files, tmp_path):
    recipe = _recipe(arithmetic_files, tmp_path / "nan", "precision.max_consecutive_skips=2")
    model = build_model(tiny(vocab_size=112, sliding_window=16), seed=0)
    with torch.no_grad():
        model.head.weight[0, 0] = float("nan")
    before = model.embed.weight.clone()
    with pytest.raises(NonFiniteError, match="2 consecutive steps skipped"):
        train(recipe, model=model)
    summary = json.loads((tmp_path / "nan" / "summary.json").read_text())
    assert summary["skipped_steps"] == 2 and summary["status"].startswith("stopped")
    health = summary["health"]  # what "no skipped step, no NaN" counts, and the counts
    assert (health["nonfinite_loss_steps"], health["nonfinite_gradient_steps"], health["clean"]) == (2, 0, False)
    assert "NaN or infinite" in health["definition"]
    assert len(summary["nonfinite_events"]) == 2
    # numbered as metrics.jsonl numbers steps (from 1)
    assert [e.split(":")[0] for e in summary["nonfinite_events"]] == ["step 1", "step 2"]
    assert torch.equal(model.embed.weight, before)  # no update was applied


def test_interrupt_still_writes_summary_and_plot(arithmetic_files, tmp_path, monkeypatch):
    from trex.train import progress

    calls = {"n": 0}

    def interrupt(self, step, metrics, evaluated=False):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(progress.StepProgress, "update", interrupt)
    with pytest.raises(KeyboardInterrupt):
        train(_recipe(arithmetic_files, tmp_path / "int"))
    summary = json.loads((tmp_path / "int" / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["steps_completed"] == 2
    assert (tmp_path / "int" / "loss.png").exists()


def test_cli_rejects_unknown_keys_with_a_suggestion(tmp_path, capsys):
    recipe = tmp_path / "r.toml"
    recipe.write_text("[train]\nstpes = 3\n")
    assert main(["train", str(recipe)]) == 2
    assert "did you mean `train.steps`?" in capsys.readouterr().err


@pytest.mark.slow
def test_default_job_pipeline_on_a_short_schedule(tmp_path, capfd):
    out = tmp_path / "job"
    code = main(["train", "--out", str(out), "--set", "cpt_steps=12", "--set", "sft_steps=8", "--set", "log_every=5",
                 "--set", "task.n_train=300", "--set", "task.n_eval=100", "--set", "micro_batch_size=8"])
    assert code == 0
    console = capfd.readouterr()
    lines = (console.out + console.err).splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("train "))
    # at most ~30 lines before training starts (an upper bound: every stdout line counts as before)
    assert first <= 30, "\n".join(lines[:first])
    # no terminal: a step line at log_every, at each evaluation (SFT: every 8 // 4 steps) and at the end
    steps = [line.split()[1] for line in lines if re.match(r"^train \d+/\d+ ", line)]
    assert steps == ["5/12", "10/12", "12/12", "2/8", "4/8", "5/8", "6/8", "8/8"], steps
    summary = json.loads((out / "summary.json").read_text())
    assert 0.0 <= summary["exact_match_before_sft"] <= 1.0 and 0.0 <= summary["exact_match_after_sft"] <= 1.0
    assert summary["held_out_problems"] == 100 and len(summary["examples"]) == 10
    for stage in ("cpt", "sft"):
        assert (out / stage / "summary.json").exists() and (out / stage / "loss.png").exists()
    assert (out / "data" / "heldout.jsonl").exists()
    # the SFT stage's recorded recipe reproduces it: it starts from the CPT model on disk
    sft_recipe = load(TrainRecipe, str(out / "sft" / "config.toml"))
    assert sft_recipe.model.path == str(out / "cpt" / "model") and (out / "cpt" / "model" / "config.json").exists()


def test_the_cli_names_the_skipped_records_on_the_console(arithmetic_files, tmp_path, capsys):
    from trex import recipe as recipe_io

    path = tmp_path / "r.toml"
    recipe_io.save(_recipe(arithmetic_files, tmp_path / "run", "train.steps=2", "train.eval_every=0"), str(path))
    assert main(["train", str(path)]) == 0
    console = capsys.readouterr()
    err = console.err
    assert "completed: 2 steps, final loss " in console.out
    assert ", no skipped step, no non-finite loss or gradient; " in console.out  # the run's health, stated
    sft = arithmetic_files / "sft.jsonl"
    assert "trex train: data: skipped 2 bad records: " in err
    assert f"1 malformed_json (first {sft}:401)" in err and f"(first {sft}:402)" in err


def test_layout_that_does_not_match_the_world_size_is_refused(arithmetic_files, tmp_path):
    with pytest.raises(ValueError, match=r"dp_shard \(4\) x cp \(1\) x tp \(1\) = 4 ranks, but the run has 1"):
        train(_recipe(arithmetic_files, tmp_path / "p", "parallel.dp_shard=4"))


def test_eval_at_start_scores_the_starting_model_once(arithmetic_files, tmp_path):
    out = tmp_path / "run"
    train(_recipe(arithmetic_files, out, "train.eval_at_start=true"))
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["eval"]) == {"0", "3", "6", "final"}
    start, end = summary["eval"]["0"]["eval_loss"], summary["eval"]["final"]["eval_loss"]
    assert end < start  # the run learned from the model scored at step 0
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert rows[0]["step"] == 0 and rows[0]["eval_loss"] == start


@pytest.mark.parametrize("setting, expected", [
    ('data.paths=["/nonexistent/*.jsonl"]', "data path '/nonexistent/*.jsonl' matches no file"),
    ('train.out="/proc/trex-run"', "/proc/trex-run"),  # a run directory that cannot be made
])
def test_cli_reports_file_errors_in_one_line(capsys, setting, expected):
    code = main(["train", "recipes/fidelity_default.toml", "--set", setting, "--set", "train.progress=false"])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("trex train:")]
    assert code == 2 and "Traceback" not in err and len(lines) == 1 and expected in lines[0], err[-2000:]


def test_cli_non_finite_stop_is_one_line_with_its_own_exit_code(arithmetic_files, tmp_path, capsys):
    args = ["train", "recipes/fidelity_default.toml", "--set", f'data.paths=["{arithmetic_files}/sft.jsonl"]',
            "--set", 'data.bad_record_policy="skip"', "--set", "optim.lr=1e30", "--set", 'optim.name="adamw"',
            "--set", "precision.max_consecutive_skips=1", "--set", "train.steps=8", "--set", "optim.grad_clip=0",
            "--set", "fidelity.every=0", "--out", str(tmp_path / "nan")]
    code = main(args)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("trex train:")]
    assert code == 3 and "Traceback" not in err and len(lines) == 1 and "consecutive steps skipped" in lines[0], err


def test_resume_decisions_reach_the_terminal_and_the_run_log(arithmetic_files, tmp_path, capsys):
    out = tmp_path / "run"
    base = ["train", "recipes/fidelity_default.toml", "--set", f'data.paths=["{arithmetic_files}/sft.jsonl"]',
            "--set", 'data.bad_record_policy="skip"', "--set", "fidelity.every=0", "--set", "schedule.warmup_steps=0",
            "--out", str(out), "--save-every", "2", "--resume", "auto"]
    assert main([*base, "--steps", "2"]) == 0
    assert "trex: resume = auto: no checkpoint in" in capsys.readouterr().err
    assert main([*base, "--steps", "4"]) == 0
    err = capsys.readouterr().err
    assert f"trex: resumed from {out}/checkpoints/step_2 at step 2" in err, err
    log = (out / "train.log").read_text()
    assert "starting from step 1" in log and "resumed from" in log
    # the optimizer's group table is in train.log; the terminal gets its one-line summary
    assert "optimizer groups:" in log and "layers.*.ffn.experts.w1" in log
    assert "trex: optimizer: 7 groups" in err and "layers.*" not in err


def _sigterm_at_step_1(args: list[str], capsys, monkeypatch) -> tuple[int, str]:
    """``trex *args`` in this process, sent SIGTERM during step 1: (exit code, stderr)."""
    import signal

    from trex.train import progress

    update = progress.StepProgress.update

    def terminated(self, step, *more, **kw):
        if step == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return update(self, step, *more, **kw)

    monkeypatch.setattr(progress.StepProgress, "update", terminated)
    before = signal.getsignal(signal.SIGTERM)
    try:
        code = main(args)
    finally:
        signal.signal(signal.SIGTERM, before)  # a stopped run ignores later SIGTERMs: not so this test process
        monkeypatch.setattr(progress.StepProgress, "update", update)
    return code, capsys.readouterr().err


def test_a_sigterm_stop_says_where_it_stopped_what_it_saved_and_how_to_resume(arithmetic_files, tmp_path, capsys,
                                                                               monkeypatch):
    """SIGTERM (a scheduler's preemption) during step 1: the step finishes and is saved, exit 143 and one line on
    the console naming the step, the checkpoint, summary.json and the command that resumes; that command, run
    as printed, continues from step 1 to the end. Without checkpoints the run stops the same way (summary
    written, one line) and says that nothing was saved."""
    import shlex

    out = tmp_path / "run"
    args = ["train", "recipes/fidelity_default.toml", "--set", f'data.paths=["{arithmetic_files}/sft.jsonl"]',
            "--set", 'data.bad_record_policy="skip"', "--set", "fidelity.every=0", "--set", "schedule.warmup_steps=0",
            "--out", str(out), "--steps", "2"]
    code, err = _sigterm_at_step_1([*args, "--save-every", "1000"], capsys, monkeypatch)
    command = shlex.join(["trex", *args, "--save-every", "1000", "--resume", "auto"])
    assert code == 143 and "Traceback" not in err, err[-2000:]
    assert [line for line in err.splitlines() if line.startswith("trex train:")] == [
        f"trex train: stopped by SIGTERM at step 1; saved {out}/checkpoints/step_1, {out}/summary.json and loss.png "
        f"written; resume: {command}"]
    assert json.loads((out / "summary.json").read_text())["status"] == "terminated"
    assert main(shlex.split(command)[1:]) == 0
    assert f"trex: resumed from {out}/checkpoints/step_1 at step 1" in capsys.readouterr().err
    assert [json.loads(line)["step"] for line in open(out / "metrics.jsonl")] == [1, 2]

    out = tmp_path / "unsaved"
    code, err = _sigterm_at_step_1([*args[:-4], "--out", str(out), "--steps", "2"], capsys, monkeypatch)
    assert code == 143 and "Traceback" not in err, err[-2000:]
    assert [line for line in err.splitlines() if line.startswith("trex train:")] == [
        f"trex train: stopped by SIGTERM at step 1; {out}/summary.json and loss.png written; no checkpoint "
        "(checkpoint.save_every = 0): a new run starts from step 0"]
    assert json.loads((out / "summary.json").read_text())["status"] == "terminated"
    assert [json.loads(line)["step"] for line in open(out / "metrics.jsonl")] == [1]


def test_checkpoint_and_run_directories_are_checked_before_step_1(arithmetic_files, tmp_path, capsys, monkeypatch):
    base = ["train", "recipes/fidelity_default.toml", "--set", f'data.paths=["{arithmetic_files}/sft.jsonl"]',
            "--set", 'data.bad_record_policy="skip"', "--set", "fidelity.every=0", "--save-every", "1000"]
    code = main([*base, "--out", str(tmp_path / "a"), "--set", 'checkpoint.dir="/proc/no-such/ckpts"'])
    err = capsys.readouterr().err
    line = [x for x in err.splitlines() if x.startswith("trex train:")]
    assert code == 2 and line == [line[0]] and "/proc/no-such/ckpts: checkpoint directory cannot be written" in line[0]
    assert not (tmp_path / "a" / "metrics.jsonl").exists()  # failed before step 1

    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 1000, 1000))
    code = main([*base, "--out", str(tmp_path / "b")])
    line = [x for x in capsys.readouterr().err.splitlines() if x.startswith("trex train:")]
    assert code == 2 and "GiB free, one checkpoint of this run needs up to" in line[0], line
    assert not (tmp_path / "b" / "metrics.jsonl").exists()
    code = main([*base, "--out", str(tmp_path / "c"), "--save-every", "0"])  # no checkpoints: the logs still need room
    line = [x for x in capsys.readouterr().err.splitlines() if x.startswith("trex train:")]
    assert code == 2 and f"{tmp_path / 'c'}: run directory: 0.0 MiB free" in line[0], line
    assert not (tmp_path / "c" / "metrics.jsonl").exists()


def test_progress_without_a_terminal_prints_at_log_every_evaluations_and_the_end_on_rank_0_only(capsys):
    from trex.train.progress import StepProgress

    metrics = {"loss": 1.0, "grad_norm": 2.0, "lr": 1e-3, "tokens_per_s": 100.0}
    shown = StepProgress(10, every=3)
    for step in range(1, 11):
        shown.update(step, {**metrics, **({"eval_loss": 0.5} if step == 4 else {})}, evaluated=step == 4)
    quiet = StepProgress(10, enabled=False, every=1)  # another rank
    for step in range(1, 11):
        quiet.update(step, metrics)
    lines = capsys.readouterr().err.splitlines()
    assert [line.split()[1] for line in lines] == ["3/10", "4/10", "6/10", "9/10", "10/10"]
    assert "eval 0.5000" in lines[1]


@pytest.mark.parametrize("width", [60, 80, 120, 200])
def test_the_live_bar_keeps_step_elapsed_and_eta_whole_at_any_width(width):
    import io

    from rich.console import Console

    from trex.train.progress import StepProgress

    out = io.StringIO()
    console = Console(file=out, width=width, force_terminal=True, color_system=None)
    bar = StepProgress(1500, console=console)
    bar.update(37, {"loss": 2.3456, "grad_norm": 12.5, "lr": 2e-5, "tokens_per_s": 123456.0, "mfu": 0.312,
                    "eval_loss": 2.5})
    bar._bar.refresh()
    bar.close()
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out.getvalue()).replace("\r", "\n")
    line = [x for x in text.splitlines() if "37/1500" in x][-1]
    assert "…" not in line and len(line.rstrip()) <= width
    assert "train" in line and "eta" in line and "loss 2.3456" in line
    assert line.count("0:00:") + line.count("-:--:--") == 2  # elapsed and remaining, both whole
    if width >= 160:
        assert "mfu 31.2%" in line  # room for every metric


def test_mfu_above_100_percent_is_warned_once_with_the_peak_it_used(arithmetic_files, tmp_path, monkeypatch, caplog):
    from trex.train import loop

    monkeypatch.setattr(loop, "peak_flops", lambda dev, policy: (1.0, "a peak far too low"))
    with caplog.at_level("WARNING", logger="trex"):
        summary = train(_recipe(arithmetic_files, tmp_path / "mfu", "train.steps=3", "train.eval_every=0")).summary
    warned = [r.getMessage() for r in caplog.records if "MFU" in r.getMessage()]
    assert len(warned) == 1 and warned[0].startswith("step 1: MFU") and "a peak far too low" in warned[0]
    # every warning of the run lands in summary.json, this one (logged in a step) too
    assert warned[0] in summary["warnings"]
    assert summary["warnings"] == json.loads((tmp_path / "mfu" / "summary.json").read_text())["warnings"]


def test_recorded_warnings_are_trex_warnings_and_python_warnings_each_once_still_shown():
    """``logs.Recorded`` (summary.json's ``warnings``): trex's messages at WARNING and above, not below, and the
    Python warnings shown in the block (still shown), each once; past the limit a last line counts the rest."""
    import logging
    import warnings

    from trex import logs

    log = logging.getLogger("trex.test")
    with warnings.catch_warnings(record=True) as shown, logs.Recorded(limit=3) as recorded:
        log.info("not a warning")
        log.warning("a warning:\n on two lines")
        log.warning("a warning:\n on two lines")
        log.error("an error")
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.warn("torch says so", UserWarning)
        log.warning("one more")
        log.warning("and another")
    assert recorded.lines()[:2] == ["a warning: on two lines", "an error"]
    assert recorded.lines()[2].startswith("UserWarning: torch says so (") and len(recorded.lines()) == 4
    assert recorded.lines()[3] == "2 more warning(s): see train.log"
    assert [str(w.message) for w in shown] == ["torch says so"]  # shown as before
    log.warning("after the block")
    assert "after the block" not in recorded.messages


def test_a_model_path_with_no_model_says_what_belongs_there(arithmetic_files, tmp_path):
    with pytest.raises(ValueError, match=r"model.path = '.*nowhere': no model there \(expected config.json"):
        train(_recipe(arithmetic_files, tmp_path / "run", f'model.path="{tmp_path}/nowhere"'))


def test_qat_and_the_indexer_loss_reach_the_model_through_the_recipe(arithmetic_files, tmp_path):
    short = ("train.steps=2", "train.grad_accum=1", "train.eval_every=0")
    plain = train(_recipe(arithmetic_files, tmp_path / "plain", *short))
    qat = train(_recipe(arithmetic_files, tmp_path / "qat", *short, 'precision.qat="official"',
                        "train.indexer_loss=0.1", "train.freeze_indexer=false"))
    assert qat.model.quant.active and not plain.model.quant.active and qat.model.align_indexer
    rows = {name: [json.loads(line) for line in open(tmp_path / name / "metrics.jsonl")] for name in ("plain", "qat")}
    assert all(r["indexer_loss"] > 0 for r in rows["qat"]) and "indexer_loss" not in rows["plain"][0]
    assert rows["qat"][0]["loss"] != rows["plain"][0]["loss"]  # the same weights, seen through the quantisers
    assert abs(rows["qat"][0]["loss"] - rows["plain"][0]["loss"]) < 0.05 * rows["plain"][0]["loss"]


@pytest.mark.parametrize("every", [0, 1, 50])
def test_a_train_after_a_prepare_tokenizes_nothing(arithmetic_files, tmp_path, monkeypatch, every):
    """`trex data prepare` then `trex train`: the loader and the fidelity probe map the prepared arrays
    (the probe no longer prepares an unshuffled second copy), at any fidelity.every."""
    from trex.data.prepared import ensure
    from trex.data.tokenizer import Tokenizer
    from trex.train import signals
    from trex.train.loop import keep_recorded_packing, tokenizer_for

    monkeypatch.setenv("TREX_CACHE_DIR", str(tmp_path / "cache"))
    recipe = _recipe(arithmetic_files, tmp_path / "run", "train.steps=2", "train.grad_accum=1", "train.eval_every=0",
                     "eval.paths=[]", f"fidelity.every={every}")
    ensure(keep_recorded_packing(recipe).data, tokenizer_for("compact"))  # what `trex data prepare` does
    calls, probes = [], []
    for name in ("encode", "encode_batch"):
        real = getattr(Tokenizer, name)
        monkeypatch.setattr(Tokenizer, name, lambda self, x, _real=real, _n=name: calls.append(_n) or _real(self, x))
    real_probe = signals.FidelityRecorder.for_recipe.__func__

    def counted(cls, *a, **k):
        recorder = real_probe(cls, *a, **k)
        probes.append(recorder.probe is not None)
        return recorder
    monkeypatch.setattr(signals.FidelityRecorder, "for_recipe", classmethod(counted))
    train(recipe)
    assert calls == []  # nothing tokenized
    assert len(os.listdir(tmp_path / "cache" / "data")) == 1  # no second, unshuffled copy for the probe
    assert probes == [every == 1]  # the probe is made only when a step of the run records it
    assert os.path.exists(tmp_path / "run" / "probe.jsonl") == (every == 1)


def test_the_probe_is_the_first_rows_in_file_order_whatever_the_packing(arithmetic_files, tmp_path, monkeypatch):
    """file_order_batch equals the probe of before: the first rows of an unshuffled next-fit packing."""
    import dataclasses

    from trex.data import build_loader, compact_tokenizer, file_order_batch

    monkeypatch.setenv("TREX_CACHE_DIR", str(tmp_path / "cache"))
    tok = compact_tokenizer()
    data = _recipe(arithmetic_files, tmp_path / "run").data
    old = next(build_loader(data.on_files(data.paths, shuffle=False, packing="next_fit", micro_batch_size=4), 0, 1, tok))
    for packing in ("best_fit", "next_fit"):
        new = file_order_batch(dataclasses.replace(data, packing=packing), tok, 4)
        for field in ("input_ids", "labels", "doc_ids", "token_mask"):
            assert torch.equal(getattr(new, field), getattr(old, field)), (packing, field)
        assert (new.n_loss_tokens, new.n_tokens) == (old.n_loss_tokens, old.n_tokens)
    with pytest.raises(ValueError, match="fidelity.probe_rows = 100000"):
        file_order_batch(data, tok, 100_000)
