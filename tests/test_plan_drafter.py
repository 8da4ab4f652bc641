"""`trex plan` of a recipe with ``[drafter]`` (trex.plan.drafter): the re-fit of V4.1's DSpark stages and of the
multi-token prediction modules of DeepSeek-V4 and the V3 family."""

import json
import os

import pytest


def test_trex_plan_counts_the_refit_of_a_recipe_with_a_drafter_section(tmp_path, capsys):
    """`trex plan` of the V4.1-Flash SFT recipe with ``[drafter]``: the re-fit's memory per device (on top of the
    main model's weights and optimizer state) and time per step, in JSON and in the table; its memory grows with
    the prompts per step, its time with the continuation; a model without a drafter is one line naming it. The
    portability report (`trex report`) gives it a table of its own."""
    from trex.cli import main

    base = open(os.path.join(os.path.dirname(__file__), "..", "recipes", "deepseek_v41_flash_sft.toml")).read()

    def plan(drafter: str, *flags: str) -> dict:
        path = tmp_path / "recipe.toml"
        path.write_text(base.replace("[eval]", f"[drafter]\n{drafter}\n\n[eval]"))
        assert main(["plan", str(path), "--devices", "128", "--hardware", "h200-sxm", *flags]) in (0, 1)
        return json.loads(capsys.readouterr().out) if flags else capsys.readouterr().out

    full = plan("enabled = true\nprompts_per_step = 128\nnew_tokens = 32", "--format", "json")
    small = full["drafter"]
    large = plan("enabled = true\nprompts_per_step = 512\nnew_tokens = 64", "--format", "json")["drafter"]
    m = small["memory"]
    assert m["total"] == pytest.approx(sum(v for k, v in m.items() if k != "total")) and m["main"] > m["weights"] > 0
    assert large["memory"]["activations"] > small["memory"]["activations"] and large["time_s"]["total"] > \
        small["time_s"]["total"] > 0
    assert small["tokens_per_device"] == 1 * (32 - 5) * 5 and small["phases"] == 1
    assert "drafter re-fit" in plan("enabled = true") and "drafter" not in plan("enabled = false", "--format", "json")
    assert small["kind"] == "dspark"
    no_drafter = tmp_path / "no_drafter.toml"  # V4.1 without DSpark stages
    no_drafter.write_text('[model]\npreset = "deepseek-v4.1-flash"\noverrides = {dspark_target_layer_ids = []}\n'
                          '[drafter]\nenabled = true\n')
    assert main(["plan", str(no_drafter), "--devices", "128", "--hardware", "h200-sxm"]) == 2
    assert "[drafter] enabled: the model has no drafter to re-fit" in capsys.readouterr().err
    from trex.report.document import drafter_blocks  # the portability report's row of it

    (_, table) = drafter_blocks([full])
    assert table.rows[0][2] == f"1 x {small['steps']}" and drafter_blocks([{**full, "drafter": None}]) == []


def test_trex_plan_counts_the_refit_of_the_mtp_modules(tmp_path, capsys):
    """`trex plan` of a V4-Flash recipe with ``[drafter]``: the MTP module's re-fit (kind "mtp", its parameters the
    model's MTP parameters, no fp32 weights of its own: they are the main model's), a second teacher-forced
    forward of the target in its time, every head's logits over the row in its memory, growing with the
    prompts per step; ``block_size`` on MTP modules is refused by the recipe, not planned."""
    from trex.cli import main
    from trex.models.params import count_parameters
    from trex.models.registry import get_preset

    def plan(drafter: str) -> dict:
        path = tmp_path / "v4.toml"
        path.write_text(f'[model]\npreset = "deepseek-v4-flash"\n[drafter]\n{drafter}\n')
        assert main(["plan", str(path), "--devices", "128", "--hardware", "h200-sxm", "--format", "json"]) in (0, 1)
        return json.loads(capsys.readouterr().out)

    full = plan("enabled = true\nprompts_per_step = 128\nnew_tokens = 32")
    d = full["drafter"]
    cfg = get_preset("deepseek-v4-flash")
    assert d["kind"] == "mtp" and d["parameters"] == count_parameters(cfg).mtp > 0
    assert d["active"] < d["parameters"] and d["memory"]["weights"] == 0 and d["memory"]["optimizer"] > 0
    assert d["tokens_per_device"] == 1 * (32 - 1) * 1
    rows = 1 * 4096  # one prompt per device, its row seq_len long
    assert d["memory"]["activations"] >= rows * 2 * cfg.vocab_size * 4  # the main head's and the module's logits
    assert d["time_s"]["target"] > 0 and d["time_s"]["drafter"] > 0
    larger = plan("enabled = true\nprompts_per_step = 512\nnew_tokens = 32")["drafter"]
    assert larger["memory"]["activations"] > d["memory"]["activations"] and larger["time_s"]["total"] > d["time_s"]["total"]


@pytest.mark.parametrize("preset", ["deepseek-v4.1-flash", "deepseek-v4-flash"])
def test_the_refit_under_tensor_parallelism_splits_what_tp_splits(preset):
    """At tp = 2 the re-fit is planned as trex.train.drafter_refit runs it (tests/test_drafter_refit.py trains it at
    tp = 2 x ep = 2): the tp ranks take the same prompts (rows per device, continuation and activations as at
    tp = 1 with the same 64 data-parallel ranks: the tap layers' hidden states, the gathered logits and the
    drafter's activations whole on each TP rank); the target's forward runs 1 / tp of its active parameters per
    TP rank plus what TP leaves whole. V4.1's DSpark stages are whole on every TP rank but for their routed experts
    (EP over the tp ranks), and read the head whole; V4's MTP module is a block of the model, its split parameters
    (wq_b, the sinks, wo_a, wo_b, the shared expert) halved with their gradients and moments, as are its FLOPs and
    the vocabulary-parallel head's."""
    from trex.hardware import load_profiles
    from trex.models.registry import get_preset
    from trex.plan import Layout, make_plan
    from trex.plan.drafter import drafter_counts
    from trex.plan.planner import with_drafter
    from trex.train.drafter_refit import DrafterSection

    cfg, hw, S = get_preset(preset), load_profiles()["h200-sxm"], 4096
    section = DrafterSection(enabled=True, prompts_per_step=128, new_tokens=32)
    one, two = (with_drafter(make_plan(cfg, Layout(dp_shard=64, ep=64 * tp, tp=tp, recompute="full"), S, hw), cfg,
                             section, 10) for tp in (1, 2))
    total, experts, active, split = drafter_counts(cfg)
    if preset == "deepseek-v4-flash":  # the MTP module's split parameters, from its shapes
        d, H, c, q, g, r = (cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.q_lora_rank, cfg.o_groups,
                            cfg.o_lora_rank)
        assert one.drafter.kind == "mtp" and cfg.num_nextn_predict_layers == 1
        assert split == H + q * H * c + H * c // g * g * r + g * r * d + 3 * d * cfg.moe_intermediate_size
    else:
        assert one.drafter.kind == "dspark" and split == 0
    a, b = one.drafter, two.drafter
    held = total - experts - split / 2 + experts / 2  # one TP rank's, before FSDP over the 64 dp_shard ranks
    for key, width in (("gradients", 4), ("optimizer", 8)):
        assert a.memory[key] == width * total / 64 and b.memory[key] == pytest.approx(width * held / 64)
    assert b.memory["weights"] == (0 if a.kind == "mtp" else pytest.approx(4 * held / 64))
    assert b.memory["gathered"] == pytest.approx((total - experts - split / 2 + experts / 128) * 2)  # bf16
    assert b.tokens_per_device == a.tokens_per_device
    for key in ("activations", "continuation"):
        assert b.memory[key] == a.memory[key]
    rate = hw.peak_flops(two.assumptions.dtype) * two.assumptions.compute_efficiency
    rows, row = 128 // 64, S
    passes = 4 if a.kind == "mtp" else 2  # MTP: the continuation and the teacher-forced forward
    whole = two.facts.tp_whole_matmul
    assert a.time_s["target"] == pytest.approx(passes * one.facts.active * rows * row / rate)
    assert b.time_s["target"] == pytest.approx(passes * ((two.facts.active - whole) / 2 + whole) * rows * row / rate)
    routed = active - (total - experts)
    rank_active = active - routed / 2 - split / 2
    d, V = cfg.hidden_size, cfg.vocab_size
    if a.kind == "mtp":  # every head's logits over the row (main and the module's), the pairs' head backward
        heads = 2 * d * V * 2 * rows * row + 4 * d * V * b.tokens_per_device
        assert b.time_s["drafter"] == pytest.approx((6 * rank_active * rows * row + heads / 2) / rate)
    else:
        assert b.time_s["drafter"] == pytest.approx((6 * rank_active + 4 * d * V) * b.tokens_per_device / rate)
    assert b.time_s["drafter"] < a.time_s["drafter"] and b.time_s["target"] < a.time_s["target"]
    assert b.memory["total"] < a.memory["total"]
