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
