"""A run that moves mid-training: precision (fp32 -> bf16 -> fp32 -> fp16), layout (1 -> 2 -> 4 -> 1
processes, EP 1 -> 1 -> 2 -> 1) and device type (CPU -> the virtual accelerator -> CPU). Each leg resumes
the last one's checkpoint; the run keeps its step counter and data order, records every move, and
`trex fidelity seam` judges the steps after a move against a continuation on the old configuration.
The virtual accelerator's legs equal the CPU run step for step, and its checkpoint exports and
generates the same tokens on both devices."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

from trex_run import trex
from trex.checkpoint.manifest import verify_checkpoint
from trex.checkpoint.migration import migration, record
from trex.precision import DynamicLossScaler

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = "recipes/fidelity_default.toml"
VDEV = {"TREX_DEVICE_PLUGINS": "trex_vdev"}


def _trex(args: list[str], env: dict | None = None, procs: int = 1) -> subprocess.CompletedProcess:
    return trex(args, procs=procs, env=env)


def _leg_args(out, steps: int, *settings: str) -> list[str]:
    return ["train", RECIPE, "--out", str(out), "--resume", "auto", "--set", f"train.steps={steps}",
            "--set", "checkpoint.save_every=2", "--set", "checkpoint.keep_last=10", "--set", "fidelity.every=1", "--set", 'optim.ns_dtype="fp32"',
            "--set", "train.progress=false", "--set", "schedule.warmup_steps=1", *[a for s in settings for a in ("--set", s)]]


def _leg(out, steps: int, *settings: str, env=None, procs: int = 1):
    proc = _trex(_leg_args(out, steps, *settings), env, procs)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _rows(out):
    return [json.loads(line) for line in open(out / "metrics.jsonl")]


def _moves(out):
    return [json.loads(line) for line in open(out / "migrations.jsonl")]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The run that never moved: 8 steps of the recipe on one process, fp32 (both move tests' reference)."""
    out = tmp_path_factory.mktemp("migration") / "straight"
    _leg(out, 8)
    return out


def _seam(out, *args, env=None):
    return _trex(["fidelity", "seam", str(out), "--steps", "2", *args], env)


def test_a_move_is_recorded_with_the_profile_of_its_loosest_change(tmp_path):
    before = {"device": "cuda", "precision": "bf16", "world_size": 8, "dp_replicate": 1, "ep": 8, "cp": 1,
              "micro_batch_size": 2, "grad_accum": 1}
    assert migration(before, dict(before), 10, "ckpt") is None
    layout = migration(before, {**before, "world_size": 4, "ep": 4}, 10, "ckpt")
    assert layout["changed"] == ["world_size", "ep"] and layout["profile"] == "layout"
    both = migration(before, {**before, "device": "npu", "precision": "fp32"}, 20, "ckpt")
    assert both["profile"] == "vendor" and both["changed"] == ["device", "precision"]
    old = {**before, "device": None}  # a checkpoint that did not record its device type
    assert migration(old, {**before, "device": "npu"}, 10, "ckpt") is None
    record(str(tmp_path), 10, layout)
    record(str(tmp_path), 20, both)
    assert [m["step"] for m in record(str(tmp_path), 20, None)] == [10]  # resumed at 20 again: that move is undone


def test_a_scaler_entering_fp16_starts_from_its_initial_scale():
    fp16 = DynamicLossScaler(enabled=True, init_scale=1024.0)
    fp16.load_state_dict(DynamicLossScaler(enabled=False).state_dict())  # a bf16/fp32 checkpoint
    assert fp16.scale_value == 1024.0
    grown = DynamicLossScaler(enabled=True, init_scale=8.0)
    grown.load_state_dict({"scale": 4096.0, "clean_steps": 3, "enabled": True})
    assert grown.scale_value == 4096.0
    grown.load_state_dict({"scale": 2.0, "clean_steps": 0})  # checkpoints before the flag
    assert grown.scale_value == 2.0


@pytest.mark.slow
def test_precision_moves_fp32_bf16_fp32_fp16_continue_the_run_and_pass_their_seams(tmp_path, straight):
    run = tmp_path / "run"
    _leg(run, 2, 'precision.dtype="fp32"')
    bf16 = _leg(run, 4, 'precision.dtype="bf16"')
    assert "the run moves: precision fp32 -> bf16 at step 2" in bf16.stderr
    _leg(run, 6, 'precision.dtype="fp32"')
    _leg(run, 8, 'precision.dtype="fp16"')
    rows, ref = _rows(run), _rows(straight)
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert rows[1]["loss"] == ref[1]["loss"]  # before the first move: the same run
    assert [r["tokens"] for r in rows] == [r["tokens"] for r in ref]  # the same data order throughout
    assert rows[6]["loss_scale"] == 65536.0  # fp16 starts from its initial scale, not the fp32 run's 1.0
    moves = _moves(run)
    assert [(m["step"], m["from"]["precision"], m["to"]["precision"], m["profile"]) for m in moves] == [
        (2, "fp32", "bf16", "precision"), (4, "bf16", "fp32", "precision"), (6, "fp32", "fp16", "precision")]
    assert json.load(open(run / "summary.json"))["migrations"] == moves
    seam = _seam(run, "--at", "2")  # steps 3-4 in bf16 against fp32 continued from step 2
    assert seam.returncode == 0, seam.stdout[-2000:] + seam.stderr[-2000:]
    said = "seam at step 2 (precision fp32 -> bf16 at step 2): PASS under precision, steps 3-4"
    assert said in seam.stderr and said in (run / "train.log").read_text()
    seams = json.load(open(run / "summary.json"))["seams"]
    assert [(s["step"], s["profile"], s["verdict"], s["steps"]) for s in seams] == [(2, "precision", "PASS", [3, 4])]
    assert os.path.isfile(seams[0]["plot"])
    # a seam judged against a wrong reference fails: the straight run's steps 3-4 are fp32, and bitwise is exact
    strict = _seam(run, "--at", "2", "--reference", str(straight), "--profile", "bitwise")
    assert strict.returncode == 1 and "FAIL" in strict.stdout


@pytest.mark.slow
def test_layout_moves_one_two_four_one_processes_agree_with_the_run_that_never_moved(tmp_path, straight):
    """One process, then 2 FSDP accumulating 2 micro-batches (reduce-scatter every micro-batch), then
    4 FSDP+EP2 with selective activation checkpointing, then one process again, at the same global
    batch: every step's loss is the run's that never moved (DCP reshards parameters and optimizer
    state at each resume, and each layout computes the same step)."""
    run = tmp_path / "run"
    _leg(run, 2)
    two = _leg(run, 4, "parallel.dp_shard=2", "data.micro_batch_size=1", "train.grad_accum=2",
               "parallel.reduce_every_micro_batch=true", procs=2)
    assert "world_size 1 -> 2, micro_batch_size 4 -> 1, grad_accum 1 -> 2 at step 2" in two.stderr
    report = verify_checkpoint(str(run / "checkpoints" / "step_4"))
    assert report.ok and report.world["world_size"] == 2
    _leg(run, 6, "parallel.dp_shard=4", "parallel.ep=2", "data.micro_batch_size=1",
         'parallel.activation_checkpointing="selective"', procs=4)
    _leg(run, 8)
    rows, ref = _rows(run), _rows(straight)
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert ref[-1]["loss"] < ref[0]["loss"]
    for a, b in zip(rows, ref):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(b["loss"]), (a["step"], a["loss"], b["loss"])
    moves = _moves(run)
    assert [(m["step"], m["from"]["world_size"], m["to"]["world_size"], m["to"]["ep"]) for m in moves] == [
        (2, 1, 2, 1), (4, 2, 4, 2), (6, 4, 1, 1)]
    assert {m["profile"] for m in moves} == {"layout"}
    seam = _seam(run, "--at", "4")  # steps 5-6 on 4 processes against 2 processes continued from step 4
    assert seam.returncode == 0, seam.stdout[-2000:] + seam.stderr[-2000:]
    assert "seam at step 4 (world_size 2 -> 4" in seam.stderr and "PASS under layout" in seam.stderr


def test_a_v41_run_moves_its_micro_batch_split_and_continues_the_run_that_never_moved(tmp_path):
    """DeepSeek-V4.1 (Engram tables, shared KV) through a checkpoint and a move: 4 rows at once for 2 steps,
    then 2 rows accumulated twice, resumed from step 2; every step equals the run that never moved."""
    v41 = ('model.preset="tiny-v4.1"', "fidelity.every=0")
    straight, run = tmp_path / "straight", tmp_path / "run"
    _leg(straight, 4, *v41)
    _leg(run, 2, *v41)
    moved = _leg(run, 4, *v41, "data.micro_batch_size=2", "train.grad_accum=2")
    assert "micro_batch_size 4 -> 2, grad_accum 1 -> 2 at step 2" in moved.stderr
    rows, ref = _rows(run), _rows(straight)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    same = ("loss", "grad_norm", "lr", "tokens")
    assert [[r[k] for k in same] for r in rows[:2]] == [[r[k] for k in same] for r in ref[:2]]  # before the move
    for a, b in zip(rows[2:], ref[2:]):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(b["loss"]), (a["step"], a["loss"], b["loss"])
    assert [(m["step"], m["profile"]) for m in _moves(run)] == [(2, "layout")]


V3 = ('model.preset="tiny-v3"', "model.overrides={}", "fidelity.every=0", 'optim.name="adamw"')


@pytest.fixture(scope="module")
def v3_straight(tmp_path_factory):
    """The DeepSeek-V3 run that never moved: 6 steps of tiny-v3 on one process, fp32, AdamW."""
    out = tmp_path_factory.mktemp("migration_v3") / "straight"
    _leg(out, 6, *V3)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("split", ["cp", "tp"])
def test_a_v3_run_moves_onto_two_ranks_and_back_and_continues_the_run_that_never_moved(tmp_path, v3_straight,
                                                                                      split):
    """DeepSeek-V3 through checkpoints and two layout moves: one process for 2 steps, then two ranks resumed from
    step 2 (DCP reshards): every row split over them (cp = 2, MLA gathering its KV latents; FSDP2 over the two),
    or every block's heads, FFN widths and the vocabulary split over them and the routed experts over the same
    two ranks as their expert-parallel group (tp = 2, ep = 2: the tensor- and expert-parallel slices of the
    checkpoint's tensors); then one process again from the two ranks' step 4 (the tp = 2 checkpoint's slices,
    and AdamW's moments, put back together). The tp = 2 run's step 4 also resumes, in a copy of the run, under
    FSDP2 on the same two ranks (dp_shard = 2, tp = 1, ep = 1, two rows a rank: the slices put back together and
    sharded again by rows; measured: loss 1.1e-7, gradient norm 1.7e-7 relative, and 28% off at step 6 with
    AdamW's moments not restored there). Every step's loss and gradient norm within 1e-5 of the run that never
    moved (so also `trex train` at cp = 2 and at tp = 2 x ep = 2 against one process), and every move recorded
    under the layout profile."""
    run = tmp_path / "run"
    _leg(run, 2, *V3)
    experts = ("parallel.ep=2",) if split == "tp" else ()
    moved = _leg(run, 4, *V3, f"parallel.{split}=2", "parallel.dp_shard=1", *experts, procs=2)
    assert "world_size 1 -> 2" in moved.stderr and f"{split} 1 -> 2" in moved.stderr, moved.stderr[-2000:]
    runs = [run]
    if split == "tp":  # the tp = 2 checkpoint resumed under FSDP2 on the same two ranks
        fsdp = tmp_path / "fsdp"
        shutil.copytree(run, fsdp)
        sharded = _leg(fsdp, 6, *V3, "parallel.dp_shard=2", "data.micro_batch_size=2", procs=2)
        assert "ep 2 -> 1, tp 2 -> 1, micro_batch_size 4 -> 2 at step 4" in sharded.stderr, sharded.stderr[-2000:]
        runs.append(fsdp)
    back = _leg(run, 6, *V3)
    assert "world_size 2 -> 1" in back.stderr and f"{split} 2 -> 1" in back.stderr, back.stderr[-2000:]
    ref = _rows(v3_straight)
    for out in runs:
        rows = _rows(out)
        assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
        for a, b in zip(rows, ref):
            for key in ("loss", "grad_norm"):
                assert abs(a[key] - b[key]) <= 1e-5 * abs(b[key]), (out.name, a["step"], key, a[key], b[key])
        assert [(m["step"], m["profile"]) for m in _moves(out)] == [(2, "layout"), (4, "layout")]


GENERATE = """
import json, sys, torch
from trex import device
from trex.rollout.generate import greedy_generate
from trex.checkpoint import load_pretrained
dev = device.detect()
model = load_pretrained(sys.argv[1], dtype=torch.float32, device=dev.name).eval()
prompts = [[5, 9, 17, 3], [7, 7, 2], [11, 4, 30, 8, 1]]
print(json.dumps({"device": dev.type, "ids": greedy_generate(model, prompts, 8, stop_id=0, pad_id=0)}))
"""


@pytest.mark.slow
def test_device_moves_cpu_virtual_device_cpu(tmp_path, straight):
    """trex_vdev, a PrivateUse1 accelerator registered from Python that trex finds through
    torch.accelerator with no special case, keeps its data in CPU memory: every step equals the run
    that never left the CPU. A checkpoint saved on it resumes on the CPU and back, exports, and
    generates the same tokens on both devices."""
    from trex_run import python, trex_sequence  # the plugin's commands in one process of their own

    run, exported = tmp_path / "run", tmp_path / "exported"  # step_4 is saved on the virtual device
    *legs, export, seam = trex_sequence([
        *[_leg_args(run, steps, f'train.device="{device}"') for steps, device in ((2, "cpu"), (4, "vdev"), (6, "cpu"))],
        ["ckpt", "export", str(run / "checkpoints" / "step_4"), str(exported), "--layout", "hf"],
        ["fidelity", "seam", str(run), "--steps", "2"],  # back on the CPU, against the virtual device from step 4
    ], env=VDEV)
    for leg in legs:
        assert leg.returncode == 0, leg.stderr[-3000:]
    moves = _moves(run)
    assert [(m["step"], m["from"]["device"], m["to"]["device"], m["profile"]) for m in moves] == [
        (2, "cpu", "vdev", "vendor"), (4, "vdev", "cpu", "vendor")]
    rows, ref = _rows(run), _rows(straight)
    assert [r["step"] for r in rows] == list(range(1, 7))
    for a, b in zip(rows, ref):
        for key in ("loss", "grad_norm", "mtp_loss"):
            assert abs(a[key] - b[key]) <= 1e-6 * abs(b[key]), (key, a["step"], a[key], b[key])
    assert export.returncode == 0, export.stderr[-3000:]
    gen = {}
    for name, env in (("cpu", {"TREX_DEVICE": "cpu"}), ("vdev", {**VDEV, "TREX_DEVICE": "vdev"})):
        proc = python(GENERATE, [str(exported)], env=env)  # a process of its own, forked from a warm one
        assert proc.returncode == 0, proc.stderr[-2000:]
        gen[name] = json.loads(proc.stdout.strip().splitlines()[-1])
    assert gen["vdev"]["device"] == "vdev" and gen["cpu"]["device"] == "cpu"
    assert gen["vdev"]["ids"] == gen["cpu"]["ids"] and any(gen["cpu"]["ids"])
    assert seam.returncode == 0, seam.stdout[-2000:] + seam.stderr[-2000:]
    summary = json.load(open(run / "summary.json"))
    assert summary["seams"][0]["verdict"] == "PASS" and summary["seams"][0]["profile"] == "vendor"
    # without the plugin the old device is not here: refused in one line (in a process of its own, where no
    # other test of this worker can have registered the plugin)
    missing = _seam(run, env={"TREX_DEVICE_PLUGINS": ""})
    assert missing.returncode == 2 and "pass --reference" in missing.stderr
