"""Experiment trackers (trex.train.trackers): Weights & Biases in offline mode, read back from the files it
writes; a resume that logs every step once; a tracker that fails mid-run; a missing package."""

from __future__ import annotations

import glob
import json
import logging
import struct

import pytest


def _wandb_history(directory) -> list[tuple[str, int, dict]]:
    """(run id, step, values) of every history record in the W&B offline files under ``directory``: the
    .wandb format is a 7-byte header, then 32 KiB blocks of records (4-byte checksum, 2-byte length, type:
    1 whole, 2 first, 3 middle, 4 last), each a wandb_internal_pb2.Record."""
    from wandb.proto import wandb_internal_pb2

    out = []
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
                if record.WhichOneof("record_type") == "history":
                    values = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
                    out.append((path.rsplit("-", 1)[-1][:-6], record.history.step.num, values))
    return out


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


def test_a_missing_tracker_package_names_the_extra(tmp_path, monkeypatch):
    import sys

    from trex.train.loop import train

    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ValueError, match=r"wandb package is missing: pip install 'trex\[wandb\]'"):
        train(_recipe(tmp_path))
