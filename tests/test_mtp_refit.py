"""``[drafter]`` on DeepSeek-V4's multi-token prediction modules (trex.train.drafters.mtp.MTPDrafter): whether
the re-fit helps them as a drafter (the demonstration docs/post_training.md quotes), and the job around it:
`trex train` in SFT and GRPO, resumed bit for bit, exported."""

import dataclasses
import json
import os

import shutil

import pytest
import torch
from test_drafter_refit import _counting, _dcp_tensors, grpo_inputs, run_layouts

from trex.train.drafter_refit import DrafterSection


def _tiny_v4_mtp():
    from trex.models.deepseek_v4.config import tiny

    return tiny(vocab_size=64, num_nextn_predict_layers=1)


def _post_train(model, stride: int, steps: int, mtp_weight: float) -> None:
    """SFT on counting by ``stride`` (AdamW lr 3e-3, 8 rows of 16): the main loss plus ``mtp_weight`` x the MTP
    modules' (0: the modules get no gradient, as in DPO / GRPO / distillation, and are left out of the step)."""
    params = [p for n, p in model.named_parameters() if mtp_weight or not n.startswith("mtp.")]
    opt = torch.optim.AdamW(params, lr=3e-3)
    for s in range(steps):
        rows = torch.tensor([_counting(5 * s + 3 * i, stride, 16) for i in range(8)])
        out = model(rows, labels=rows)
        (out.loss + mtp_weight * out.mtp_loss).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def _refit(model, tmp_path):
    from trex import device as device_layer
    from trex.checkpoint.training import CheckpointSection
    from trex.parallel.mesh import Parallel
    from trex.train.drafter_refit import DrafterRefit
    from trex.train.drafters.mtp import MTPDrafter

    prompts = [_counting(5 * i % 48, 1, 3) + _counting(5 * i % 48 + 7, 3, 2) for i in range(20)]  # both tasks
    section = DrafterSection(enabled=True, steps=20, lr=3e-3, new_tokens=8, prompts_per_step=8, held_out=6,
                             measure_tokens=12)
    return DrafterRefit(section, MTPDrafter(model), prompts, Parallel(), device_layer.detect("cpu"), 0, (),
                        CheckpointSection(), str(tmp_path))


@pytest.mark.slow
def test_the_refit_restores_the_mtp_drafter_where_the_objective_left_it_behind(tmp_path):
    """A tiny V4 with one MTP module trained to count by 1 with the main and MTP losses: (a) its modules'
    acceptance on held-out prompts as `trex fidelity drafter` measures it. Post-trained to count by 3 as RL
    does (the modules get no gradient): (b) falls below (a); re-fit, (c) >= (a). The same shift as SFT (main +
    0.1 MTP loss): the figures of (b) and (c) the docs quote. Only the MTP modules move in a re-fit, and its
    step reads nothing from the host."""
    from trex.models.deepseek_v4.model import DeepseekV4
    from trex.syncs import SyncCounter
    from trex.train.drafter_refit import trainable

    torch.manual_seed(0)
    base = DeepseekV4(_tiny_v4_mtp())
    base.init_weights(0)
    _post_train(base, 1, 20, mtp_weight=1.0)
    figures = {}
    for name, weight in (("rl", 0.0), ("sft", 0.1)):
        model = DeepseekV4(base.cfg)
        model.load_state_dict(base.state_dict())
        refit = _refit(model, tmp_path / name)
        a = refit.acceptance(model).mean_accepted
        _post_train(model, 3, 20, mtp_weight=weight)
        b = refit.acceptance(model).mean_accepted
        backbone = {k: v.clone() for k, v in model.state_dict().items() if not k.startswith("mtp.")}
        model.requires_grad_(False)  # the target frozen, as in a phase
        with SyncCounter() as syncs, trainable(refit.params):
            refit._step(model, 0)
        assert syncs.count == 0, syncs.report()
        refit.done = 1
        refit.phase(model, 20)
        c = refit.acceptance(model).mean_accepted
        assert all(torch.equal(v, model.state_dict()[k]) for k, v in backbone.items())
        figures[name] = (a, b, c)
    print("MTP acceptance (a, b, c): " + ", ".join(f"{k} {a:.3f} {b:.3f} {c:.3f}" for k, (a, b, c) in figures.items()))
    a, b, c = figures["rl"]
    assert b < a <= c, figures


@pytest.mark.parametrize("preset", ["tiny-v3", "tiny-v3.2"])
def test_the_refit_fits_the_v3_familys_mtp_module_to_its_target(preset, tmp_path):
    """The V3 family's MTP module (V3.2's with its indexer) re-fits the same way: a tiny V3 post-trained to count
    by 3 with the module left out (as RL leaves it) accepts more of its drafts after 20 re-fit steps, and only
    the module moved."""
    from trex.models.build import build_model
    from trex.models.registry import get_preset

    torch.manual_seed(0)
    model = build_model(dataclasses.replace(get_preset(preset), vocab_size=64), device="cpu")
    model.init_weights(0)
    _post_train(model, 3, 20, mtp_weight=0.0)
    refit = _refit(model, tmp_path)
    before = refit.acceptance(model).mean_accepted
    backbone = {k: v.clone() for k, v in model.state_dict().items() if not k.startswith("mtp.")}
    model.requires_grad_(False)
    refit.phase(model, 20)
    after = refit.acceptance(model).mean_accepted
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in backbone.items())
    assert after > before, (before, after)


# ---- the measure: what a speculative decoder verifies -------------------------------------------------------
def test_mtp_acceptance_is_what_a_speculative_decoder_verifies():
    """A tiny V4 with two MTP modules, left-padded batches: measure_mtp_acceptance's histogram equals verifying
    each step's draft (module j's argmax at g_k's place, fed g_{k+1}) by running the model over it without a
    cache; the batch size changes nothing; with every logit tied (the shared head zeroed) every draft is
    accepted, and a stop token at once leaves nothing to measure."""
    from test_model_v41 import _verified

    from trex.models.deepseek_v4.config import tiny
    from trex.models.deepseek_v4.model import DeepseekV4
    from trex.rollout.speculation import measure_mtp_acceptance, mtp_draft_steps

    torch.manual_seed(0)
    model = DeepseekV4(tiny(vocab_size=64, num_nextn_predict_layers=2))
    model.init_weights(0)
    model.eval()
    prompts = [[5, 9, 13, 17, 21, 25, 29], [40, 41, 42], [7, 3, 60, 2, 8, 11, 30, 31, 32, 33]]
    N, T = 12, 2
    generated, drafted = mtp_draft_steps(model, prompts, N, pad_id=0)
    expected = [0] * (T + 1)
    for prompt, row, row_drafts in zip(prompts, generated.tolist(), drafted.tolist()):
        for k in range(N - 1 - T):
            expected[_verified(model, prompt, row, k, row_drafts[k])] += 1
    got = measure_mtp_acceptance(model, prompts, N, pad_id=0)
    assert got.histogram == expected and got.steps == 3 * (N - 1 - T) and sum(expected[1:]) > 0
    assert measure_mtp_acceptance(model, prompts, N, pad_id=0, batch_size=1).histogram == expected
    with torch.no_grad():
        model.head.weight.zero_()
    agreed = measure_mtp_acceptance(model, prompts, N, pad_id=0)
    assert agreed.histogram == [0] * T + [agreed.steps] and agreed.mean_accepted == T
    assert measure_mtp_acceptance(model, prompts, N, pad_id=0, stop_ids=(0,)).steps == 0


def test_trex_fidelity_drafter_measures_mtp_modules_and_refuses_a_checkpoint_without_them(tmp_path, capsys):
    """`trex fidelity drafter` on a V4 checkpoint measures its MTP module (the same figures as the library call);
    a config with modules whose tensors the checkpoint lacks, or one with none, is one line, exit 2."""
    from trex.checkpoint.save import save_pretrained
    from trex.cli import main
    from trex.models.deepseek_v4.config import tiny
    from trex.models.deepseek_v4.model import DeepseekV4
    from trex.rollout.speculation import measure_mtp_acceptance

    torch.manual_seed(0)
    model = DeepseekV4(tiny(vocab_size=64))
    model.init_weights(0)
    save_pretrained(model, str(tmp_path / "v4"), dtype="fp32")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"ids": [3, 4, 5, 6, 7, 8]}\n{"ids": [9, 10]}\n')
    assert main(["fidelity", "drafter", str(tmp_path / "v4"), "--prompts", str(prompts), "--max-new-tokens", "8",
                 "--format", "json"]) == 0
    (entry,) = json.loads(capsys.readouterr().out).values()
    stop = () if model.cfg.eos_token_id is None else (model.cfg.eos_token_id,)
    direct = measure_mtp_acceptance(model.eval(), [[3, 4, 5, 6, 7, 8], [9, 10]], 8, pad_id=0, stop_ids=stop)
    assert entry["histogram"] == direct.histogram and len(entry["rates"]) == 1 and entry["steps"] > 0
    bare = DeepseekV4(tiny(vocab_size=64, num_nextn_predict_layers=0))
    bare.init_weights(0)
    save_pretrained(bare, str(tmp_path / "bare"), dtype="fp32")
    assert main(["fidelity", "drafter", str(tmp_path / "bare"), "--prompts", str(prompts)]) == 2
    assert "its config has no drafter" in capsys.readouterr().err
    config = json.loads((tmp_path / "bare" / "config.json").read_text())
    key = next(k for k in ("num_nextn_predict_layers", "n_mtp_layers", "num_mtp_layers") if k in config)
    (tmp_path / "bare" / "config.json").write_text(json.dumps({**config, key: 1}))
    assert main(["fidelity", "drafter", str(tmp_path / "bare"), "--prompts", str(prompts)]) == 2
    err = capsys.readouterr().err
    assert "no MTP module weights" in err and err.count("\n") == 1, err


def test_trex_fidelity_drafter_takes_chat_prompt_files_as_every_prompt_option_does(tmp_path, capsys):
    """`--prompts` takes {"messages"} records (and SFT records, and {"prompt"}) as grpo.prompts and drafter.prompts
    take them: the same token ids as trex.posttrain.on_policy.load_prompts in the same chat format; {"ids"}
    records as they are, in the same file."""
    from trex.checkpoint.save import save_pretrained
    from trex.cli import main
    from trex.data.tokenizer import compact_tokenizer
    from trex.fidelity.drafter import read_prompts
    from trex.models.deepseek_v4.config import tiny
    from trex.models.deepseek_v4.model import DeepseekV4
    from trex.posttrain.on_policy import load_prompts

    model = DeepseekV4(tiny(vocab_size=112))
    model.init_weights(0)
    save_pretrained(model, str(tmp_path / "v4"), dtype="fp32")
    tokenizer = compact_tokenizer()
    tokenizer.save(str(tmp_path / "v4" / "tokenizer.json"))
    chat = [{"messages": [{"role": "system", "content": "add"}, {"role": "user", "content": "2 plus 3?"}]},
            {"messages": [{"role": "user", "content": "4 plus 4?"}, {"role": "assistant", "content": "8"}]},
            {"prompt": "1 plus 1?"}]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chat))
    for fmt in ("deepseek-v4", "deepseek-v3"):
        expected = [p.ids for p in load_prompts([str(tmp_path / "chat.jsonl")], tokenizer, False, chat_format=fmt)]
        assert read_prompts(str(tmp_path / "chat.jsonl"), str(tmp_path / "v4"), fmt) == expected
    (tmp_path / "mixed.jsonl").write_text((tmp_path / "chat.jsonl").read_text() + '{"ids": [3, 4, 5]}\n')
    assert read_prompts(str(tmp_path / "mixed.jsonl"), str(tmp_path / "v4"))[-1] == [3, 4, 5]
    assert main(["fidelity", "drafter", str(tmp_path / "v4"), "--prompts", str(tmp_path / "mixed.jsonl"),
                 "--max-new-tokens", "4", "--format", "json"]) == 0
    (entry,) = json.loads(capsys.readouterr().out).values()
    assert entry["steps"] > 0 and entry["reason"] is None
    (tmp_path / "bad.jsonl").write_text('{"messages": [{"role": "assistant", "content": "hi"}]}\n')
    assert main(["fidelity", "drafter", str(tmp_path / "v4"), "--prompts", str(tmp_path / "bad.jsonl")]) == 2
    assert capsys.readouterr().err == (f"trex fidelity drafter: {tmp_path}/bad.jsonl:1: bad record (no_prompt): "
                                       "messages must end with a user or tool message (or one assistant turn after "
                                       "it)\n")


# ---- the re-fit in the training loop ------------------------------------------------------------------------
def _sft_with_mtp_refit(tmp_path, out, *extra):
    from arithmetic_data import write_sft

    from trex.recipe import load
    from trex.train.config import TrainRecipe

    data = tmp_path / "sft.jsonl"
    if not data.exists():
        write_sft(tmp_path, n_train=40, n_eval=4)
    return load(TrainRecipe, overrides=[
        'model.preset="tiny"', f'data.paths=["{data}"]', 'data.tokenizer="compact"', "data.seq_len=64",
        "train.steps=1", "train.progress=false", "fidelity.every=0", f'train.out="{out}"', "drafter.enabled=true",
        "drafter.steps=4", "drafter.new_tokens=6", "drafter.prompts_per_step=2", "drafter.held_out=1",
        "drafter.measure_tokens=6", "drafter.lr=1e-3", "checkpoint.save_every=2", *extra])


def test_an_sft_job_refits_the_mtp_modules_resumes_bit_for_bit_and_exports_them(tmp_path):
    """SFT on the tiny V4 preset (one MTP module) with ``[drafter]``: 4 re-fit steps of the model's own MTP module
    after the main step (summary kind "mtp", acceptance (a), (b), (c)); the main checkpoint keeps the modules the
    main step trained, drafter/mtp the re-fit ones, and `trex ckpt export` of the main checkpoint writes the
    re-fit ones; the run resumed from re-fit step 2 repeats steps 3 and 4 bit for bit."""
    from trex.checkpoint.export import export_checkpoint
    from trex.checkpoint.load import load_pretrained
    from trex.train.loop import train

    out = tmp_path / "run"
    summary = train(_sft_with_mtp_refit(tmp_path, out)).summary["drafter"]
    assert summary["kind"] == "mtp" and summary["steps"] == 4 and summary["phases"] == 1
    assert set(summary["acceptance"]) == {"base", "post_trained_old", "refit"}
    assert all(a["steps"] > 0 and len(a["rates"]) == 1 for a in summary["acceptance"].values())  # one module
    rows = [json.loads(line) for line in open(out / "drafter_metrics.jsonl")]
    assert [r["drafter_step"] for r in rows] == [1, 2, 3, 4] and "drafter/confidence" not in rows[0]
    ckpts = out / "checkpoints"
    assert sorted(os.listdir(ckpts / "drafter")) == ["before", "mtp", "step_2", "step_4"]
    main_step = _dcp_tensors(ckpts / "step_1")["model"]
    refit = _dcp_tensors(ckpts / "drafter" / "step_4")["model"]
    assert set(refit) == {k for k in main_step if k.startswith("mtp.")}
    assert not all(torch.equal(refit[k], main_step[k]) for k in refit)  # the re-fit moved them
    export_checkpoint(str(ckpts / "step_1"), str(tmp_path / "export"), layout="hf", dtype="fp32")
    exported = load_pretrained(str(tmp_path / "export"), dtype=torch.float32, device="cpu").state_dict()
    assert all(torch.equal(exported[k], refit[k]) for k in refit)
    assert all(torch.equal(exported[k], main_step[k]) for k in main_step if not k.startswith("mtp."))

    from trex.cli import main  # the portability report carries (a), (b), (c) and (c) - (a)

    assert main(["report", "--out", str(tmp_path / "report"), "--drafter", str(out)]) == 0
    row = next(line for line in (tmp_path / "report" / "report.md").read_text().splitlines()
               if line.startswith(f"| {out} |"))
    a, b, c = (summary["acceptance"][k]["mean_accepted"] for k in ("base", "post_trained_old", "refit"))
    assert row.startswith(f"| {out} | mtp | sft | {a:.2f} | {b:.2f} | {c:.2f} | {c - a:+.2f} | 4 in "), row
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "summary.json").write_text(json.dumps({"mode": "sft", "status": "completed"}))
    assert main(["report", "--out", str(tmp_path / "report"), "--drafter", str(tmp_path / "plain")]) == 2

    written = (ckpts / "drafter" / "mtp" / "model.safetensors").read_bytes()
    shutil.rmtree(ckpts / "drafter" / "step_4")
    shutil.rmtree(ckpts / "drafter" / "mtp")
    again = train(_sft_with_mtp_refit(tmp_path, out, 'checkpoint.resume="auto"')).summary["drafter"]
    rows_again = [json.loads(line) for line in open(out / "drafter_metrics.jsonl")]
    strip = lambda rs: [{k: v for k, v in r.items() if k != "drafter/step_time_s"} for r in rs]  # noqa: E731
    assert strip(rows_again) == strip(rows)
    resumed = _dcp_tensors(ckpts / "drafter" / "step_4")["model"]
    assert all(torch.equal(resumed[k], refit[k]) for k in refit)
    assert (ckpts / "drafter" / "mtp" / "model.safetensors").read_bytes() == written
    assert again["acceptance"] == summary["acceptance"]


def test_grpo_holds_the_mtp_modules_in_its_main_steps_refits_them_every_n_and_resumes(tmp_path, monkeypatch):
    """GRPO on the tiny V4 preset with ``[drafter]`` and ``every_n = 1`` over 2 steps: the objective gives the MTP
    module no gradient, so the main steps hold it (frozen: counted in the summary's frozen parameters, no optimizer
    state; main step 2 leaves it as the phase after step 1 left it) and only the re-fit phases (after step 1 and
    after step 2) move it; without ``[drafter]`` it stays trainable. The run resumed from main step 1 and re-fit
    step 2 (the module in both: the re-fit's checkpoint is read last) repeats the uninterrupted run's losses and
    re-fit bit for bit. ``drafter.block_size`` on MTP modules is one line naming the key."""
    from trex.cli import main
    from trex.models.deepseek_v4.config import tiny

    grpo_inputs(tmp_path, monkeypatch)
    sets = ['train.mode="grpo"', 'data.tokenizer="compact"', "data.seq_len=32", "train.progress=false",
            "fidelity.every=0", "train.steps=2", 'model.preset="tiny"', f'grpo.prompts=["{tmp_path}/prompts.jsonl"]',
            'grpo.rewards=["flat:constant"]', "grpo.prompts_per_step=2", "grpo.group_size=2",
            "grpo.micro_batch_size=4", "sampling.max_new_tokens=2", "drafter.steps=2", "drafter.every_n=1",
            "drafter.new_tokens=5", "drafter.prompts_per_step=2", "drafter.held_out=1", "drafter.measure_tokens=5",
            "checkpoint.save_every=1"]

    def args(enabled: bool, *extra: str) -> list[str]:
        return ["train", str(tmp_path / "recipe.toml"), "--out", str(tmp_path / f"run_{enabled}"),
                *[a for s in [*sets, f"drafter.enabled={str(enabled).lower()}", *extra] for a in ("--set", s)]]

    frozen = {}
    for enabled in (True, False):
        assert main(args(enabled)) == 0
        frozen[enabled] = json.loads((tmp_path / f"run_{enabled}" / "summary.json").read_text())["frozen_parameters"]
    out = tmp_path / "run_True"
    assert json.loads((tmp_path / "run_False" / "summary.json").read_text()).get("drafter") is None
    drafter = json.loads((out / "summary.json").read_text())["drafter"]
    assert drafter["phases"] == 2 and drafter["steps"] == 4
    ckpts = out / "checkpoints"
    step_2 = _dcp_tensors(ckpts / "step_2")
    mtp = [k for k in step_2["model"] if k.startswith("mtp.")]
    assert 0 < frozen[True] - frozen[False] <= len(mtp)
    assert not any(k.startswith("mtp.") for k in step_2["optim"]) and any(k.startswith("layers.") for k in step_2["optim"])
    phase_1, phase_2 = (_dcp_tensors(ckpts / "drafter" / s)["model"] for s in ("step_2", "step_4"))
    assert all(torch.equal(phase_1[k], step_2["model"][k]) for k in mtp)  # main step 2 did not move it
    assert not all(torch.equal(phase_2[k], phase_1[k]) for k in mtp)

    rows = [json.loads(line) for line in open(out / "drafter_metrics.jsonl")]
    losses = [json.loads(line)["loss"] for line in open(out / "metrics.jsonl")]
    for name in ("step_2", "drafter/step_3", "drafter/step_4", "drafter/mtp"):
        shutil.rmtree(ckpts / name)
    assert main(args(True, 'checkpoint.resume="auto"')) == 0
    strip = lambda rs: [{k: v for k, v in r.items() if "time" not in k} for r in rs]  # noqa: E731
    assert strip(json.loads(line) for line in open(out / "drafter_metrics.jsonl")) == strip(rows)
    assert [json.loads(line)["loss"] for line in open(out / "metrics.jsonl")] == losses
    resumed = _dcp_tensors(ckpts / "drafter" / "step_4")["model"]
    assert all(torch.equal(resumed[k], phase_2[k]) for k in mtp)
    with pytest.raises(ValueError, match="drafter.block_size = 2: the model's 1 multi-token prediction module"):
        DrafterSection(enabled=True, block_size=2).check_against("grpo", tiny())


def test_a_refit_with_nothing_to_train_on_warns_and_the_summary_says_why_acceptance_is_missing(tmp_path, capsys):
    """SFT whose answers are empty: the target learns to answer with its stop token at once, so every re-fit step
    has no drafting position (loss and gradient norm 0) and the held-out prompts no drafting step. The run
    completes, warns on the console and in summary.json that the re-fit taught nothing and why (b) and (c) are
    missing; the acceptances carry the reason, `trex report --drafter` shows it; no torch DCP warning leaks."""
    import warnings

    from trex.cli import main

    with open(tmp_path / "sft.jsonl", "w") as f:
        for i in range(12):
            f.write(json.dumps({"messages": [{"role": "user", "content": f"{i} plus {i}?"},
                                             {"role": "assistant", "content": ""}]}) + "\n")
    (tmp_path / "recipe.toml").write_text("# everything set on the command line\n")
    out = tmp_path / "run"
    small = ('model.overrides={hidden_size=32, num_hidden_layers=2, '
             'layer_types=["sliding_attention","compressed_sparse_attention"], mlp_layer_types=["hash_moe","moe"]}')
    sets = ['model.preset="tiny"', small, f'data.paths=["{tmp_path}/sft.jsonl"]', 'data.tokenizer="compact"',
            "data.seq_len=32", "train.steps=2", "optim.lr=1e-2", "train.progress=false", "fidelity.every=0",
            "drafter.enabled=true", "drafter.steps=2", "drafter.new_tokens=4", "drafter.prompts_per_step=2",
            "drafter.held_out=1", "drafter.measure_tokens=4"]
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        assert main(["train", str(tmp_path / "recipe.toml"), "--out", str(out),
                     *[a for s in sets for a in ("--set", s)]]) == 0
    assert not [w for w in shown if "torch.distributed is disabled" in str(w.message)]
    err = capsys.readouterr().err
    summary = json.loads((out / "summary.json").read_text())
    drafter = summary["drafter"]
    rows = [json.loads(line) for line in open(out / "drafter_metrics.jsonl")]
    assert [(r["drafter/loss"], r["drafter/grad_norm"], r["drafter/positions"]) for r in rows] == [(0, 0, 0)] * 2
    assert drafter["steps"] == 2 and drafter["steps_with_signal"] == 0
    why = ("no drafting steps: every prompt's continuation ended at once with the stop token, before a draft could be "
           "checked (checking a draft of 1 token needs a continuation of 3)")
    for key in ("post_trained_old", "refit"):
        assert drafter["acceptance"][key]["mean_accepted"] is None and drafter["acceptance"][key]["reason"] == why
    taught = next(w for w in summary["warnings"] if w.startswith("drafter: no re-fit step had a position"))
    assert "in all 2 steps every continuation of the target began with its stop token" in taught
    assert f"drafter: acceptance (c) re-fit not measured on the 1 held-out prompt: {why}" in summary["warnings"]
    assert all(f"trex: warning: {w}" in err.splitlines() for w in summary["warnings"])
    assert main(["report", "--out", str(tmp_path / "report"), "--drafter", str(out)]) == 0
    row = next(line for line in (tmp_path / "report" / "report.md").read_text().splitlines()
               if line.startswith(f"| {out} |"))
    assert f"| n/a ({why}) |" in row, row


@pytest.mark.slow
def test_fsdp2_expert_and_context_parallelism_on_two_ranks_refit_the_mtp_module_with_the_losses_of_one_process(
        tmp_path):
    """`trex train` SFT on the tiny V4 preset with ``[drafter]`` under `torchrun --nproc-per-node 2` as FSDP2 + EP2
    (the MTP module's experts split over both ranks, each rank half of every re-fit step's prompts) and as
    context parallelism over 2 (each rank a shard of the teacher-forced rows, left-padded to a length that
    splits) against one process taking the same main step: the main step's loss within 1e-6, every one of 4 re-fit steps' loss,
    parts and gradient norm within 1e-5 of one process's, the re-fit module (its DCP checkpoint) within 5% of one
    step's lr (AdamW at lr 1e-3 over 4 steps: an element whose gradient is near 0 is normalised to a move of about
    lr either way; measured: 5 of hc_head.fn's 1,024 elements 4.3e-5 apart, every other tensor within 1.1e-5)
    and the same acceptance."""
    from arithmetic_data import write_sft

    data = write_sft(tmp_path, n_train=40, n_eval=4)[0]
    (tmp_path / "recipe.toml").write_text('[train]\nmode = "sft"\n')
    sets = ['model.preset="tiny"', f'data.paths=["{data}"]', 'data.tokenizer="compact"', "data.seq_len=64",
            "train.progress=false", "fidelity.every=0", "optim.lr=0", "drafter.enabled=true", "drafter.steps=4",
            "drafter.new_tokens=6", "drafter.prompts_per_step=2", "drafter.held_out=1", "drafter.measure_tokens=6",
            "drafter.lr=1e-3", "checkpoint.save_every=4"]
    common = ["train", str(tmp_path / "recipe.toml"), "--steps", "1", *[a for s in sets for a in ("--set", s)]]
    runs = {"one": (1, ["--set", "train.grad_accum=2"]),
            "fsdp2-ep2": (2, ["--set", "parallel.dp_shard=2", "--set", "parallel.ep=2"]),
            "cp2": (2, ["--set", "parallel.dp_shard=1", "--set", "parallel.cp=2", "--set", "train.grad_accum=2"])}
    main, rows, summaries, weights = run_layouts(tmp_path, common, runs)
    for layout in ("fsdp2-ep2", "cp2"):
        a, b = main["one"], main[layout]
        assert a["tokens"] == b["tokens"] and abs(a["loss"] - b["loss"]) <= 1e-6 * abs(a["loss"]), (layout, a, b)
        assert [r["drafter_step"] for r in rows["one"]] == [r["drafter_step"] for r in rows[layout]] == [1, 2, 3, 4]
        for a, b in zip(rows["one"], rows[layout]):
            for key in ("loss", "ce", "tv", "grad_norm"):
                key = f"drafter/{key}"
                assert abs(a[key] - b[key]) <= 1e-5 * abs(a[key]), (layout, a["drafter_step"], key, a[key], b[key])
        assert set(weights["one"]) == set(weights[layout]) and all(k.startswith("mtp.") for k in weights["one"])
        for key, value in weights["one"].items():
            assert torch.allclose(value, weights[layout][key], rtol=0, atol=5e-5), (layout, key)
        assert summaries["one"]["kind"] == "mtp" and summaries["one"]["acceptance"] == summaries[layout]["acceptance"]
