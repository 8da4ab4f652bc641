"""Training checkpoints: verify catches truncation and bit flips and --resume auto skips them, run
directories hold each step once, export then load_pretrained gives identical logits. (Kill -9,
SIGTERM and damaged files against real processes: tests/faults.py.)"""

from __future__ import annotations

import json
import logging
import os
import re
import shlex
import shutil

import pytest
import torch

from trex.cli import main
from arithmetic_data import write_sft
from trex.checkpoint import load_pretrained
from trex.checkpoint.manifest import verify_checkpoint
from trex.checkpoint.training import find_resume, list_checkpoints
from trex.recipe import load
from trex.train.config import TrainRecipe
from trex.train.loop import train

COMPARED = ("loss", "mtp_loss", "grad_norm", "lr", "loss_scale", "tokens", "eval_loss")


def _by_step(out) -> dict[int, dict]:
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    return {r["step"]: {k: r.get(k) for k in COMPARED} for r in rows}


@pytest.fixture(scope="module")
def recipe_file(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpt_data")
    write_sft(d, n_train=200)
    recipe = d / "recipe.toml"
    recipe.write_text(f"""
[data]
paths = ["{d}/sft.jsonl"]
tokenizer = "compact"
seq_len = 32
micro_batch_size = 2
[train]
steps = 20
progress = false
eval_every = 5
[eval]
paths = ["{d}/held.jsonl"]
batches = 1
[optim]
lr = 3e-3
[schedule]
warmup_steps = 3
[model]
overrides = {{ sliding_window = 16 }}
""")
    return recipe


def _recipe(recipe_file, out, *extra):
    return load(TrainRecipe, str(recipe_file), [f'train.out="{out}"', "train.eval_every=0",
                                                'eval.paths=[]', *extra])


def _flip_byte(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))


@pytest.mark.slow
def test_verify_catches_truncation_and_a_flipped_byte_and_resume_skips_them(recipe_file, tmp_path, capsys, caplog):
    out = tmp_path / "run"
    train(_recipe(recipe_file, out, "train.steps=6", "checkpoint.save_every=2"))
    first = _by_step(out)
    ckpts = out / "checkpoints"
    assert [s for s, _ in list_checkpoints(ckpts)] == [2, 4, 6]
    assert main(["ckpt", "verify", str(ckpts)]) == 0

    shard = "__0_0.distcp"
    _flip_byte(str(ckpts / "step_6" / shard), os.path.getsize(ckpts / "step_6" / shard) // 2)
    with open(ckpts / "step_4" / shard, "r+b") as f:
        f.truncate(os.path.getsize(ckpts / "step_4" / shard) - 100)
    shutil.copytree(ckpts / "step_2", ckpts / "step_8")
    os.remove(ckpts / "step_8" / "manifest.json")  # a save that never finished

    assert "sha256 differs" in " ".join(verify_checkpoint(ckpts / "step_6").problems)
    assert "truncated" in " ".join(verify_checkpoint(ckpts / "step_4").problems)
    assert "no manifest.json" in " ".join(verify_checkpoint(ckpts / "step_8").problems)
    edited = ckpts / "step_2_edited"  # a byte of the manifest itself, where it still parses
    shutil.copytree(ckpts / "step_2", edited)
    text = (edited / "manifest.json").read_text()
    (edited / "manifest.json").write_text(text.replace('"created": "2', '"created": "3', 1))
    assert "digest does not match" in " ".join(verify_checkpoint(edited).problems)
    shutil.rmtree(edited)
    capsys.readouterr()
    assert main(["ckpt", "verify", str(ckpts / "step_6")]) == 1
    assert "FAILED" in capsys.readouterr().out
    assert main(["ckpt", "verify", str(ckpts / "step_2")]) == 0

    with caplog.at_level(logging.WARNING, logger="trex"):
        assert find_resume(str(ckpts)) == str(ckpts / "step_2")
    skipped = [r.getMessage() for r in caplog.records if r.getMessage().startswith("skipping checkpoint")]
    assert len(skipped) == 3  # step_8, step_6, step_4

    capsys.readouterr()  # the CLI: each skip is one trex line, not a Python RuntimeWarning
    overrides = [f'train.out="{out}"', "train.eval_every=0", "eval.paths=[]", "train.steps=6",
                 "checkpoint.save_every=2", 'checkpoint.resume="auto"']
    assert main(["train", str(recipe_file), *[a for o in overrides for a in ("--set", o)]]) == 0
    err = capsys.readouterr().err
    assert err.count("trex: warning: skipping checkpoint") == 3 and "RuntimeWarning" not in err, err
    assert _by_step(out) == first  # steps 3-6 again from step 2, identical
    assert verify_checkpoint(ckpts / "step_6").ok  # re-saved over the corrupt one


def test_resume_from_a_path_that_does_not_verify_is_an_error(recipe_file, tmp_path):
    out = tmp_path / "run"
    train(_recipe(recipe_file, out, "train.steps=3", "checkpoint.save_every=3"))
    os.remove(out / "checkpoints" / "step_3" / "trainer_state.json")
    with pytest.raises(ValueError, match="trainer_state.json: missing"):
        train(_recipe(recipe_file, out, "train.steps=3", f'checkpoint.resume="{out}/checkpoints/step_3"'))


def test_export_then_load_pretrained_gives_identical_logits(recipe_file, tmp_path, capsys):
    out = tmp_path / "run"
    result = train(_recipe(recipe_file, out, "train.steps=3", "checkpoint.save_every=3"))
    ids = torch.randint(0, result.model.cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = result.model.eval()(ids).logits
    biases = [n for n, _ in result.model.named_buffers() if n.endswith("gate.bias")]
    assert any(result.model.get_buffer(n).abs().sum() > 0 for n in biases)  # the router bias did move
    for layout, source in (("hf", out / "checkpoints" / "step_3"), ("official", out / "checkpoints")):
        exported = tmp_path / layout  # a run's checkpoints directory stands for its newest checkpoint
        assert main(["ckpt", "export", str(source), str(exported), "--layout", layout, "--dtype", "fp32"]) == 0
        model = load_pretrained(str(exported), dtype=torch.float32)
        with torch.no_grad():
            assert torch.equal(model.eval()(ids).logits, want), layout
        assert all(torch.equal(model.get_buffer(n), result.model.get_buffer(n)) for n in biases), layout
    capsys.readouterr()
    assert main(["ckpt", "inspect", str(out / "checkpoints" / "step_3")]) == 2  # a training checkpoint
    assert "`trex ckpt export" in capsys.readouterr().err
    # a run, its checkpoints, one of them: convert and inspect name the commands that read it (those exported
    # above; the run directory's export is run here as written)
    converts = {}
    for src, trained in ((out, out / "checkpoints"), (out / "checkpoints", out / "checkpoints"),
                         (out / "checkpoints" / "step_3", out / "checkpoints" / "step_3")):
        capsys.readouterr()
        assert main(["ckpt", "inspect", str(src)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "training checkpoint" in err, err
        commands = re.findall(r"`(trex ckpt [^`]*)`", err)
        assert commands == [f"trex ckpt verify {trained}", f"trex ckpt export {trained} OUT --layout hf"], err
        assert main(shlex.split(commands[0])[1:]) == 0
        dst = tmp_path / "converted"
        assert main(["ckpt", "convert", str(src), str(dst), "--layout", "official", "--dtype", "fp32"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "training checkpoint" in err and "no such config" not in err, err
        converts[src] = err.split(": ")[-1].strip()
        assert converts[src] == f"trex ckpt export {trained} {dst} --layout official --dtype fp32", err
    assert main(shlex.split(converts[out])[1:]) == 0
    model = load_pretrained(str(tmp_path / "converted"), dtype=torch.float32)
    with torch.no_grad():
        assert torch.equal(model.eval()(ids).logits, want)


class _Position:
    def __init__(self):
        self.pos = 0

    def state_dict(self):
        return {"pos": self.pos}

    def load_state_dict(self, state):
        self.pos = state["pos"]


def _bf16_state():
    from trex import device
    from trex.checkpoint.training import RunState
    from trex.models import build_model
    from trex.models.deepseek_v4.config import tiny
    from trex.precision import StepGuard
    from trex.train.optim import OptimSection, build_optimizer
    from trex.train.schedule import ScheduleSection, build_scheduler

    model = build_model(tiny(), seed=0).to(torch.bfloat16)
    optimizer = build_optimizer(model, OptimSection(lr=1e-2))
    return RunState(model, optimizer, build_scheduler(optimizer, ScheduleSection(warmup_steps=2), 10), StepGuard(3),
                    _Position(), device.detect("cpu"))


def _step(state, seed):
    ids = torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(seed))
    state.model(ids, labels=ids).loss.backward()
    state.optimizer.step()
    state.optimizer.zero_grad(set_to_none=True)
    state.scheduler.step()
    state.data.pos += 1


def test_async_save_round_trips_bf16_parameters_and_fp32_optimizer_state(tmp_path):
    from trex.checkpoint.training import load_checkpoint, save_checkpoint
    from trex.train.schedule import ScheduleSection, lr_multiplier

    a = _bf16_state()
    for seed in range(2):
        _step(a, seed)
    pending = save_checkpoint(str(tmp_path), 2, a, async_save=True)
    assert list_checkpoints(tmp_path) == []  # not published while in flight
    expected = {k: v.clone() for k, v in a.model.state_dict().items()}
    _step(a, 2)  # training goes on: the save holds the step-2 state
    path = pending.finalize()
    assert verify_checkpoint(path).ok

    b = _bf16_state()
    assert load_checkpoint(path, b).step == 2 and b.data.pos == 2
    assert all(torch.equal(b.model.state_dict()[k], v) for k, v in expected.items())
    masters = [s["master"] for s in b.optimizer.state.values() if "master" in s]
    assert masters and all(m.dtype == torch.float32 for m in masters)
    want_lr = 1e-2 * lr_multiplier(2, 10, ScheduleSection(warmup_steps=2))
    assert b.scheduler.last_epoch == 2 and all(g["lr"] == want_lr for g in b.optimizer.param_groups)
    _step(b, 2)  # the same step from the restored state lands on the same weights
    assert all(torch.equal(b.model.state_dict()[k], v) for k, v in a.model.state_dict().items())


def test_resume_auto_when_every_checkpoint_is_corrupt_is_an_error_not_a_fresh_start(recipe_file, tmp_path):
    out = tmp_path / "run"
    train(_recipe(recipe_file, out, "train.steps=4", "checkpoint.save_every=2"))
    for step_dir in (out / "checkpoints").iterdir():
        os.remove(step_dir / "manifest.json")
    with pytest.raises(ValueError, match=r"none of the 2 checkpoints .* verifies .*--resume"):
        train(_recipe(recipe_file, out, "train.steps=6", 'checkpoint.resume="auto"'))


def _steps(path) -> list[int]:
    return [json.loads(line)["step"] for line in open(path) if line.strip()]


def test_resume_after_a_kill_keeps_each_step_once_in_metrics_and_signals(recipe_file, tmp_path):
    """Steps logged after the last checkpoint and before a kill are dropped on resume: the resumed
    values replace them, in metrics.jsonl and in the fidelity signal files."""
    out = tmp_path / "run"
    train(_recipe(recipe_file, out, "train.steps=6", "checkpoint.save_every=3", "fidelity.every=1"))
    shutil.rmtree(out / "checkpoints" / "step_6")  # killed after logging steps 4-6, before the step-6 save
    train(_recipe(recipe_file, out, "train.steps=6", "checkpoint.save_every=3", "fidelity.every=1",
                  'checkpoint.resume="auto"'))
    for name in ("metrics.jsonl", "grad_norms.jsonl", "probe.jsonl"):
        assert _steps(out / name) == [1, 2, 3, 4, 5, 6], name


def test_resume_auto_of_a_run_stopped_before_its_first_save_trains_it_again_once(recipe_file, tmp_path, caplog):
    out = tmp_path / "run"
    train(_recipe(recipe_file, out, "train.steps=4", "checkpoint.save_every=3", "fidelity.every=1"))
    shutil.rmtree(out / "checkpoints")  # killed after logging steps 1-4, before any save was published
    with caplog.at_level(logging.WARNING, logger="trex"):
        train(_recipe(recipe_file, out, "train.steps=4", "checkpoint.save_every=3", "fidelity.every=1",
                      'checkpoint.resume="auto"'))
    assert "no checkpoint holds them: they are trained again" in caplog.text
    for name in ("metrics.jsonl", "grad_norms.jsonl", "probe.jsonl"):
        assert _steps(out / name) == [1, 2, 3, 4], name


def test_resuming_from_an_older_checkpoint_names_the_newer_one_that_holds_the_replaced_steps(tmp_path, caplog):
    """--resume PATH/step_6 of a run that went on to step_12: the logged steps after 6 are replaced,
    and the warning says that step_12 holds them (not that no checkpoint does)."""
    from trex.train.run_dir import RunDir

    run, ckpts = tmp_path / "run", tmp_path / "run" / "checkpoints"
    for step in (6, 12, 14):
        (ckpts / f"step_{step}").mkdir(parents=True)
        if step != 14:  # step_14: a save that did not finish holds nothing
            (ckpts / f"step_{step}" / "manifest.json").write_text("{}")
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, 15)))
    run_dir = RunDir(str(run))
    with caplog.at_level(logging.WARNING, logger="trex"):
        run_dir.begin(6, False, ["metrics.jsonl"], str(ckpts))
    run_dir.close()
    assert _steps(run / "metrics.jsonl") == [1, 2, 3, 4, 5, 6]
    assert "no checkpoint holds" not in caplog.text
    assert (f"resumed from step 6: the logged steps after it are trained again (8 logged lines replaced), although "
            f"step_12 holds the run up to step 12 (--resume {ckpts}/step_12 keeps those steps") in caplog.text


def test_resume_removes_and_names_the_save_a_kill_left_unfinished(tmp_path, caplog):
    """A rank killed while it wrote step 6 leaves .tmp.step_6: the restart removes it and says so."""
    from trex.checkpoint.training import CheckpointSection, Checkpointer

    unfinished = tmp_path / "checkpoints" / ".tmp.step_6"
    (unfinished / "rng").mkdir(parents=True)
    ckpt = Checkpointer(CheckpointSection(save_every=3, resume="auto"), str(tmp_path), state=None)
    with caplog.at_level(logging.WARNING, logger="trex"):
        assert ckpt.resume() is None  # no checkpoint yet: from step 1
    assert not unfinished.exists()
    assert "removed a checkpoint save that did not finish (.tmp.step_6" in caplog.text


def test_a_second_run_into_the_same_directory_refuses_or_overwrites(recipe_file, tmp_path):
    out = tmp_path / "run"
    train(_recipe(recipe_file, out, "train.steps=4", "checkpoint.save_every=2"))
    with pytest.raises(ValueError, match=r"already holds a run \(metrics.jsonl, checkpoints step_2, step_4\): "
                                         r"pass --resume auto"):
        train(_recipe(recipe_file, out, "train.steps=3"))
    assert _steps(out / "metrics.jsonl") == [1, 2, 3, 4]  # untouched by the refused run
    train(_recipe(recipe_file, out, "train.steps=3", "train.overwrite=true"))
    assert _steps(out / "metrics.jsonl") == [1, 2, 3]
    assert not (out / "checkpoints" / "step_4").exists()  # the earlier run's checkpoints went with it
    assert len(os.listdir(out / "tensorboard")) == 1


def test_checkpoint_index_cannot_plant_attributes(tmp_path):
    """The index unpickler builds allowed classes only, and sets only their dataclass fields."""
    import pickle

    from torch.distributed.checkpoint import metadata as dcp_metadata

    from trex.checkpoint.manifest import DCP_INDEX, read_dcp_index

    meta = dcp_metadata.Metadata(state_dict_metadata={})
    (tmp_path / DCP_INDEX).write_bytes(pickle.dumps(meta))
    assert read_dcp_index(str(tmp_path)).state_dict_metadata == {}
    meta.planted = "code path"  # BUILD would set it on the object inside the trainer
    (tmp_path / DCP_INDEX).write_bytes(pickle.dumps(meta))
    with pytest.raises(ValueError, match="not a readable checkpoint index .*sets other than its fields"):
        read_dcp_index(str(tmp_path))
