"""Experiment trackers (trex.train.trackers): Weights & Biases in offline mode, read back from the files it
writes; a resume that logs every step once; a tracker that fails mid-run; a missing package."""

from __future__ import annotations

import glob
import json
import logging
import struct

import pytest


def _wandb_records(directory):
    """(run id, record) of every record in the W&B offline files under ``directory``: the .wandb format is a
    7-byte header, then 32 KiB blocks of records (4-byte checksum, 2-byte length, type: 1 whole, 2 first,
    3 middle, 4 last), each a wandb_internal_pb2.Record."""
    from wandb.proto import wandb_internal_pb2

    for path in sorted(glob.glob(f"{directory}/wandb/offline-run-*/run-*.wandb")):
        data, pos, block, pieces = open(path, "rb").read(), 7, 32768, b""
        while pos + 7 <= len(data):
            if block - pos % block < 7:  # a block's tail too short for a header is padding
                pos += block - pos % block
                continue
            length, kind = struct.unpack("<HB", data[pos + 4:pos + 7])
            pieces += data[pos + 7:pos + 7 + length]
            pos += 7 + length
            if kind in (1, 4):
                record = wandb_internal_pb2.Record()
                record.ParseFromString(pieces)
                pieces = b""
                yield path.rsplit("-", 1)[-1][:-6], record


def _wandb_history(directory) -> list[tuple[str, int, dict]]:
    """(run id, step, values) of every history record in the W&B offline files under ``directory``."""
    return [(run, r.history.step.num, {i.key or "/".join(i.nested_key): json.loads(i.value_json)
                                       for i in r.history.item})
            for run, r in _wandb_records(directory) if r.WhichOneof("record_type") == "history"]


def _recipe(tmp_path, *extra):
    from arithmetic_data import write_sft

    from trex.recipe import load
    from trex.train.config import TrainRecipe

    data = write_sft(tmp_path, n_train=100, n_eval=10)[0]
    return load(TrainRecipe, overrides=[
        f'data.paths=["{data}"]', 'data.tokenizer="compact"', "data.seq_len=32", "train.steps=4",
        "train.progress=false", "fidelity.every=0", f'train.out="{tmp_path}/run"', 'logging.wandb_project="trex-test"',
        'logging.wandb_mode="offline"', 'model.overrides={num_hidden_layers=2, layer_types=["sliding_attention", '
        '"compressed_sparse_attention"], mlp_layer_types=["hash_moe", "moe"], num_nextn_predict_layers=0}', *extra])


def _jsonl(tmp_path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, open(tmp_path / "run" / "metrics.jsonl"))}


def test_wandb_offline_holds_every_step_once_across_a_resume(tmp_path):
    """A run checkpoints at step 2 and finishes step 4; resumed from step 2 into the same directory, it
    trains steps 3 and 4 again. The W&B offline files (one W&B run, continued) hold steps 1-4 once each,
    with metrics.jsonl's values, and the recipe as parameters; summary.json names the run and its last step."""
    from trex.train.loop import train

    train(_recipe(tmp_path, "checkpoint.save_every=2", "checkpoint.keep_last=0"))
    first = _jsonl(tmp_path)
    train(_recipe(tmp_path, "checkpoint.save_every=2", "checkpoint.keep_last=0",
                  f'checkpoint.resume="{tmp_path}/run/checkpoints/step_2"'))
    history = _wandb_history(tmp_path / "run")
    assert len({run for run, _, _ in history}) == 1  # the resumed run continued the same W&B run
    steps = [step for _, step, _ in history]
    assert sorted(steps) == [1, 2, 3, 4]
    assert {step: v["loss"] for _, step, v in history} == pytest.approx(first, rel=1e-6)
    assert all("grad_norm" in v and "lr" in v for _, _, v in history)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["trackers"]["wandb"]["last_step"] == 4 and summary["trackers"]["wandb"]["missed_steps"] == []


def test_a_tracker_that_fails_mid_run_costs_a_reported_gap(tmp_path, monkeypatch, caplog):
    """The tracker raises at step 3 (a server gone): training finishes, the failure is logged once, and
    summary.json lists the missed step and the error; the steps around it reach the tracker."""
    from trex.train import trackers
    from trex.train.loop import train

    log = trackers.WandbTracker.log

    def flaky(self, step, scalars):
        if step == 3:
            raise ConnectionError("tracking server unreachable")
        log(self, step, scalars)

    monkeypatch.setattr(trackers.WandbTracker, "log", flaky)
    with caplog.at_level(logging.WARNING, logger="trex.train.trackers"):
        result = train(_recipe(tmp_path))
    assert result.summary["status"] == "completed"
    record = result.summary["trackers"]["wandb"]
    assert record["missed_steps"] == [3] and record["error"].startswith("ConnectionError: tracking server")
    assert sum("wandb tracker failed at step 3" in r.getMessage() for r in caplog.records) == 1
    assert sorted(step for _, step, _ in _wandb_history(tmp_path / "run")) == [1, 2, 4]


def _failing_at(monkeypatch, step: int) -> None:
    """Make the training step ``step`` (1-based) raise, as a bug or a lost device would."""
    from trex.train import loop

    train_step = loop.train_step

    def planted(*args, **kwargs):
        if args[5] + 1 == step:
            raise RuntimeError("planted fault")
        return train_step(*args, **kwargs)

    monkeypatch.setattr(loop, "train_step", planted)


def test_a_run_that_fails_ends_its_wandb_run_as_failed_and_leaves_no_empty_one(tmp_path, monkeypatch):
    """An error at step 3: summary.json says the run failed and why, after 2 steps; the W&B offline run holds
    steps 1-2 and ends with exit code 1, which `wandb sync` records as failed. An error at step 1: the W&B
    session logged no step, and its offline files are gone (`wandb sync` would upload an empty run)."""
    from trex.train.loop import train

    _failing_at(monkeypatch, 3)
    with pytest.raises(RuntimeError, match="planted fault"):
        train(_recipe(tmp_path))
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert (summary["status"], summary["reason"], summary["steps_completed"]) == ("failed", "RuntimeError: planted "
                                                                                   "fault", 2)
    assert summary["trackers"]["wandb"]["last_step"] == 2
    assert sorted(step for _, step, _ in _wandb_history(tmp_path / "run")) == [1, 2]
    assert [r.exit.exit_code for _, r in _wandb_records(tmp_path / "run") if r.WhichOneof("record_type") == "exit"] == [1]

    _failing_at(monkeypatch, 1)
    (tmp_path / "early").mkdir()
    with pytest.raises(RuntimeError, match="planted fault"):
        train(_recipe(tmp_path / "early"))
    assert json.loads((tmp_path / "early" / "run" / "summary.json").read_text())["status"] == "failed"
    assert not (tmp_path / "early" / "run" / "wandb").exists()


def test_a_missing_tracker_package_names_the_extra(tmp_path, monkeypatch):
    import sys

    from trex.train.loop import train

    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ValueError, match=r"wandb package is missing: pip install 'trex\[wandb\]'"):
        train(_recipe(tmp_path))


# ---- MLflow, against a real tracking server started here --------------------------------------------------
@pytest.fixture
def mlflow_server(tmp_path):
    """``mlflow server`` on 127.0.0.1 with a SQLite store under tmp_path; yields (url, process)."""
    import os
    import signal
    import socket
    import subprocess
    import sys
    import time
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mlflow = os.path.join(os.path.dirname(sys.executable), "mlflow")
    proc = subprocess.Popen([mlflow, "server", "--backend-store-uri", f"sqlite:///{tmp_path}/mlflow.db",
                             "--default-artifact-root", str(tmp_path / "artifacts"), "--host", "127.0.0.1",
                             "--port", str(port), "--workers", "1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while True:
        try:
            urllib.request.urlopen(f"{url}/health", timeout=1)
            break
        except OSError:
            assert proc.poll() is None and time.time() < deadline, "the MLflow server did not start"
            time.sleep(0.3)
    yield url, proc
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)  # the server and its worker processes
        proc.wait(timeout=30)


def _mlflow_recipe(tmp_path, url, *extra):
    return _recipe(tmp_path, 'logging.wandb_project=""', f'logging.mlflow_tracking_uri="{url}"',
                   'logging.mlflow_experiment="trex-test"', *extra)


def test_mlflow_holds_every_step_once_across_a_resume_and_survives_its_server(tmp_path, mlflow_server):
    """A run and its resume (from step 2, into the same directory) show every step once in one MLflow run,
    read back through MLflow's client, with metrics.jsonl's values; the recipe is its parameters and
    summary.json its artefact. Then the server is killed after a new run's step 2: that run finishes, and
    summary.json lists the steps MLflow missed."""
    import os
    import signal

    from mlflow.tracking import MlflowClient

    from trex.train import trackers
    from trex.train.loop import train

    url, proc = mlflow_server
    train(_mlflow_recipe(tmp_path, url, "checkpoint.save_every=2", "checkpoint.keep_last=0"))
    first = _jsonl(tmp_path)
    resumed = train(_mlflow_recipe(tmp_path, url, "checkpoint.save_every=2", "checkpoint.keep_last=0",
                                   f'checkpoint.resume="{tmp_path}/run/checkpoints/step_2"'))
    run_id = resumed.summary["trackers"]["mlflow"]["run_id"]
    client = MlflowClient(tracking_uri=url)
    history = client.get_metric_history(run_id, "loss")
    assert sorted(m.step for m in history) == [1, 2, 3, 4]
    assert {m.step: m.value for m in history} == pytest.approx(first, rel=1e-6)
    run = client.get_run(run_id)
    assert run.data.params["train.steps"] == "4" and run.data.tags["status"] == "completed"
    assert run.info.status == "FINISHED" and [a.path for a in client.list_artifacts(run_id)] == ["summary.json"]
    assert len(client.search_runs([run.info.experiment_id])) == 1  # the resume continued it

    log = trackers.MLflowTracker.log

    def then_kill(self, step, scalars):
        log(self, step, scalars)
        if step == 2:  # the server and its workers, at once
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    trackers.MLflowTracker.log = then_kill
    (tmp_path / "outage").mkdir()
    try:
        result = train(_mlflow_recipe(tmp_path / "outage", url))
    finally:
        trackers.MLflowTracker.log = log
    assert result.summary["status"] == "completed"
    assert result.summary["trackers"]["mlflow"]["missed_steps"] == [3, 4]
    assert result.summary["trackers"]["mlflow"]["last_step"] == 2


def test_an_mlflow_file_store_holds_a_failed_runs_steps(tmp_path, monkeypatch):
    """``mlflow_tracking_uri = "file:..."``, a store MLflow refuses unless MLFLOW_ALLOW_FILE_STORE is set (not
    set here): the run's steps read back through MLflow's client with metrics.jsonl's values; the run, failed
    at step 3, is FAILED, with the reason among its tags."""
    from mlflow.tracking import MlflowClient

    from trex.train.loop import train

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "")  # restored (unset) after the test
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE")
    uri = f"file:{tmp_path}/mlruns"
    _failing_at(monkeypatch, 3)
    with pytest.raises(RuntimeError, match="planted fault"):
        train(_mlflow_recipe(tmp_path, uri))
    run_id = json.loads((tmp_path / "run" / "summary.json").read_text())["trackers"]["mlflow"]["run_id"]
    client = MlflowClient(tracking_uri=uri)
    assert {m.step: m.value for m in client.get_metric_history(run_id, "loss")} == pytest.approx(_jsonl(tmp_path))
    run = client.get_run(run_id)
    assert run.info.status == "FAILED" and run.data.tags["reason"] == "RuntimeError: planted fault"


# ---- SwanLab, offline ------------------------------------------------------------------------------------
def _swanlab_scalars(directory) -> list[tuple[str, int, float]]:
    """(key, step, value) of every scalar record of the SwanLab offline files under ``directory``, read with
    SwanLab's own record reader."""
    from swanlab.proto.swanlab.record.v1.record_pb2 import Record
    from swanlab.sdk.internal.core_python.store import DataStoreReader

    out = []
    for path in sorted(glob.glob(f"{directory}/swanlog/run-*/run-*.swanlab")):
        reader = DataStoreReader()
        reader.open(path)
        while (data := reader.scan()) is not None:
            record = Record()
            record.ParseFromString(data)
            if record.WhichOneof("record_type") == "scalar":
                out.append((record.scalar.key, record.scalar.step, record.scalar.value.number))
    return out


def test_swanlab_offline_holds_every_step_once_across_a_resume(tmp_path):
    """SwanLab in offline mode (its "local" mode needs swanlab[dashboard], whose rich pin conflicts with
    trex's): a run and its resume from step 2 hold steps 1-4 once each in SwanLab's files, with
    metrics.jsonl's values."""
    from trex.train.loop import train

    extra = ('logging.wandb_project=""', 'logging.swanlab_project="trex-test"', 'logging.swanlab_mode="offline"',
             "checkpoint.save_every=2", "checkpoint.keep_last=0")
    train(_recipe(tmp_path, *extra))
    first = _jsonl(tmp_path)
    result = train(_recipe(tmp_path, *extra, f'checkpoint.resume="{tmp_path}/run/checkpoints/step_2"'))
    loss = [(step, value) for key, step, value in _swanlab_scalars(tmp_path / "run") if key == "loss"]
    assert sorted(step for step, _ in loss) == [1, 2, 3, 4]
    assert dict(loss) == pytest.approx(first, rel=1e-6)
    assert result.summary["trackers"]["swanlab"]["last_step"] == 4
    files = glob.glob(f"{tmp_path}/run/swanlog/run-*/run-*.swanlab")
    assert len(files) == 2 and len({f.rsplit("/", 1)[-1] for f in files}) == 1  # two sessions of one SwanLab run
