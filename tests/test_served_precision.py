"""Where trex used to differ from the official inference code around the model: bf16 rounding the
official kernels do not do (attention scores, the expert sum), ``swiglu_limit = 0``, a document id
reused for two runs of a row, and config files written by ``PretrainedConfig.to_dict()``."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from trex.kernels import sparse_attention as sa
from trex.models import build_model
from trex.models.common.config import ConfigError
from trex.models.common.context import segments, shift_labels
from trex.models.common.moe import clamped_swiglu
from trex.models.deepseek_v4.config import ModelConfig, tiny


def _rms(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


@pytest.mark.parametrize("kernel", ["reference", "fused_backward"])
def test_bf16_attention_keeps_its_scores_in_fp32(kernel, monkeypatch):
    # V4-Flash head shapes (c = 512, W = 128) on RMS-normalised q and kv, as the model feeds them
    g = torch.Generator().manual_seed(0)
    B, S, H, c, W, N, k = 1, 256, 16, 512, 128, 64, 16
    q = _rms(torch.randn(B, S, H, c, generator=g)).bfloat16()
    kv = _rms(torch.randn(B, S, c, generator=g)).bfloat16()
    comp = _rms(torch.randn(B, N, c, generator=g)).bfloat16()
    idx = torch.randint(0, N, (B, S, k), generator=g)
    mask = idx < ((torch.arange(S) + 1) // 4)[None, :, None]
    doc = torch.zeros(B, S, dtype=torch.long)
    fn = getattr(sa, kernel)

    def run(dtype):
        return fn(q.to(dtype), kv.to(dtype), torch.zeros(H), c**-0.5, W, doc, comp.to(dtype), mask, idx).double()

    exact = run(torch.float64)  # the same bf16 values, computed in fp64
    err = lambda out: float((out - exact).norm() / exact.norm())  # noqa: E731
    kept = err(run(torch.bfloat16))
    monkeypatch.setattr(sa, "scores_fp32", lambda a, b: (a.float() @ b.float()).bfloat16().float())
    rounded = err(run(torch.bfloat16))  # what rounding q.k to bf16 before the softmax costs
    assert kept < 0.8 * rounded, (kept, rounded)
    # what is left is the bf16 output and the bf16 probabilities of the value sum
    assert kept < 2 * err(exact.bfloat16().double())


def test_bf16_moe_sums_its_experts_in_fp32():
    model = build_model(tiny(), seed=0, dtype=torch.bfloat16).eval()
    moe = model.layers[1].ffn
    x = torch.randn(24, 64, generator=torch.Generator().manual_seed(0)).bfloat16()
    weights, idx, _ = moe.gate(x, torch.zeros(24, dtype=torch.long))
    routed = moe.experts(x, idx, weights)
    assert routed.dtype == torch.float32  # one rounding, after the sum
    parts = []
    for j in range(idx.shape[1]):  # each token's k experts one at a time, each output rounded as w2 rounds it
        e = idx[:, j]
        h = clamped_swiglu(torch.einsum("td,tid->ti", x.float(), moe.experts.w1[e].float()).bfloat16(),
                           torch.einsum("td,tid->ti", x.float(), moe.experts.w3[e].float()).bfloat16(), moe.experts.limit)
        h = (h * weights[:, j, None]).bfloat16()
        parts.append(torch.einsum("ti,tdi->td", h.float(), moe.experts.w2[e].float()).bfloat16())
    assert torch.allclose(routed, sum(p.float() for p in parts), rtol=2e-2, atol=1e-3)
    y = moe(x.view(1, 24, 64), type("Ctx", (), {"input_ids": torch.zeros(1, 24, dtype=torch.long),
                                                 "recording": False, "routes": None, "route_log": None})())
    assert torch.equal(y.view(24, 64), (routed + moe.shared_experts(x).float()).bfloat16())


def test_swiglu_limit_zero_means_no_clamp():
    gate = torch.tensor([-30.0, -1.0, 0.5, 12.0, 40.0])
    up = torch.tensor([25.0, -20.0, 3.0, -11.0, 2.0])
    assert torch.equal(clamped_swiglu(gate, up, 0.0), F.silu(gate) * up)  # the official Expert: `if limit > 0`
    clamped = clamped_swiglu(gate, up, 10.0)
    assert torch.equal(clamped, F.silu(gate.clamp(max=10.0)) * up.clamp(-10.0, 10.0))
    model = build_model(tiny(swiglu_limit=0.0), seed=0).eval()
    ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(0))
    assert model(ids).logits.abs().sum() > 0


def test_a_document_id_that_comes_back_starts_a_new_document():
    doc = torch.tensor([[0, 0, 0, 1, 1, 0, 0, 0]])
    seg, pos = segments(doc)
    assert seg.tolist() == [[1, 1, 1, 2, 2, 3, 3, 3]] and pos.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2]]
    model = build_model(tiny(sliding_window=16), seed=0).eval()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (1, 30), generator=g)
    reused = torch.tensor([[0] * 10 + [1] * 6 + [0] * 14])
    distinct = torch.tensor([[0] * 10 + [1] * 6 + [2] * 14])
    with torch.no_grad():
        a, b = model(ids, doc_ids=reused), model(ids, doc_ids=distinct)
        alone = model(ids[:, 16:])
    assert torch.equal(a.logits, b.logits)
    assert torch.allclose(a.logits[:, 16:], alone.logits, atol=1e-5)  # the third run sees nothing of the first
    labels = torch.arange(8)[None]
    assert shift_labels(labels, 2, doc).tolist() == shift_labels(labels, 2, seg).tolist()
    assert shift_labels(labels, 2, doc)[0, 3:5].tolist() == [-100, -100]  # 3 -> 5 and 4 -> 6 cross runs


def test_a_config_written_by_pretrained_config_loads_and_architecture_typos_still_fail(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = tiny()
    generic = transformers.PretrainedConfig().to_dict()
    hf = {**generic, **cfg.to_hf_dict()}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(hf))
    assert ModelConfig.from_dict(json.loads(path.read_text()), str(path)) == cfg
    with pytest.raises(ConfigError, match=r"unknown config field\(s\) \['n_routed_expert'\]"):
        ModelConfig.from_dict({**hf, "n_routed_expert": 8}, str(path))


def test_v4_0731_dspark_is_refused_by_name_and_v41_is_recognised():
    from trex.models.deepseek_v4.config_v41 import V41Config, config_from_dict, tiny_v41

    hf = {**tiny().to_hf_dict(), "dspark_num_layers": 3}
    with pytest.raises(ConfigError, match="DSpark speculative-decoding drafter") as e:
        config_from_dict(hf, "config.json")
    assert "mtp" in str(e.value)
    released = {"model_type": "deepseek_v41", "text_config": tiny_v41().to_hf_dict(), "vision_config": {"depth": 32}}
    assert config_from_dict(released, "config.json") == tiny_v41()
    assert isinstance(config_from_dict(tiny_v41().to_hf_dict()), V41Config)


def test_padding_counts_in_no_moe_statistic():
    # one row of 24 real tokens and 8 padding tokens against the same 24 tokens alone
    model = build_model(tiny(), seed=0).train()
    g = torch.Generator().manual_seed(3)
    real = torch.randint(0, 256, (1, 24), generator=g)
    padded = torch.cat([real, torch.zeros(1, 8, dtype=torch.long)], dim=1)
    docs = torch.tensor([[0] * 24 + [1] * 8])
    mask = docs == 0
    alone = model(real).moe_stats
    masked = model(padded, doc_ids=docs, token_mask=mask).moe_stats
    unmasked = model(padded, doc_ids=docs).moe_stats
    for a, b, c in zip(alone, masked, unmasked):
        assert torch.equal(a.counts, b.counts), a.layer
        assert c.counts.sum() == b.counts.sum() * 32 // 24  # without the mask the padding is counted
        if a.balance_loss is not None:
            assert torch.allclose(a.balance_loss, b.balance_loss, rtol=1e-5), a.layer
    assert torch.equal(model(padded, doc_ids=docs, token_mask=mask).logits, model(padded, doc_ids=docs).logits)
