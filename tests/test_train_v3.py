"""The one training loop on DeepSeek-V3 (``model.preset = "tiny-v3"``: the query latent, group-limited
routing, a dense first layer, MTP, YaRN): SFT/CPT, DPO, GRPO and on-policy distillation on one process;
one process against FSDP2 and FSDP2 + EP2 on two (SFT, DPO, GRPO, distillation); resume; export to the released names read back by
trex and by transformers; the context-parallel split rule; on-policy prompts in the recipe's chat format; the
FLOPs count and Muon's grouping. (Context parallelism against one process: tests/test_context_parallel.py,
and in `trex train` tests/test_migration.py's V3 move onto cp = 2.)"""

from __future__ import annotations

import dataclasses
import json
import math
import os

import pytest
import torch
from trex_run import ROOT, trex

from trex.models.flops import flops_per_token
from trex.models.registry import get_preset

FIDELITY = os.path.join(ROOT, "recipes", "fidelity_default.toml")
# the fidelity recipe on tiny-v3: its V4 override (sliding_window) dropped, no probes
V3 = ["--set", 'model.preset="tiny-v3"', "--set", "model.overrides={}", "--set", "train.progress=false",
      "--set", "fidelity.every=0"]
CPU = {"TREX_DEVICE": "cpu"}


def _rows(out) -> list[dict]:
    return [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]


def _sets(*sets: str) -> list[str]:
    return [a for s in sets for a in ("--set", s)]


# ---- the FLOPs count and the optimizer's grouping ------------------------------------------------------
def test_flops_per_token_of_tiny_v3_is_the_hand_count():
    """tiny-v3 (d 64, 4 heads, q latent 32, kv latent 32, nope 16 + rope 8, v 16, vocab 256, 3 layers of
    which the first is dense (inter 96), 8 experts of 32 with top 2 and one shared, one MTP layer), at
    S = 64: every matmul counted by hand, times 2 (a multiply-add) and 3 (training)."""
    cfg = get_preset("tiny-v3")
    S = 64
    attn = 64 * 32 + 32 * 4 * 24 + 64 * (32 + 8) + 32 * 4 * (16 + 16) + 4 * 16 * 64  # wq_a wq_b wkv_a wkv_b wo
    core = 4 * (24 + 16) * (S + 1) / 2  # q.k over 24 dims and p.v over 16, (S + 1) / 2 keys on average
    dense_ffn = 3 * 96 * 64
    moe_dense = 8 * 64 + 3 * 32 * 64  # router, one shared expert
    routed = 2 * 3 * 32 * 64
    main_dense = 3 * attn + dense_ffn + 2 * moe_dense
    mtp = attn + moe_dense + routed + core + 2 * 64 * 64  # its MoE block and eh_proj
    f = flops_per_token(cfg, S)
    assert f.dense_matmuls == 6 * main_dense
    assert f.routed_experts == 6 * 2 * routed
    assert f.attention_core == 6 * 3 * core
    assert f.indexer == 0
    assert f.head == 6 * 2 * 256 * 64  # the main head and MTP's (the same weight, run twice)
    assert f.mtp == 6 * mtp
    inference = flops_per_token(cfg, S, training=False, with_mtp=False)
    assert inference.total == 2 * (main_dense + 2 * routed + 3 * core + 256 * 64)
    # Moonlight's single query projection
    moon = get_preset("tiny-moonlight")
    q_moon = 64 * 4 * 24
    assert flops_per_token(moon, S, with_mtp=False).dense_matmuls == 6 * (
        3 * (q_moon + 64 * 40 + 32 * 4 * 32 + 4 * 16 * 64) + 3 * 96 * 64 + 2 * (8 * 64 + 2 * 3 * 24 * 64))


def test_muon_takes_mla_projections_whole():
    """V3's wkv_a ([latent | k_pe] rows) and wkv_b (per head [k_nope | v] rows) are plain matrices under Muon,
    as Moonlight trained them; routed experts one matrix each; norms, the embedding and the head AdamW."""
    from trex.models import build_model
    from trex.train.optim import classify

    rules = {name: (rule.key, blocks) for name, _, rule, blocks in classify(build_model(get_preset("tiny-v3")))}
    for name in ("layers.1.attn.wkv_a.weight", "layers.1.attn.wkv_b.weight", "layers.1.attn.wq_b.weight",
                 "layers.0.ffn.w1.weight", "layers.1.ffn.gate.weight", "mtp.0.eh_proj.weight"):
        assert rules[name] == ("matrix", []), name
    assert rules["layers.1.ffn.experts.w1"] == ("experts", [])
    assert rules["layers.1.attn.kv_norm.weight"][0] == rules["mtp.0.enorm.weight"][0] == "gains_biases"
    assert rules["embed.weight"][0] == rules["head.weight"][0] == "embed_head"


# ---- SFT on one process -----------------------------------------------------------------------------------
def test_sft_learns_writes_every_output_resumes_bit_for_bit_and_exports(tmp_path):
    """Eight SFT steps of tiny-v3 (Muon, the fidelity recipe): the loss falls, the routers' biases move
    (aux-loss-free balancing), every output is written; resumed from its step-4 checkpoint the run repeats
    steps 5-8 bit for bit; ``trex ckpt export`` writes the released names, which trex's load_pretrained
    reads back to identical logits."""
    from trex.checkpoint.load import load_pretrained

    common = ["train", FIDELITY, "--steps", "8", *V3, *_sets("schedule.warmup_steps=2", "checkpoint.save_every=4",
                                                              "checkpoint.keep_last=0")]
    a = trex([*common, "--out", str(tmp_path / "a")], env=CPU)
    assert a.returncode == 0, a.stderr[-3000:]
    rows = _rows(tmp_path / "a")
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in rows)
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.5, [r["loss"] for r in rows]
    assert all(0 < r["mfu"] for r in rows) and all(r["expert_imbalance_max"] >= 1 for r in rows)
    for f in ("metrics.jsonl", "summary.json", "train.log", "config.toml", "loss.png", "checkpoints/step_4",
              "checkpoints/step_8"):
        assert os.path.exists(tmp_path / "a" / f), f
    summary = json.load(open(tmp_path / "a" / "summary.json"))
    assert summary["status"] == "completed"

    b = trex([*common, "--set", f'checkpoint.resume="{tmp_path}/a/checkpoints/step_4"', "--out", str(tmp_path / "b")],
             env=CPU)
    assert b.returncode == 0, b.stderr[-3000:]
    again = _rows(tmp_path / "b")
    assert [r["step"] for r in again] == [5, 6, 7, 8]
    for x, y in zip(rows[4:], again):
        assert (x["loss"], x["grad_norm"]) == (y["loss"], y["grad_norm"]), x["step"]

    e = trex(["ckpt", "export", str(tmp_path / "a" / "checkpoints" / "step_8"), str(tmp_path / "hf"), "--layout", "hf",
              "--dtype", "fp32"], env=CPU)
    assert e.returncode == 0, e.stderr[-3000:]
    index = json.load(open(tmp_path / "hf" / "model.safetensors.index.json"))["weight_map"]
    assert "model.layers.1.mlp.experts.7.gate_proj.weight" in index  # the released names, expert by expert
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in index
    assert "model.layers.3.eh_proj.weight" in index  # the MTP layer after the last
    model = load_pretrained(str(tmp_path / "hf"))
    bias = model.layers[1].ffn.gate.bias
    assert bias.abs().max() > 0  # the routers' bias was trained and exported
    # the exported model equals the trained one: its logits against the DCP checkpoint's weights
    from trex.checkpoint.export import _TensorSource

    source = _TensorSource(str(tmp_path / "a" / "checkpoints" / "step_8"))
    trained = dataclasses.replace(model.cfg)
    from trex.models import build_model

    direct = build_model(trained)
    with torch.no_grad():
        for key, t in [*direct.named_parameters(), *direct.named_buffers()]:
            t.copy_(source.read(key))
    ids = torch.randint(0, model.cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model.eval()(ids).logits, direct.eval()(ids).logits)
    # exported as released (FP8 with fp32 block scales): the trained weights quantised by the release's rule
    from trex.checkpoint.export import export_checkpoint
    from trex.kernels.quantize import dequantize_fp8, quantize_fp8

    export_checkpoint(str(tmp_path / "a" / "checkpoints" / "step_8"), str(tmp_path / "fp8"), quantize="fp8")
    fp8 = load_pretrained(str(tmp_path / "fp8"), dtype=torch.float32)
    w = source.read("layers.1.ffn.experts.w2")[5]
    assert torch.equal(fp8.layers[1].ffn.experts.w2[5], dequantize_fp8(*quantize_fp8(w, scale_fmt="fp32")))
    assert torch.equal(fp8.layers[1].ffn.gate.bias, bias)  # fp32 on disk
    # a run that started from a V3.1 checkpoint (scale_fmt "ue8m0") exports power-of-two scales, as its config says
    from trex.checkpoint import save_pretrained

    save_pretrained(direct, tmp_path / "v31", quantize="fp8")
    config = json.load(open(tmp_path / "v31" / "config.json"))
    config["quantization_config"]["scale_fmt"] = "ue8m0"
    json.dump(config, open(tmp_path / "v31" / "config.json", "w"))
    export_checkpoint(str(tmp_path / "a" / "checkpoints" / "step_8"), str(tmp_path / "fp8-v31"), quantize="fp8",
                      source=str(tmp_path / "v31"))
    assert json.load(open(tmp_path / "fp8-v31" / "config.json"))["quantization_config"]["scale_fmt"] == "ue8m0"
    v31 = load_pretrained(str(tmp_path / "fp8-v31"), dtype=torch.float32)
    assert torch.equal(v31.layers[1].ffn.experts.w2[5], dequantize_fp8(*quantize_fp8(w, scale_fmt="fp32/ue8m0")))
    from safetensors import safe_open

    for shard in sorted(set(json.load(open(tmp_path / "fp8-v31" / "model.safetensors.index.json"))["weight_map"].values())):
        with safe_open(str(tmp_path / "fp8-v31" / shard), "pt") as f:
            for name in (k for k in f.keys() if k.endswith("_scale_inv")):
                s = f.get_tensor(name)
                assert torch.equal(torch.exp2(torch.round(torch.log2(s))), s), name  # powers of two


def test_save_pretrained_is_read_by_load_pretrained_and_transformers(tmp_path):
    """A tiny-v3 with random routers' biases, written in the released names: trex reads it back to the same
    logits exactly, transformers' DeepseekV3ForCausalLM to within fp32 rounding (its MTP layer is ignored
    by transformers, as with the released checkpoints)."""
    from trex.checkpoint.load import load_pretrained
    from trex.checkpoint.save import save_pretrained
    from trex.models import build_model

    model = build_model(get_preset("tiny-v3"), seed=3)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("gate.bias"):
                b.copy_(0.05 * torch.randn(b.shape, generator=torch.Generator().manual_seed(1)))
    save_pretrained(model, str(tmp_path / "m"), dtype="fp32")
    ids = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model.eval()(ids).logits
        assert torch.equal(load_pretrained(str(tmp_path / "m")).eval()(ids).logits, want)
    transformers = pytest.importorskip("transformers")
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(str(tmp_path / "m"), dtype=torch.float32,
                                                            attn_implementation="eager").eval()
    with torch.no_grad():
        got = hf(ids).logits
    assert (got - want).abs().max() < 1e-5 and (got - want).norm() / want.norm() < 1e-6
    with pytest.raises(ValueError, match="hf layout"):
        save_pretrained(model, str(tmp_path / "o"), layout="official")


def test_context_parallelism_splits_any_sequence_into_equal_shards():
    """MLA gathers the whole rows' latents: no window or halo, so a sequence splits wherever its shards are equal
    (the loop checks data.seq_len with this rule before step one; GRPO pads its rows to shardable_length)."""
    from trex.models.registry import check_shardable, shardable_length

    cfg = get_preset("tiny-v3")
    check_shardable(cfg, 64, 4)
    check_shardable(cfg, 6, 3)
    with pytest.raises(ValueError, match="seq_len must be a multiple of 2; 62 or 64 would work"):
        check_shardable(cfg, 63, 2)
    assert [shardable_length(cfg, n, 4) for n in (1, 4, 5, 63)] == [4, 4, 8, 64]
    assert shardable_length(get_preset("tiny"), 5, 2) > 8  # V4's rule: its windows and halos


# ---- post-training on one process -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def task(tmp_path_factory):
    from trex.data.arithmetic import ArithmeticTask, generate, preference_records
    from trex.data.records import write_jsonl

    d = tmp_path_factory.mktemp("v3post")
    train_p, held = generate(ArithmeticTask(digits=1, n_train=24, n_eval=4))
    write_jsonl(d / "prompts.jsonl", [{"prompt": p.question, "answer": p.answer} for p in train_p])
    write_jsonl(d / "pairs.jsonl", preference_records(train_p))
    (d / "digit_reward.py").write_text("def first_digit(c):\n    return float(c.text[:1].isdigit())\n")
    (d / "recipe.toml").write_text("# everything set on the command line\n")
    return d


def _post(task, mode: str) -> list[str]:
    common = ['model.preset="tiny-v3"', 'data.tokenizer="compact"', "data.seq_len=32", "train.progress=false",
              "fidelity.every=0", 'schedule.decay="constant"', "schedule.warmup_steps=0", "train.steps=3",
              'optim.name="adamw"', "optim.eps=1e-8", "optim.lr=3e-3"]
    if mode == "dpo":
        sets = ['train.mode="dpo"', f'data.paths=["{task}/pairs.jsonl"]', "data.micro_batch_size=4", "dpo.beta=0.5"]
    elif mode == "grpo":
        sets = ['train.mode="grpo"', f'grpo.prompts=["{task}/prompts.jsonl"]',
                'grpo.rewards=["digit_reward:first_digit"]', "grpo.prompts_per_step=2", "grpo.group_size=4", "grpo.micro_batch_size=8", "sampling.max_new_tokens=2",
                "grpo.kl_coef=0.05"]
    else:
        sets = ['train.mode="distill"', f'distill.teachers=[{{path="{task}/teacher", weight=1.0}}]',
                f'distill.prompts=["{task}/prompts.jsonl"]', "distill.prompts_per_step=4", "sampling.max_new_tokens=3"]
    return ["train", str(task / "recipe.toml"), *_sets(*common, *sets)]


@pytest.fixture(scope="module")
def teacher(task):
    """A frozen tiny-v3 teacher (peaked: its head x 20) at the compact tokenizer's vocabulary, in the
    released names."""
    from trex.checkpoint.save import save_pretrained
    from trex.models import build_model

    t = build_model(dataclasses.replace(get_preset("tiny-v3"), vocab_size=112), seed=10)
    with torch.no_grad():
        t.head.weight.mul_(20.0)
    save_pretrained(t, str(task / "teacher"), dtype="fp32")
    return task / "teacher"


def test_dpo_on_tiny_v3(task, tmp_path):
    p = trex([*_post(task, "dpo"), "--out", str(tmp_path / "dpo")], env=CPU)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = _rows(tmp_path / "dpo")
    assert len(rows) == 3
    assert rows[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)  # the policy starts as its reference
    assert rows[0]["reward_margin"] == pytest.approx(0.0, abs=1e-6)
    assert all(math.isfinite(r["loss"]) and r["grad_norm"] > 0 for r in rows)
    assert rows[1]["reward_margin"] != 0  # the policy left its reference


def test_grpo_on_tiny_v3_samples_through_the_decode_cache(task, tmp_path, monkeypatch):
    """GRPO samples from the training model through its MLA decode cache (each sampled batch prefills once,
    then decodes a token per forward: counted); the trainer's recomputed log-probs equal the sampler's, the
    KL to the reference copy starts at 0."""
    from trex.models.deepseek_v3.decode import V3DecodeCache

    steps, step = [], V3DecodeCache.step

    def counted(self, attn, x, ctx):
        steps.append(x.shape)
        return step(self, attn, x, ctx)

    monkeypatch.setattr(V3DecodeCache, "step", counted)
    p = trex([*_post(task, "grpo"), "--out", str(tmp_path / "grpo")], env={**CPU, "PYTHONPATH": str(task)})
    assert p.returncode == 0, p.stderr[-3000:]
    # 3 steps x 8 rows x one decode step (max_new_tokens 2) in each of the 3 layers
    assert steps == [torch.Size([8, 1, 64])] * 3 * 3
    rows = _rows(tmp_path / "grpo")
    assert len(rows) == 3 and all(r["response_length"] == 2 for r in rows)
    assert rows[0]["kl"] == 0 and rows[-1]["kl"] > 0
    assert max(r["logprob_diff_max"] for r in rows) < 1e-5
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["entropy"]) and r["grad_norm"] > 0 for r in rows)


def test_distillation_on_tiny_v3_from_a_v3_teacher(task, teacher, tmp_path):
    p = trex([*_post(task, "distill"), "--out", str(tmp_path / "distill")], env=CPU)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = _rows(tmp_path / "distill")
    assert len(rows) == 3
    for r in rows:
        assert r["loss"] > 0 and r["loss"] == pytest.approx(r["reverse_kl/teacher0"], rel=1e-6)
        assert r["logprob_diff_max"] < 1e-5 and r["grad_norm"] > 0


# ---- two processes ----------------------------------------------------------------------------------------
@pytest.mark.slow
def test_fsdp2_and_expert_parallelism_give_the_losses_of_one_process(tmp_path):
    """SFT of tiny-v3 under torchrun on two ranks, as FSDP2 (dp_shard 2) and as FSDP2 + EP2 (4 experts a
    rank; the dense first layer has none), against one process accumulating the same 2 x 4 rows: every
    step's loss and gradient norm within 1e-5 (measured: 1.1e-7). AdamW at eps 1e-8, as the V4.1 layout
    tests (their docstrings say why not Muon)."""
    common = ["train", FIDELITY, "--steps", "3", *V3, *_sets('optim.name="adamw"', "optim.eps=1e-8")]
    runs = {"one": (1, _sets("train.grad_accum=2")), "fsdp2": (2, _sets("parallel.dp_shard=2")),
            "fsdp2-ep2": (2, _sets("parallel.dp_shard=2", "parallel.ep=2"))}
    rows = {}
    for name, (procs, extra) in runs.items():
        p = trex([*common, *extra, "--out", str(tmp_path / name)], procs=procs, env=CPU)
        assert p.returncode == 0, (name, p.stderr[-3000:])
        rows[name] = _rows(tmp_path / name)
    assert rows["one"][-1]["loss"] < rows["one"][0]["loss"]
    for name in ("fsdp2", "fsdp2-ep2"):
        assert [r["step"] for r in rows[name]] == [1, 2, 3], name
        for a, b in zip(rows["one"], rows[name]):
            for key in ("loss", "grad_norm"):
                assert abs(a[key] - b[key]) <= 1e-5 * abs(a[key]), (name, key, a["step"], a[key], b[key])


@pytest.mark.slow
def test_grpo_under_fsdp2_ep2_gives_the_samples_and_losses_of_one_process(task, tmp_path):
    """GRPO on tiny-v3 on two ranks as FSDP2 + EP2 (each rank samples its prompts through the sharded model
    and its decode cache): the same rewards and lengths, every step's loss, KL, entropy and gradient norm
    within 1e-5 of one process."""
    env = {**CPU, "PYTHONPATH": f"{task}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    one = trex([*_post(task, "grpo"), "--out", str(tmp_path / "one")], env=env)
    assert one.returncode == 0, one.stderr[-3000:]
    two = trex([*_post(task, "grpo"), *_sets("parallel.dp_shard=2", "parallel.ep=2"), "--out", str(tmp_path / "two")],
               procs=2, env=env)
    assert two.returncode == 0, two.stderr[-3000:]
    for x, y in zip(_rows(tmp_path / "one"), _rows(tmp_path / "two"), strict=True):
        assert x["reward_mean"] == y["reward_mean"] and x["response_length"] == y["response_length"]
        for key in ("loss", "kl", "entropy", "grad_norm"):
            assert x[key] == pytest.approx(y[key], rel=1e-5, abs=1e-7), (x["step"], key)


@pytest.mark.slow
@pytest.mark.parametrize("mode,keys", [("dpo", ("loss", "reward_margin", "grad_norm")),
                                       ("distill", ("loss", "reverse_kl/teacher0", "grad_norm"))])
def test_dpo_and_distillation_under_fsdp2_ep2_give_the_losses_of_one_process(task, teacher, tmp_path, mode, keys):
    """DPO and on-policy distillation of tiny-v3 on two ranks as FSDP2 + EP2 against one process: DPO's two
    ranks read 2 x 4 pairs a step (one process accumulates them over two micro-batches); distillation's ranks
    each sample half of the step's prompts (the same completions as one process: per-row uniforms) and score
    them against the frozen teacher. Every step's loss, its mode's signal and the gradient norm within 1e-5."""
    one_extra = _sets("train.grad_accum=2") if mode == "dpo" else []
    one = trex([*_post(task, mode), *one_extra, "--out", str(tmp_path / "one")], env=CPU)
    assert one.returncode == 0, one.stderr[-3000:]
    two = trex([*_post(task, mode), *_sets("parallel.dp_shard=2", "parallel.ep=2"), "--out", str(tmp_path / "two")],
               procs=2, env=CPU)
    assert two.returncode == 0, two.stderr[-3000:]
    for x, y in zip(_rows(tmp_path / "one"), _rows(tmp_path / "two"), strict=True):
        if mode == "distill":
            assert x["response_length"] == y["response_length"]
        for key in keys:
            assert x[key] == pytest.approx(y[key], rel=1e-5, abs=1e-7), (x["step"], key, x[key], y[key])


@pytest.mark.slow
def test_v32_post_training_under_fsdp2_ep2_gives_the_losses_of_one_process(task, teacher, tmp_path):
    """DeepSeek-V3.2 (tiny-v3.2: the indexer keeps 8 of up to 32 keys; its MLA through ``sparse_mla``, the
    indexer frozen as post-training's default) in DPO, GRPO (sampling through the decode cache, which keeps
    the indexer's keys) and distillation, on two ranks as FSDP2 + EP2 against one process, as the V3 tests
    above: every step's loss, its mode's signal and the gradient norm within 1e-5 (absolute 1e-6: DPO's reward
    margin is a difference of sequence log-probabilities of ~100, whose fp32 summation order differs by ranks;
    measured 1.2e-7)."""
    env = {**CPU, "PYTHONPATH": f"{task}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    modes = {"dpo": ("loss", "reward_margin", "grad_norm"), "grpo": ("loss", "kl", "entropy", "grad_norm"),
             "distill": ("loss", "reverse_kl/teacher0", "grad_norm")}
    for mode, keys in modes.items():
        args = [*_post(task, mode), *_sets('model.preset="tiny-v3.2"')]
        one_extra = _sets("train.grad_accum=2") if mode == "dpo" else []
        one = trex([*args, *one_extra, "--out", str(tmp_path / mode / "one")], env=env)
        assert one.returncode == 0, (mode, one.stderr[-3000:])
        two = trex([*args, *_sets("parallel.dp_shard=2", "parallel.ep=2"), "--out", str(tmp_path / mode / "two")],
                   procs=2, env=env)
        assert two.returncode == 0, (mode, two.stderr[-3000:])
        for x, y in zip(_rows(tmp_path / mode / "one"), _rows(tmp_path / mode / "two"), strict=True):
            if mode != "dpo":
                assert x["response_length"] == y["response_length"], (mode, x["step"])
            for key in keys:
                assert x[key] == pytest.approx(y[key], rel=1e-5, abs=1e-6), (mode, x["step"], key, x[key], y[key])


@pytest.mark.parametrize("mode,chat_format,thinking", [("grpo", "deepseek-v3", False), ("grpo", "deepseek-v3", True),
                                                       ("distill", "deepseek-v3", False)])
def test_on_policy_prompts_render_in_the_recipes_chat_format(task, teacher, mode, chat_format, thinking):
    """A V3 recipe's ``data.chat_format`` renders the prompts GRPO and distillation sample from and those they
    evaluate on, as its SFT data renders conversations (V3: no ``</think>`` after the assistant tag; R1's
    thinking prompt opens ``<think>`` and a newline), not in V4's format."""
    from trex import device as device_layer
    from trex.data.chat import render_prompt
    from trex.parallel.mesh import Parallel
    from trex.posttrain import TrainContext, build_objective
    from trex.precision import PrecisionPolicy
    from trex.recipe import load
    from trex.train.config import TrainRecipe
    from trex.train.loop import model_for, tokenizer_for

    args = _post(task, mode)[2:]
    overrides = [*args[1::2], f'data.chat_format="{chat_format}"', f"data.thinking={str(thinking).lower()}",
                 f'{mode}.eval_prompts=["{task}/prompts.jsonl"]', "grpo.kl_coef=0", 'grpo.rewards=["exact_match"]']
    recipe = load(TrainRecipe, str(task / "recipe.toml"), overrides)
    dev = device_layer.Device("cpu")
    policy = PrecisionPolicy.resolve("fp32", dev)
    tokenizer = tokenizer_for(recipe.data.tokenizer)
    objective = build_objective(mode, TrainContext(recipe, Parallel(), dev, policy, tokenizer,
                                                   model_for(recipe, tokenizer, dev, policy)))
    eval_prompts = [p for prompts in objective.eval_sets.values() for p in prompts]
    for prompts in (objective.prompts, eval_prompts):
        first = [{"role": "user", "content": prompts[0].record["prompt"]}]
        text = tokenizer.decode(prompts[0].ids)
        assert text == render_prompt(first, thinking=thinking, chat_format=chat_format)
        assert text != render_prompt(first, thinking=thinking)  # V4's


def test_a_transformers_v3_checkpoint_trains_without_the_mtp_layer_it_lacks(tmp_path):
    """transformers' DeepseekV3Config says num_nextn_predict_layers 1 while its weights never hold an MTP layer:
    trained as it is, trex warns that the layer is initialised fresh; ``model.overrides`` on the checkpoint
    (`num_nextn_predict_layers = 0`) builds the model without it, so nothing is fresh and the export has none;
    a misspelt override is one line with what was meant."""
    from hf_oracle_v3 import hf_config, random_hf_model

    ref = random_hf_model(hf_config(num_nextn_predict_layers=1))
    ref.save_pretrained(tmp_path / "hf")
    common = ["train", FIDELITY, "--steps", "2", *V3, "--set", f'model.path="{tmp_path / "hf"}"',
              *_sets("checkpoint.save_every=2", "schedule.warmup_steps=1")]
    fresh = trex([*common, "--out", str(tmp_path / "fresh")], env=CPU)
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    assert "MTP tensors initialised fresh" in fresh.stderr
    none = trex([*common, "--set", "model.overrides={num_nextn_predict_layers=0}", "--out", str(tmp_path / "none")],
                env=CPU)
    assert none.returncode == 0, none.stderr[-3000:]
    assert "initialised fresh" not in none.stderr
    state = json.load(open(tmp_path / "none" / "checkpoints" / "step_2" / "trainer_state.json"))
    assert state["model_config"]["num_nextn_predict_layers"] == 0
    typo = trex([*common, "--set", "model.overrides={num_nextn_predict_layer=0}", "--out", str(tmp_path / "typo")],
                env=CPU)
    lines = [line for line in typo.stderr.splitlines() if line.strip()]
    assert typo.returncode == 2 and len(lines) == 1, typo.stderr[-3000:]
    assert "did you mean `model.overrides.num_nextn_predict_layers`?" in lines[0]
