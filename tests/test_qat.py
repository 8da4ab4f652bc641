"""Quantisation-aware training: the model simulates the served quantisation, trains through it, and
exports to the official FP8/FP4 layout as exactly the model it trained."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from trex.checkpoint import load_pretrained, save_pretrained
from trex.checkpoint.layouts import codec_for
from trex.kernels import quantize
from trex.models import build_model, get_preset
from trex.models.common.linear import QuantLinear, QuantSim
from trex.models.deepseek_v4.config import tiny
from trex.models.deepseek_v4.context import SeqContext
from trex.precision import PrecisionSection

OFFICIAL = PrecisionSection(qat="official").quant_sim()


def _ids(S=40, seed=0):
    return torch.randint(0, 256, (2, S), generator=torch.Generator().manual_seed(seed))


# the architectures, as (preset, its checkpoint writer's name, the FP8 codec of its linears, their block)
ARCHITECTURES = [("tiny", "deepseek_v4", "fp8", 128), ("tiny-v4.1", "deepseek_v41", "fp8/32", 32)]


@pytest.mark.parametrize("preset, arch, codec, block", ARCHITECTURES, ids=["V4", "V4.1"])
def test_the_fp8_linears_are_the_ones_the_checkpoint_stores_in_fp8(preset, arch, codec, block):
    model = build_model(get_preset(preset), seed=0)
    linears = {f"{n}.weight": m for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    stored_fp8 = {k for k, p in model.named_parameters() if p.dim() == 2 and codec_for(k, "fp8", arch) == codec}
    assert set(linears) == stored_fp8 and len(linears) > 10
    assert {m.block for m in linears.values()} == {block}  # and with the released block scales


def test_each_part_changes_the_forward_and_trains_through_the_master_weights():
    model = build_model(tiny(), seed=0)
    ids = _ids()
    with torch.no_grad():
        plain = model(ids).logits
    for part in QuantSim.PARTS:
        model.set_quant(QuantSim(**{part: True}))
        with torch.no_grad():
            sim = model(ids).logits
        gap = ((sim - plain).norm() / plain.norm()).item()
        assert 1e-4 < gap < 0.5, (part, gap)
    model.train()
    with_grad = {}
    for sim in (QuantSim(), OFFICIAL):
        model.set_quant(sim)
        model.zero_grad(set_to_none=True)
        model(ids, labels=ids).loss.backward()
        with_grad[sim] = {n for n, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert with_grad[OFFICIAL] == with_grad[QuantSim()]  # straight-through: the same weights learn
    assert all(p.dtype == torch.float32 for p in model.parameters())  # fp32 masters, never rounded
    model.set_quant(QuantSim())
    with torch.no_grad():
        assert torch.equal(model.eval()(ids).logits, plain)  # off is the unquantised model


@pytest.mark.slow
def test_a_csa_block_compiles_without_a_graph_break_under_qat():
    model = build_model(tiny(hc_sinkhorn_iters=3), seed=0)  # V4's 20 iterations trace the same ops 20 times
    model.set_quant(OFFICIAL)
    ids = _ids(S=32)
    ctx = SeqContext(model.cfg, ids, None)
    X = torch.randn(2, 32, model.cfg.hc_mult, model.cfg.hidden_size)
    block = model.layers[1]  # CSA: every part (FP8 linears and KV, the indexer's FP4, FP4 experts)
    eager = block(X, ctx)
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")(X, ctx)
    assert torch.allclose(compiled, eager, atol=1e-5)


@pytest.mark.parametrize("preset, arch, codec, block", ARCHITECTURES, ids=["V4", "V4.1"])
def test_a_qat_model_exports_to_the_official_layout_and_loads_back_to_the_same_logits(tmp_path, preset, arch, codec,
                                                                                      block):
    """What QAT trains against is what the export stores: V4's 128x128 FP8 linears, V4.1's 32x32 ones and
    its Engram rows (FP8, a scale per row and 32 columns), FP4 routed experts."""
    model = build_model(get_preset(preset), seed=0)
    model.set_quant(OFFICIAL)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(3):  # move the weights off their initial values
        ids = _ids(seed=step)
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()
    ids = _ids(seed=9)
    with torch.no_grad():
        trained = model(ids).logits
    save_pretrained(model, tmp_path / "served", layout="official", quantize="fp8+fp4experts", dtype="bf16")
    served = load_pretrained(str(tmp_path / "served"), dtype=torch.float32, device="cpu").eval()
    theirs = dict(served.named_parameters())
    for name, module in model.named_modules():  # the exported weights are the ones QAT trained against
        if isinstance(module, QuantLinear):
            assert torch.equal(theirs[f"{name}.weight"], quantize.fake_fp8_weight(module.weight, (block, block))), name
    w1 = model.layers[1].ffn.experts.w1
    assert torch.equal(theirs["layers.1.ffn.experts.w1"], quantize.fake_fp4_weight(w1))
    tables = [n for n in theirs if n.endswith("engram.embed.weight")]
    assert len(tables) == (2 if arch == "deepseek_v41" else 0)
    for name in tables:
        trained_table = dict(model.named_parameters())[name]
        assert torch.equal(theirs[name], quantize.fake_fp8_weight(trained_table, (1, 32))), name
    # a bf16 export also rounds the unquantised tensors (norms, router, compressor, head); with those
    # in fp32 the served model is the trained one, bit for bit
    exact = tmp_path / "served_fp32"
    save_pretrained(model, exact, layout="official", quantize="fp8+fp4experts", dtype="fp32")
    served = load_pretrained(str(exact), dtype=torch.float32, device="cpu").eval()
    served.set_quant(OFFICIAL)
    with torch.no_grad():
        assert torch.equal(served(ids).logits, trained)


def test_a_bad_qat_setting_names_the_key():
    with pytest.raises(ValueError, match=r"precision.qat: 'fp4' is not a choice"):
        PrecisionSection(qat="fp4")
    assert dataclasses.asdict(PrecisionSection(qat="experts+kv").quant_sim()) == {
        "experts": True, "linears": False, "activations": False, "kv": True, "indexer": False}
