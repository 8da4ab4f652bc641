"""`trex plan` for the DeepSeek-V3 family (deepseek-v3, deepseek-v3.2, kimi-k2): model facts, fit as the
numbers say, context parallelism (MLA's gathered latents) by hand-checked numbers and against autograd, and the
Kimi-K2 dry run at 1,024 ranks."""

from __future__ import annotations

import json
import os
import re
import shlex

import pytest
import torch

from trex.cli import main
from trex.hardware import load_profiles
from trex.models import build_model, count_parameters, get_preset
from trex.models.deepseek_v3 import plan_terms as v3_terms
from trex.plan.layout import Layout, PlanError
from trex.plan.model_facts import model_facts
from trex.plan.planner import GiB, make_plan
from trex.plan.terms import terms

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
H200, DIE = load_profiles()["h200-sxm"], load_profiles()["ascend-910c-die"]


@pytest.mark.parametrize("name", ["deepseek-v3", "kimi-k2", "moonlight"])
def test_facts_count_what_the_model_counts(name):
    cfg = get_preset(name)
    facts, counts = model_facts(cfg), count_parameters(cfg)
    assert (facts.total, facts.active, facts.mtp) == (counts.total, counts.active, counts.mtp)
    assert facts.by_type["dense_mlp"] == cfg.first_k_dense_replace * 3 * cfg.hidden_size * cfg.intermediate_size
    assert facts.trainable == facts.stored and facts.muon + facts.adamw == facts.trainable


def test_v32_counts_its_indexer_from_the_config_frozen():
    v3, v32 = model_facts(get_preset("deepseek-v3")), model_facts(get_preset("deepseek-v3.2"))
    per_layer = 1536 * 64 * 128 + 7168 * 128 + 2 * 128 + 7168 * 64
    assert v32.by_type["indexer"] == 61 * per_layer and v32.mtp == v3.mtp + per_layer
    assert v32.trainable == v3.trainable  # frozen, as V4's in post-training
    built = build_model(get_preset("deepseek-v3.2"), device="meta")  # what trex's V3.2 model holds
    assert sum(p.numel() for n, p in built.named_parameters() if ".attn.indexer." in n) == 62 * per_layer
    plan = make_plan(get_preset("deepseek-v3.2"), Layout(dp_shard=256, ep=256, recompute="full"), 4096, H200)
    assert plan.time.compute > 0 and any("V3.2's indexer is planned from its config" in n for n in plan.notes)


@pytest.mark.parametrize("name, devices, hw, ep, fits", [
    ("deepseek-v3", 256, H200, 256, True),  # 74.1 GiB of 126.9
    ("deepseek-v3", 512, DIE, 256, False),  # 59.3 GiB of 57.6
    ("deepseek-v3", 1024, DIE, 256, True),  # 53.7
    ("kimi-k2", 128, H200, 128, True),  # 117.9
    ("kimi-k2", 64, H200, 64, False),
    ("kimi-k2", 512, DIE, 128, True),  # 51.0
])
def test_each_preset_fits_or_not_as_the_numbers_say(name, devices, hw, ep, fits):
    plan = make_plan(get_preset(name), Layout(dp_shard=devices, ep=ep, recompute="full"), 4096, hw)
    assert plan.fits == fits == (plan.memory.total <= hw.memory_gib * GiB * 0.9)
    assert 0 < plan.mfu < 0.6


def test_context_parallelism_for_v3_by_hand():
    """deepseek-v3 at S = 4096 over cp = 2, bf16, counted by hand from the released shapes (hidden 7168, 128
    heads, q_lora 1536, kv_lora 512, rope 64, qk 192, v 128; 61 layers + 1 MTP block)."""
    cfg = get_preset("deepseek-v3")
    # traffic: every MLA layer all-gathers [latent | k_pe] of every row forward and reduce-scatters its gradient
    # backward: 2 x 576 values x 2 bytes a token and layer, no halo
    assert v3_terms.cp_traffic(cfg, 4096, 2) == (0.0, 62 * 4096 * 2 * 576 * 2)
    # a rank's attention activations: its 2048 rows' norms, projections' inputs, RoPE and kv_norm (91,660 bytes a
    # row), q (128 x 192) and the output (128 x 128) in bf16 and the fp32 log-sum-exp per head; every row's
    # gathered latent and k_pe (576 x 2 bytes) and document id (8)
    norms = 4 * (2 * 7168 + 1) + 2 * 7168 + 4 * (2 * 1536 + 1) + 2 * 1536 + 2 * 4 * 64 + 4 * 512 + 4 * 513
    assert norms == 91_660
    assert v3_terms.attention(cfg, 4096, 2, cp=2) == (norms + 2 * 128 * 320 + 4 * 128) * 2048 + (2 * 576 + 8) * 4096
    # nothing quadratic is left: the whole-row terms grow linearly with S, the rank's with S / cp
    assert v3_terms.attention(cfg, 8192, 2, cp=4) == v3_terms.attention(cfg, 4096, 2, cp=2) + (2 * 576 + 8) * 4096
    # each rank also expands the other ranks' latents through wkv_b (2 x 512 x 128 x 256 FLOPs a row), forward,
    # in latent_attention's backward, and back-propagates them: 4 x cp - 3 more per own row and layer
    assert v3_terms.cp_extra_flops(cfg, 2) == 5 * 2 * 512 * 128 * 256 * 62
    plan1 = make_plan(cfg, Layout(dp_shard=256, ep=256, recompute="full"), 4096, H200)
    plan2 = make_plan(cfg, Layout(dp_shard=128, cp=2, ep=128, recompute="full"), 4096, H200)
    assert plan2.time.cp_comm > 0 == plan1.time.cp_comm and plan2.memory.activations < plan1.memory.activations / 2
    assert plan2.fits and not any("cp = 1" in n for n in plan2.notes)
    with pytest.raises(PlanError, match="multiple of 3"):
        make_plan(cfg, Layout(dp_shard=128, cp=3, ep=128), 4096, H200)


def test_v3_activations_under_cp_are_what_autograd_saves():
    """tiny-v3 as rank 1 of 2 (its gather stands in for the all-gather), fp32 and bf16: every block's saved
    bytes as the model counts them (measured: the first block exact, the later ones 0.3% over, as the rows'
    document ids one tensor every layer saves)."""
    from test_plan_activations import _saved_bytes
    from trex.models.deepseek_v3.config import tiny_v3

    class TwoShards:
        rank, size = 1, 2

        def gather(self, x):
            return torch.cat((x, x), dim=1)

    cfg = tiny_v3()
    act = terms(cfg)
    names = [f"layers.{i}" for i in range(cfg.num_hidden_layers)] + ["mtp.0"]
    for dtype in (torch.float32, torch.bfloat16):
        b = dtype.itemsize
        measured = _saved_bytes(cfg, 64, dtype, shard=TwoShards())
        for name, (kind, mt) in zip(names, act.main_blocks(cfg) + [(act.mtp_kind(cfg), "moe")]):
            expected = act.block(cfg, kind, mt, 64, b, cp=2).total + act.weight_copies(cfg, kind, b)
            assert measured[name] == pytest.approx(expected, rel=0.01), (name, dtype)


@pytest.mark.parametrize("model", ["deepseek-v3", "deepseek-v3.2", "kimi-k2"])
def test_the_cli_plans_the_v3_family(model, capsys):
    assert main(["plan", "--model", model, "--hardware", "h200-sxm", "--devices", "256"]) == 0
    out = capsys.readouterr().out
    assert "FITS" in out and "cp = 1 only" not in out
    assert main(["plan", "--model", model, "--hardware", "h200-sxm", "--devices", "256", "--seq", "4096",
                 "--layout", "dp_shard=128,cp=2,ep=128", "--recompute", "full", "--format", "json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["layout"]["cp"] == 2 and out["time_s"]["cp_comm"] > 0


DRY_RUN = "-m trex train recipes/kimi_k2_sft.toml --dry-run --world-size 1024"


@pytest.mark.slow
def test_kimi_k2_recipe_at_1024_ranks():
    """A 1,026B-parameter model under FSDP2 + EP128 on a fake 1,024-rank process group, on this CPU (~15 s), in
    this process (tests/trex_run.py: no ~4 CPU seconds of imports; the fake group is destroyed when it returns)."""
    from trex_run import trex

    proc = trex(shlex.split(DRY_RUN)[2:], cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "efsdp 8 x ep 128" in proc.stdout
    total = float(re.search(r"model parameters: ([\d,.]+)B", proc.stdout)[1].replace(",", "")) * 1e9
    assert total == pytest.approx(count_parameters(get_preset("kimi-k2")).total, abs=0.05e9)
    per_rank = float(re.search(r"\(([\d.]+)B elements\)", proc.stdout)[1]) * 1e9
    assert total / 1024 * 0.99 <= per_rank <= total / 1024 * 1.02
    assert float(re.search(r"total before activations\s+([\d.]+) GiB", proc.stdout)[1]) < 20


def test_v32_step_counts_the_absorbed_sparse_mla_it_runs():
    """trex's sparse MLA (and torchtitan-npu's npu_sparse_flash_attention, MLA-absorb) scores each query's
    min(index_topk, S) picks over the [latent | k_pe] and sums their latent values, per head: more FLOPs than the
    MHA form the model FLOPs count. The step time counts them; the MFU does not."""
    from trex.models.deepseek_v3 import plan_terms
    from trex.plan.timing import recompute_flops_per_token, training_flops

    cfg, S = get_preset("tiny-v3.2"), 64  # index_topk 8: every query scores 8 picks
    H, kv, rd = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    counted = (8 * 9 / 2 + (S - 8) * 8) / S * (cfg.qk_head_dim + cfg.v_head_dim)  # min(t + 1, 8) keys, MHA form
    extra = 3 * 2 * H * (8 * (kv + rd + kv) - counted) * (cfg.num_hidden_layers + 1)
    assert plan_terms.kernel_extra_flops(cfg, S) == pytest.approx(extra)
    assert plan_terms.kernel_extra_flops(get_preset("tiny-v3"), S) == 0
    plan = make_plan(cfg, Layout(dp_shard=1), S, H200)
    rate = H200.peak_flops("bf16") * plan.assumptions.compute_efficiency
    assert plan.time.compute == pytest.approx(S * (training_flops(cfg, S).total + extra) / rate)
    full = make_plan(cfg, Layout(dp_shard=1, recompute="full"), S, H200)  # the attention's forward again
    assert full.time.recompute == pytest.approx(S * (recompute_flops_per_token(cfg, S, "full") + extra / 3) / rate)
    assert plan.flops_per_token == training_flops(cfg, S).total  # the MFU's numerator is the model's
