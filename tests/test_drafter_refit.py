"""The DSpark drafter's re-fit (``[drafter]``, trex.train.drafter_refit): its training forward against the
decode-time drafts, the recipe section, the re-fit in the training loop (resume, export) and the acceptance
it restores (a tiny V4.1 whose target is post-trained away from its drafter)."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors import safe_open
from test_model_v41 import DSPARK, official_drafter, official_model

from trex.train.drafter_refit import DrafterSection


def test_the_training_forward_drafts_what_each_decode_step_drafts():
    """``DSparkDrafter.forward`` (every anchor of a left-padded sequence at once, teacher-forced) gives each
    anchor's logits (Markov bias included) and confidences that ``draft`` computes at that decode step, fed
    the same token, hidden and previous tokens: within 1e-5 relative in fp32 on the official fixture's
    weights, the window (8) wrapping, a padded row masking its padding."""
    with safe_open(DSPARK, "pt") as f:
        tensors, meta = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    model = official_model(tensors, meta)
    drafter = official_drafter(tensors, model.cfg)
    ids = tensors["input_ids"]
    B, N = ids.shape
    T = drafter.cfg.dspark_block_size
    positions = torch.arange(N)[None] - torch.tensor([0, 3])[:, None]  # row 1: three tokens of padding
    with torch.no_grad():
        hidden = model(ids, doc_ids=(positions >= 0).long(), tap_layers=drafter.target_layers).hidden
        start, anchors = 4, 9  # anchors 4 .. 12: the window (8) wraps
        logits, confidence = drafter(hidden, ids, positions, start, anchors, model.embed.weight, model.head.weight)
        cache = drafter.prefill(hidden[:, :start], positions[:, :start])
        for a in range(anchors):
            j = start + a
            fed = iter(range(j + 2, j + 2 + T))
            d = drafter.draft(cache, ids[:, j + 1], hidden[:, j], model.embed.weight, model.head.weight,
                              sample=lambda z: ids[:, next(fed)])  # the verified tokens before each position
            assert (d.logits - logits[:, a]).abs().max() <= 1e-5 * d.logits.abs().max(), a
            assert (d.confidence - confidence[:, a]).abs().max() <= 1e-5 * d.confidence.abs().max(), a
    with pytest.raises(ValueError, match="need ids up to"):
        drafter(hidden, ids, positions, N - T - 1, 1, model.embed.weight, model.head.weight)


@pytest.mark.parametrize("key, value, message", [
    ("steps", 0, "drafter.steps = 0; expected an integer >= 1"),
    ("every_n", -1, "drafter.every_n = -1; expected an integer >= 0"),
    ("tv", -0.5, "drafter.tv = -0.5; expected a value >= 0"),
    ("sampling", "beam", "drafter.sampling = 'beam'; expected one of greedy, sampled"),
    ("temperature", 0.0, "drafter.temperature = 0.0; expected a value > 0"),
])
def test_the_section_names_the_key_it_refuses(key, value, message):
    with pytest.raises(ValueError) as e:
        DrafterSection(**{key: value})
    assert str(e.value).startswith(message) and "\n" not in str(e.value)
    with pytest.raises(ValueError, match="all 0"):
        DrafterSection(ce=0, tv=0, confidence=0)
    assert (DrafterSection().ce, DrafterSection().tv, DrafterSection().confidence) == (0.1, 0.9, 1.0)


# ---- the re-fit in the training loop ------------------------------------------------------------------------
DSPARK_OVERRIDES = ("model.overrides={num_nextn_predict_layers=2, dspark_target_layer_ids=[4,5], dspark_block_size=3, "
                    "dspark_markov_rank=16, dspark_n_routed_experts=4, dspark_num_experts_per_tok=2, "
                    "dspark_noise_token_id=3, hc_sinkhorn_iters=3}")


def _sft_with_drafter(tmp_path, out, *extra):
    from arithmetic_data import write_sft

    from trex.recipe import load
    from trex.train.config import TrainRecipe

    data = tmp_path / "sft.jsonl"
    if not data.exists():
        write_sft(tmp_path, n_train=40, n_eval=4)
    return load(TrainRecipe, overrides=[
        DSPARK_OVERRIDES, 'model.preset="tiny-v4.1"', f'data.paths=["{data}"]', 'data.tokenizer="compact"',
        "data.seq_len=64", "train.steps=1", "train.progress=false", "fidelity.every=0", f'train.out="{out}"',
        "drafter.enabled=true", "drafter.steps=4", "drafter.new_tokens=6", "drafter.prompts_per_step=2",
        "drafter.held_out=1", "drafter.measure_tokens=6", "drafter.lr=1e-3", "checkpoint.save_every=2", *extra])


def _dcp_tensors(path) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(path), str(path) + ".pt")
    return torch.load(str(path) + ".pt", weights_only=True)


def test_an_sft_job_refits_its_drafter_and_a_resumed_refit_repeats_it_bit_for_bit(tmp_path):
    """SFT on a tiny V4.1 with ``[drafter]``: after the main steps the drafter trains 4 re-fit steps on the
    target's continuations of the SFT records' prompts, checkpointed like main steps (drafter/step_2, step_4);
    summary.json carries acceptance (a) base, (b) post-trained with the old drafter, (c) re-fit, and the
    re-fit's cost; the drafter is exported in the released mtp.* layout, which ``load_drafter`` reads back, and
    `trex ckpt export` of the run's checkpoint carries it with the model and the run's tokenizer (it loads).
    The same run resumed from its re-fit checkpoint at step 2 (the main step done) takes steps 3 and 4 again
    bit for bit: their losses, gradient norms, the step-4 checkpoint's every tensor and the exported bytes."""
    from trex.checkpoint.export import export_checkpoint
    from trex.checkpoint.load import load_drafter, load_pretrained
    from trex.train.loop import train

    out = tmp_path / "run"
    summary = train(_sft_with_drafter(tmp_path, out)).summary
    drafter = summary["drafter"]
    assert drafter["steps"] == 4 and drafter["phases"] == 1
    assert set(drafter["acceptance"]) == {"base", "post_trained_old", "refit"}
    assert all(a["steps"] > 0 for a in drafter["acceptance"].values())
    assert drafter["time_s"] > 0 and drafter["main_time_s"] > 0
    rows = [json.loads(line) for line in open(out / "drafter_metrics.jsonl")]
    assert [r["drafter_step"] for r in rows] == [1, 2, 3, 4] and rows[-1]["drafter/loss"] < rows[0]["drafter/loss"]
    ckpts = out / "checkpoints" / "drafter"
    assert sorted(os.listdir(ckpts)) == ["before", "released", "step_2", "step_4"]
    refit = _dcp_tensors(ckpts / "step_4")
    loaded = load_drafter(str(ckpts / "released"), dtype=torch.float32, device="cpu")
    for key, value in loaded.state_dict().items():  # as exported: bf16 (sinks, gains fp32) or FP8 / FP4
        assert torch.allclose(value, refit["model"][key], rtol=2**-8, atol=0), key
    exported = (ckpts / "released" / "model-00001-of-00001.safetensors").read_bytes()
    export_checkpoint(str(out / "checkpoints" / "step_1"), str(tmp_path / "export"), layout="official")
    served = load_drafter(str(tmp_path / "export"), dtype=torch.float32, device="cpu")  # `trex ckpt export` carries it
    assert all(torch.equal(v, loaded.state_dict()[k]) for k, v in served.state_dict().items())
    # the model too: a run on a preset exports the tokenizer it trained with, which Engram hashes through
    assert load_pretrained(str(tmp_path / "export"), dtype=torch.float32, device="cpu").engram_hasher.ready

    shutil.rmtree(ckpts / "step_4")
    shutil.rmtree(ckpts / "released")
    again = train(_sft_with_drafter(tmp_path, out, 'checkpoint.resume="auto"')).summary["drafter"]
    rows_again = [json.loads(line) for line in open(out / "drafter_metrics.jsonl")]
    assert [r["drafter_step"] for r in rows_again] == [1, 2, 3, 4]
    for a, b in zip(rows, rows_again):
        assert {k: v for k, v in a.items() if k != "drafter/step_time_s"} == \
               {k: v for k, v in b.items() if k != "drafter/step_time_s"}
    resumed = _dcp_tensors(ckpts / "step_4")
    assert set(resumed["model"]) == set(refit["model"])
    assert all(torch.equal(resumed["model"][k], refit["model"][k]) for k in refit["model"])
    assert (ckpts / "released" / "model-00001-of-00001.safetensors").read_bytes() == exported
    assert again["acceptance"] == drafter["acceptance"]  # (a) kept from the first start, (b) and (c) measured again


# ---- the demonstration: acceptance falls with post-training, the re-fit restores it -----------------------------
def _counting(start: int, stride: int, n: int) -> list[int]:
    """A task's sequence: ids 4 .. 51 counting by ``stride`` (mod 48) from ``start``."""
    return [4 + (start + stride * j) % 48 for j in range(n)]


def _post_train(model, stride: int, steps: int) -> None:
    """SFT of the target on counting by ``stride`` (AdamW, lr 3e-3, 8 rows of 16)."""
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for s in range(steps):
        rows = torch.tensor([_counting(5 * s + 3 * i, stride, 16) for i in range(8)])
        model(rows, labels=rows).loss.backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.slow
def test_a_post_trained_target_accepts_fewer_drafts_and_the_refit_restores_them(tmp_path):
    """A tiny V4.1 (two DSpark stages, blocks of 3) trained to count by 1; its drafter fitted to it by the re-fit
    (``DrafterRefit.phase``): (a) its acceptance on held-out prompts, measured as ``trex fidelity drafter`` does.
    The target is then post-trained to count by 3: with the old drafter (b) falls below (a); re-fitted on the
    new target's continuations, (c) is at least (a). The re-fit step reads the host only for the prompts it
    draws (none: its one read is the loop's)."""
    from trex import device as device_layer
    from trex.checkpoint.training import CheckpointSection
    from trex.models.deepseek_v4.config_v41 import tiny_v41
    from trex.models.deepseek_v4.dspark import DSparkDrafter
    from trex.models.deepseek_v4.model_v41 import DeepseekV41
    from trex.parallel.mesh import Parallel
    from trex.syncs import SyncCounter
    from trex.train.drafter_refit import DrafterRefit, trainable

    cfg = tiny_v41(vocab_size=64, num_nextn_predict_layers=2, dspark_target_layer_ids=[4, 5], dspark_block_size=3,
                   dspark_markov_rank=16, dspark_n_routed_experts=4, dspark_num_experts_per_tok=2,
                   dspark_noise_token_id=63, engram_compressed_vocab_size=64, hc_sinkhorn_iters=3)
    torch.manual_seed(0)
    model = DeepseekV41(cfg)
    model.init_weights(0)
    model.set_engram_token_map(list(range(64)), 64)
    prompts = [_counting(5 * i % 48, 1, 3) + _counting(5 * i % 48 + 7, 3, 2) for i in range(20)]  # both tasks' steps
    section = DrafterSection(enabled=True, steps=20, lr=3e-3, new_tokens=8, prompts_per_step=8, held_out=6,
                             measure_tokens=12)
    refit = DrafterRefit(section, DSparkDrafter(cfg), prompts, Parallel(), device_layer.detect("cpu"), 0, (),
                         CheckpointSection(), str(tmp_path))
    _post_train(model, 1, 20)
    refit.phase(model, 20)
    base = refit.acceptance(model).mean_accepted  # (a)
    _post_train(model, 3, 20)
    old = refit.acceptance(model).mean_accepted  # (b)
    with SyncCounter() as syncs, trainable(refit.params):
        refit._step(model, 20)
    assert syncs.count == 0, syncs.report()
    refit.done = 21
    refit.phase(model, 40)
    refit_acc = refit.acceptance(model).mean_accepted  # (c)
    print(f"acceptance (a) {base:.3f} (b) {old:.3f} (c) {refit_acc:.3f}")
    assert old < base <= refit_acc, (base, old, refit_acc)


def run_layouts(tmp_path, common: list[str], runs: dict) -> tuple[dict, dict, dict, dict]:
    """`trex train` of ``common`` arguments once per layout of ``runs`` (name -> (processes, extra arguments)),
    in tmp_path/name -> (the main step's metrics row, the re-fit's rows, summary.json's drafter, the step-4 re-fit
    checkpoint's tensors), each by name."""
    from trex_run import trex

    main, rows, summaries, weights = {}, {}, {}, {}
    for name, (procs, extra) in runs.items():
        proc = trex([*common, *extra, "--out", str(tmp_path / name)], procs=procs, env={"TREX_DEVICE": "cpu"})
        assert proc.returncode == 0, (name, proc.stderr[-3000:])
        (main[name],) = [json.loads(line) for line in open(tmp_path / name / "metrics.jsonl")]
        rows[name] = [json.loads(line) for line in open(tmp_path / name / "drafter_metrics.jsonl")]
        summaries[name] = json.loads((tmp_path / name / "summary.json").read_text())["drafter"]
        weights[name] = _dcp_tensors(tmp_path / name / "checkpoints" / "drafter" / "step_4")["model"]
    return main, rows, summaries, weights


@pytest.mark.slow
def test_fsdp2_expert_and_tensor_parallelism_on_two_ranks_refit_with_the_losses_of_one_process(tmp_path):
    """`trex train` with ``[drafter]`` under `torchrun --nproc-per-node 2` as FSDP2 + EP2 (the main model's and
    the drafter's experts split over both ranks, each rank half of every re-fit step's prompts), and as TP2 x EP2
    (the target's embedding and head split by vocabulary: the re-fit's drafting and its acceptance measure read
    them gathered whole; both ranks every prompt, the drafter's experts over the tp group) against one
    process taking the same main step (its two micro-batches the two ranks' rows: the global batch is
    micro_batch_size x grad_accum x ranks): the main step's loss and gradient norm within 1e-6, every one of 4
    re-fit steps' loss, parts and gradient norm within 1e-5 of one process's, and the updated drafter (its DCP
    checkpoint) within 2% of the step's lr (AdamW's update is about lr g / |g|, and an element whose gradient
    is near 0 moves by its rounding). Re-fit steps 3 and 4 each put a left-padded prompt alone on a rank. The
    main step (lr 0) moves only the routers' biases (``bias_gamma``, which lr does not scale), alike at both
    layouts since they count the same tokens; with one row in one process 6 biases ended 2e-3 apart and
    step 2's prompt 36 was continued with logits 5e-3 apart."""
    from arithmetic_data import write_sft

    data = write_sft(tmp_path, n_train=40, n_eval=4)[0]
    (tmp_path / "recipe.toml").write_text('[train]\nmode = "sft"\n')
    common = ["train", str(tmp_path / "recipe.toml"), "--steps", "1", "--set", DSPARK_OVERRIDES,
              "--set", 'model.preset="tiny-v4.1"', "--set", f'data.paths=["{data}"]', "--set", 'data.tokenizer="compact"',
              "--set", "data.seq_len=64", "--set", "train.progress=false", "--set", "fidelity.every=0",
              "--set", "optim.lr=0", "--set", "drafter.enabled=true", "--set", "drafter.steps=4",
              "--set", "drafter.new_tokens=6", "--set", "drafter.prompts_per_step=2", "--set", "drafter.held_out=1",
              "--set", "drafter.measure_tokens=6", "--set", "drafter.lr=1e-3", "--set", "checkpoint.save_every=4"]
    runs = {"one": (1, ["--set", "train.grad_accum=2"]),
            "fsdp2-ep2": (2, ["--set", "parallel.dp_shard=2", "--set", "parallel.ep=2"]),
            "tp2-ep2": (2, ["--set", "parallel.tp=2", "--set", "parallel.dp_shard=1", "--set", "parallel.ep=2",
                            "--set", "train.grad_accum=2"])}
    main, rows, summaries, weights = run_layouts(tmp_path, common, runs)
    for layout in ("fsdp2-ep2", "tp2-ep2"):
        a, b = main["one"], main[layout]
        assert a["tokens"] == b["tokens"]
        assert all(abs(a[key] - b[key]) <= 1e-6 * abs(a[key]) for key in ("loss", "grad_norm")), (layout, a, b)
        assert [r["drafter_step"] for r in rows["one"]] == [r["drafter_step"] for r in rows[layout]] == [1, 2, 3, 4]
        for a, b in zip(rows["one"], rows[layout]):
            for key in ("loss", "ce", "tv", "confidence", "grad_norm"):
                key = f"drafter/{key}"
                assert abs(a[key] - b[key]) <= 1e-5 * abs(a[key]), (layout, a["drafter_step"], key, a[key], b[key])
        assert set(weights["one"]) == set(weights[layout])
        for key, value in weights["one"].items():
            assert torch.allclose(value, weights[layout][key], rtol=0, atol=2e-5), (layout, key)
        assert summaries["one"]["acceptance"] == summaries[layout]["acceptance"], layout


def grpo_inputs(tmp_path, monkeypatch) -> None:
    """A GRPO job's inputs in ``tmp_path``: prompts.jsonl (12 one-digit sums), a reward plug-in flat:constant
    (1.0 for every completion: no learning signal, the re-fit is what is tested) and an empty recipe.toml."""
    from trex.data.arithmetic import ArithmeticTask, generate
    from trex.data.records import write_jsonl

    train_p, _ = generate(ArithmeticTask(digits=1, n_train=12, n_eval=1))
    write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": p.question, "answer": p.answer} for p in train_p])
    (tmp_path / "flat.py").write_text("def constant(c):\n    return 1.0\n")
    (tmp_path / "recipe.toml").write_text("# everything set on the command line\n")
    monkeypatch.syspath_prepend(str(tmp_path))  # the reward plug-in


def test_grpo_refits_every_n_steps_and_after_the_last(tmp_path, monkeypatch):
    """GRPO on a tiny V4.1 with ``drafter.every_n = 2`` over 3 steps: a phase after step 2 (the policy still
    moving) and one after the last, 2 re-fit steps each, on the rollout prompts; a run resumed inside the
    first phase finishes it before its next main step and repeats the uninterrupted run's losses; every_n in
    SFT, or a model without a drafter, is one line naming the key."""
    from trex.cli import main
    from trex.models.deepseek_v4.config_v41 import tiny_v41

    grpo_inputs(tmp_path, monkeypatch)
    sets = ['train.mode="grpo"', 'data.tokenizer="compact"', "data.seq_len=32", "train.progress=false",
            "fidelity.every=0", "train.steps=3", DSPARK_OVERRIDES, 'model.preset="tiny-v4.1"',
            f'grpo.prompts=["{tmp_path}/prompts.jsonl"]', 'grpo.rewards=["flat:constant"]',
            "grpo.prompts_per_step=2", "grpo.group_size=2", "grpo.micro_batch_size=4", "sampling.max_new_tokens=2",
            "drafter.enabled=true", "drafter.every_n=2", "drafter.steps=2", "drafter.new_tokens=5",
            "drafter.prompts_per_step=2", "drafter.held_out=1", "drafter.measure_tokens=5", "checkpoint.save_every=1"]
    out = tmp_path / "run"
    args = ["train", str(tmp_path / "recipe.toml"), "--out", str(out), *[a for s in sets for a in ("--set", s)]]
    assert main(args) == 0
    summary = json.loads((out / "summary.json").read_text())["drafter"]
    assert summary["phases"] == 2 and summary["steps"] == 4
    rows = [json.loads(line) for line in open(out / "drafter_metrics.jsonl")]
    main_rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [r["drafter_step"] for r in rows] == [1, 2, 3, 4]
    # stopped inside the first phase (re-fit step 1 saved, main step 2 saved before it): the resumed run
    # finishes the phase before main step 3, then the last phase, as the uninterrupted run did
    ckpts = out / "checkpoints"
    for name in ("step_3", "drafter/step_2", "drafter/step_3", "drafter/step_4", "drafter/released"):
        shutil.rmtree(ckpts / name)
    assert main([*args, "--set", 'checkpoint.resume="auto"']) == 0
    strip = lambda rs: [{k: v for k, v in r.items() if "time" not in k and "tokens_per_s" not in k and k != "mfu"}  # noqa: E731
                        for r in rs]
    assert strip(json.loads(line) for line in open(out / "drafter_metrics.jsonl")) == strip(rows)
    again = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [r["loss"] for r in again] == [r["loss"] for r in main_rows] and len(again) == 3
    cfg = tiny_v41(num_nextn_predict_layers=2, dspark_target_layer_ids=[4, 5], dspark_block_size=3)
    with pytest.raises(ValueError, match="drafter.every_n = 2 re-fits during GRPO or distillation; train.mode is 'sft'"):
        DrafterSection(enabled=True, every_n=2).check_against("sft", cfg)
    with pytest.raises(ValueError, match="drafter.enabled: the model has no drafter to re-fit"):
        DrafterSection(enabled=True).check_against("grpo", tiny_v41())


def test_the_refit_export_of_a_released_drafter_is_the_released_drafter_byte_for_byte(tmp_path):
    """The export writes what DeepSeek's code loads: the official harness wrote tests/fixtures/v41/dspark_released
    from the official model's own weights (FP8 ``main_proj`` with 32x32 scales, bf16 heads); that drafter loaded
    and exported by the re-fit's writer unchanged gives every ``mtp.*`` tensor of it again, name, dtype and bytes."""
    from test_model_v41 import DSPARK_RELEASED
    from trex.checkpoint.load import load_drafter
    from trex.train.drafters.dspark import export as export_drafter

    drafter = load_drafter(DSPARK_RELEASED, dtype=torch.float32, device="cpu")
    out = export_drafter(drafter, DSPARK_RELEASED, str(tmp_path / "released"), target_step=0, main=True)

    def stages(directory):
        found = {}
        for name in sorted(os.listdir(directory)):
            if name.endswith(".safetensors"):
                with safe_open(os.path.join(directory, name), "pt") as f:
                    found.update({k: f.get_tensor(k) for k in f.keys() if k.startswith("mtp.")})
        return found

    released, exported = stages(DSPARK_RELEASED), stages(out)
    assert released and set(exported) == set(released), sorted(set(exported) ^ set(released))
    assert any(t.dtype == torch.float8_e4m3fn for t in released.values())  # the quantised stages are in the check
    for name, tensor in released.items():
        assert exported[name].dtype == tensor.dtype and exported[name].shape == tensor.shape, name
        assert torch.equal(exported[name].view(torch.uint8), tensor.view(torch.uint8)), name
