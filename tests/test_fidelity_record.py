"""The ladder between two clusters: a reference recorded on one process (statistics, not tensors) and
climbed against from another process, two ranks with FSDP2 + EP2, and the virtual device, with
another micro-batch split; the four planted divergences of the one-process ladder found through the
record at their rung and block; the record's size against its formula, and V4-Pro's estimate."""

from __future__ import annotations

import json
import os

import pytest
from test_fidelity_ladder import bf16_attention_in_layer_2, gradient_bug_in_layer_1, wrong_norm_eps
from trex_run import trex

from trex.cli import main
from trex.fidelity.profiles import get_profile
from trex.fidelity.record import climb, model_counts, read_record, record, record_bytes
from trex.models import build_model, get_preset
from trex.recipe import load
from trex.train.config import TrainRecipe
from trex.train.loop import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = os.path.join(ROOT, "recipes", "fidelity_default.toml")
DATA = os.path.join(ROOT, "fidelity", "data")
PATHS = [f"data.paths={json.dumps([os.path.join(DATA, 'arithmetic_sft.jsonl')])}",
         f"fidelity.probe_paths={json.dumps([os.path.join(DATA, 'arithmetic_probe.jsonl')])}", "schedule.warmup_steps=1"]
STEPS = 2


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The reference recorded on one CPU process, fp32, 4 rows a micro-batch."""
    out = tmp_path_factory.mktemp("record") / "ref"
    record(RECIPE, str(out), PATHS, steps=STEPS)
    return out


def _sets(*items: str) -> list[str]:
    return [a for item in items for a in ("--set", item)]


def test_the_record_holds_statistics_whose_size_is_the_formula(reference):
    manifest, sets = read_record(str(reference))
    counts = manifest["model"]
    assert len(sets["weights"].names) == len(sets["grads"].names) == counts["parameter_tensors"]
    assert len(sets["blocks"].names) == counts["blocks"]
    with open(reference / "stats.safetensors", "rb") as f:
        header = int.from_bytes(f.read(8), "little")
    payload = os.path.getsize(reference / "stats.safetensors") - 8 - header
    assert payload == record_bytes(counts["parameter_tensors"], counts["blocks"])
    assert manifest["steps"] == {"lr0": STEPS, "run": STEPS} and manifest["devices"]["device_type"] == "cpu"
    pro = model_counts(build_model(get_preset("deepseek-v4-pro"), device="meta"))
    checkpoint = pro["parameters"] // 2  # the smallest a checkpoint can be: every weight in FP4
    assert record_bytes(pro["parameter_tensors"], pro["blocks"]) <= 0.01 * checkpoint


def test_the_same_recipe_climbs_every_rung_exactly(reference, tmp_path):
    report = climb(RECIPE, str(reference), str(tmp_path / "ladder"), get_profile("layout"), PATHS)
    assert [r["status"] for r in report["rungs"]] == ["PASS"] * 5
    assert report["rungs"][0]["measures"]["loss_err"] == 0 and report["rungs"][0]["measures"]["min_block_cosine"] == 1
    assert report["rungs"][1]["measures"]["worst_parameter_err"] == 0  # equal checksums: exactly equal
    assert os.path.isfile(tmp_path / "ladder" / "ladder.md")


def test_deepseek_v41_records_and_climbs_against_another_micro_batch_split(tmp_path):
    """The ladder on V4.1's blocks (CSA2, Engram, single-pass mHC): a record, and a run accumulating two
    micro-batches of two rows that climbs every rung against it under the layout profile, not bitwise."""
    v41 = [*PATHS, 'model.preset="tiny-v4.1"']
    record(RECIPE, str(tmp_path / "ref"), v41, steps=STEPS)
    report = climb(RECIPE, str(tmp_path / "ref"), str(tmp_path / "ladder"), get_profile("layout"),
                   [*v41, "data.micro_batch_size=2", "train.grad_accum=2"])
    assert [r["status"] for r in report["rungs"]] == ["PASS"] * 5
    assert 0 < report["rungs"][1]["measures"]["worst_parameter_err"] < 1e-3


def test_deepseek_v3_records_climbs_finds_a_planted_divergence_and_reports(tmp_path, capsys):
    """The ladder on V3's blocks (MLA, a dense first layer, group-limited routing, MTP): a record; a run
    accumulating two micro-batches of two rows climbs every rung against it under the layout profile (not
    bitwise); a wrong norm epsilon in layer 2 is found at the forward rung in that block; `trex report` reads
    the ladder beside a plan of the released V3."""
    v3 = [*PATHS, 'model.preset="tiny-v3"', "model.overrides={}"]
    record(RECIPE, str(tmp_path / "ref"), v3, steps=STEPS)
    report = climb(RECIPE, str(tmp_path / "ref"), str(tmp_path / "ladder"), get_profile("layout"),
                   [*v3, "data.micro_batch_size=2", "train.grad_accum=2"])
    assert [r["status"] for r in report["rungs"]] == ["PASS"] * 5
    assert 0 < report["rungs"][1]["measures"]["worst_parameter_err"] < 1e-3
    planted = climb(RECIPE, str(tmp_path / "ref"), str(tmp_path / "planted"), get_profile("layout"), v3,
                    edit=wrong_norm_eps)
    assert planted["first_failing_rung"] == 1 and planted["rungs"][0]["departure"]["block"] == "layers.2"
    assert main(["plan", "--model", "deepseek-v3", "--hardware", "h200-sxm", "--devices", "256", "--layout",
                 "dp_shard=256,ep=64,recompute=full", "--format", "json"]) == 0
    (tmp_path / "plan.json").write_text(capsys.readouterr().out)
    assert main(["report", "--out", str(tmp_path / "report"), "--fidelity", str(tmp_path / "ladder"),
                 "--plan", str(tmp_path / "plan.json")]) == 0
    md = (tmp_path / "report" / "report.md").read_text()
    assert "### deepseek-v3 on 256 x h200-sxm" in md and "### Fidelity ladder on cpu: PASS" in md
    assert 'model.preset="tiny-v3"' in md and f"`{tmp_path / 'ladder' / 'ladder.json'}`" in md


def test_a_candidate_that_starts_from_other_weights_is_named_before_any_block(reference, tmp_path):
    report = climb(RECIPE, str(reference), str(tmp_path / "ladder"), get_profile("layout"), [*PATHS, "model.init_seed=1"])
    assert report["first_failing_rung"] == 1
    departure = report["rungs"][0]["departure"]
    assert departure["start"] == "embed.weight" and departure["direction_err"] > 0.5  # unrelated random weights
    assert "the starting weight embed.weight differs" in (tmp_path / "ladder" / "ladder.md").read_text()


@pytest.mark.parametrize("edit, variant, rung, where", [
    (wrong_norm_eps, [], 1, ("block", "layers.2")),
    (bf16_attention_in_layer_2, [], 1, ("block", "layers.2")),
    (gradient_bug_in_layer_1, [], 2, ("group", "layers.1.")),
    (None, ["optim.ns_iterations=[5, 2]"], 3, ("parameter", "layers.0.attn.wq_a")),  # the first Muon matrix
])
def test_a_planted_divergence_is_found_through_the_record_at_its_rung_and_block(reference, tmp_path, edit, variant,
                                                                                  rung, where):
    report = climb(RECIPE, str(reference), str(tmp_path / "ladder"), get_profile("layout"), [*PATHS, *variant],
                   edit=edit)
    assert report["first_failing_rung"] == rung
    departure = report["rungs"][rung - 1]["departure"]
    key, name = where
    assert str(departure[key]).startswith(name), departure
    if rung > 1:
        assert report["rungs"][0]["measures"]["loss_err"] == 0  # the forward is untouched
    if rung == 3:
        assert report["rungs"][1]["measures"]["worst_parameter_err"] == 0  # so are the gradients


@pytest.mark.parametrize("layout", [
    ["parallel.dp_shard=2", "parallel.ep=2", "data.micro_batch_size=2"],  # two rows each, experts split
    ["parallel.cp=2"],  # every row split in two: block outputs are sequence shards
], ids=["fsdp2-ep2", "cp2"])
def test_two_ranks_climb_against_a_one_process_record(reference, tmp_path, layout):
    out = tmp_path / "ladder"
    proc = trex(["fidelity", "ladder", RECIPE, "--reference", str(reference), "--out", str(out),
                 *_sets(*PATHS, *layout)], procs=2)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads((out / "ladder.json").read_text())
    assert [r["status"] for r in report["rungs"]] == ["PASS"] * 5
    assert report["layouts"]["run"]["world_size"] == 2 and report["layouts"]["reference"]["world_size"] == 1
    assert 0 < report["rungs"][1]["measures"]["worst_parameter_err"] < 1e-3  # not bitwise: a reduction order


def test_the_virtual_device_accumulating_two_micro_batches_climbs_against_the_record(reference, tmp_path):
    out = tmp_path / "ladder"
    proc = trex(["fidelity", "ladder", RECIPE, "--reference", str(reference), "--out", str(out), "--profile", "vendor",
                 # Newton-Schulz in fp32 as the record's: "auto" runs it in bf16 on a device whose bf16 is
                 # measured fast, which the virtual device's is on a CPU with AMX (a real difference, rung 3)
                 *_sets(*PATHS, 'train.device="vdev"', "data.micro_batch_size=2", "train.grad_accum=2",
                        'optim.ns_dtype="fp32"')],
                env={"TREX_DEVICE_PLUGINS": "trex_vdev"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads((out / "ladder.json").read_text())
    assert report["verdict"] == "PASS" and report["devices"]["run"]["device_type"] == "vdev"


def test_what_cannot_be_compared_is_one_line(reference, tmp_path, capsys):
    def ladder(ref, out, *settings):
        code = main(["fidelity", "ladder", RECIPE, "--reference", str(ref), "--out", str(tmp_path / out),
                     *_sets(*PATHS, *settings)])
        return code, capsys.readouterr().err

    code, err = ladder(reference, "a", "data.micro_batch_size=2")
    assert code == 2 and err.count("\n") == 1 and "rows a step" in err and not (tmp_path / "a").exists()
    code, err = ladder(tmp_path / "nothing", "b")
    assert code == 2 and "record.json: not found" in err and err.count("\n") == 1
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "record.json").write_text(json.dumps({"format": 99}))
    code, err = ladder(tmp_path / "bad", "c")
    assert code == 2 and "format 99" in err and err.count("\n") == 1


def test_a_seam_is_judged_against_a_continuation_recorded_from_its_checkpoint(tmp_path, capsys):
    """A run moves at step 4 (one row a micro-batch accumulated 4 times, from 4 rows at once); the old
    configuration's continuation of step_4 is recorded as if on the other cluster, and the seam is
    judged against that record; a record of another checkpoint is refused in one line."""
    run, ref = tmp_path / "run", tmp_path / "ref"
    common = [*PATHS, "checkpoint.save_every=4", "fidelity.every=1", f"train.out={json.dumps(str(run))}"]
    train(load(TrainRecipe, RECIPE, [*common, "train.steps=4"]))
    train(load(TrainRecipe, RECIPE, [*common, "train.steps=6", 'checkpoint.resume="auto"', "data.micro_batch_size=1",
                                     "train.grad_accum=4"]))
    capsys.readouterr()
    assert main(["fidelity", "record", RECIPE, "--from-checkpoint", str(run / "checkpoints" / "step_4"), "--steps", "2",
                 "--out", str(ref), *_sets(*PATHS, "fidelity.every=1")]) == 0
    assert "steps 5-6 after" in capsys.readouterr().out
    assert main(["fidelity", "seam", str(run), "--steps", "2", "--reference", str(ref)]) == 0
    entry = json.loads((run / "seams.json").read_text())[-1]
    assert entry["verdict"] == "PASS" and entry["profile"] == "layout" and entry["reference"] == str(ref / "continuation")
    other = json.loads((ref / "record.json").read_text())
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "record.json").write_text(json.dumps({**other, "step": 2}))
    capsys.readouterr()
    assert main(["fidelity", "seam", str(run), "--steps", "2", "--reference", str(tmp_path / "other")]) == 2
    err = capsys.readouterr().err
    assert "step 2" in err and err.count("\n") == 1
    assert main(["fidelity", "ladder", RECIPE, "--reference", str(ref), "--out", str(tmp_path / "l")]) == 2
    err = capsys.readouterr().err
    assert "continuation" in err and err.count("\n") == 1
