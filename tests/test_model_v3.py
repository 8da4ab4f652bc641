"""The DeepSeek-V3 family's model: parameter counts of the released shapes (built on the meta device),
the training forward's contract, compiled blocks without graph breaks, no host read in a training step,
and FP8 checkpoints with fp32 block scales (as DeepSeek releases V3)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from trex.checkpoint import load_pretrained
from trex.checkpoint.naming import trex_targets
from trex.kernels import quantize
from trex.models import build_model, count_parameters, get_preset
from trex.models.common.cross_entropy import IGNORE_INDEX
from trex.models.common.moe import limit_groups
from trex.models.deepseek_v3.config import tiny_moonlight, tiny_v3
from trex.models.deepseek_v3.model import sequence_context
from trex.syncs import SyncCounter


def _released_count(d, L, H, q_lora, kv_lora, nope, rope, v, inter, moe_inter, dense, E, k, shared, V, mtp):
    """(total, active, mtp) of a V3-family config by hand: embedding + head + final norm, per layer MLA,
    two norms and a dense MLP or a MoE (router, E routed + the shared expert); MTP: eh_proj, three norms
    and a MoE block (the embedding and head are the main model's)."""
    qk = nope + rope
    attn = (d * q_lora + q_lora + q_lora * H * qk if q_lora else d * H * qk)
    attn += d * (kv_lora + rope) + kv_lora + kv_lora * H * (nope + v) + H * v * d
    moe_block = attn + E * d + (E + shared) * 3 * d * moe_inter + 2 * d
    dense_block = attn + 3 * d * inter + 2 * d
    total = 2 * V * d + d + dense * dense_block + (L - dense) * moe_block
    return total, total - (L - dense) * (E - k) * 3 * d * moe_inter, mtp * (2 * d * d + 3 * d + moe_block)


@pytest.mark.parametrize("name, shapes, released", [
    ("deepseek-v3", (7168, 61, 128, 1536, 512, 128, 64, 128, 18432, 2048, 3, 256, 8, 1, 129280, 1),
     (671_026_404_352, 37_552_282_624, 11_610_067_968)),
    ("kimi-k2", (7168, 61, 64, 1536, 512, 128, 64, 128, 18432, 2048, 1, 384, 8, 1, 163840, 0),
     (1_026_408_209_408, 32_861_477_888, 0)),
    ("moonlight", (2048, 27, 16, 0, 512, 128, 64, 128, 11264, 1408, 1, 64, 6, 2, 163840, 0),
     (15_960_108_544, 2_914_774_528, 0)),
])
def test_released_parameter_counts_from_the_meta_model(name, shapes, released):
    """671.03B / 37.55B active (+ 11.61B MTP), Kimi-K2 1.026T / 32.86B, Moonlight 15.96B / 2.91B."""
    count = count_parameters(get_preset(name))
    assert (count.total, count.active, count.mtp) == _released_count(*shapes) == released


def test_v32_adds_one_indexer_per_layer_to_the_v3_count():
    """DeepSeek-V3.2 = V3's shapes + a lightning indexer in every layer and in the MTP layer: wq_b [64 x 128,
    1536], wk [128, 7168], k_norm's weight and bias [128], weights_proj [64, 7168] = 13,959,424 each:
    671,877,929,216 in all (38.40B active, 11.62B MTP; with the MTP layer's stored copies of the embedding
    and head, 685.36B: the release's "685B")."""
    v3, v32 = count_parameters(get_preset("deepseek-v3")), count_parameters(get_preset("deepseek-v3.2"))
    per_layer = 1536 * 64 * 128 + 7168 * 128 + 2 * 128 + 7168 * 64
    assert per_layer == 13_959_424
    assert (v32.total, v32.active, v32.mtp) == (v3.total + 61 * per_layer, v3.active + 61 * per_layer,
                                                 v3.mtp + per_layer)
    assert (v32.total, v32.active, v32.mtp) == (671_877_929_216, 38_403_807_488, 11_624_027_392)
    assert v32.total + v32.mtp + 2 * 129280 * 7168 == 685_355_314_688


def test_group_limit_keeps_the_best_groups_by_their_top_two():
    """Groups of two scored by their top-two sum (0.9, 1.0, 0.8, 0.4: groups 0 and 1 stay), not by their
    best expert (0.9, 0.5, 0.7, 0.2 would keep groups 0 and 2)."""
    scores = torch.tensor([[0.9, 0.0, 0.5, 0.5, 0.7, 0.1, 0.2, 0.2]])
    kept = limit_groups(scores, 4, 2)
    assert torch.isfinite(kept).tolist() == [[True] * 4 + [False] * 4]
    assert torch.equal(kept[0, :4], scores[0, :4])


def test_training_forward_contract():
    """targets / return_logits=False equal the logits' NLL; labels give loss and mtp_loss; token_mask
    keeps padding out of the statistics; routes replay what route_log recorded; MoE stats per MoE layer
    (main, then MTP), none for the dense layer."""
    cfg = tiny_v3()
    model = build_model(cfg, seed=0).train()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=gen)
    docs = torch.zeros_like(ids)
    docs[1, 10:] = 1
    log: dict[str, torch.Tensor] = {}
    out = model(ids, labels=ids, doc_ids=docs, route_log=log)
    assert [s.layer for s in out.moe_stats] == ["layers.1", "layers.2", "mtp.0"]
    assert all(s.balance_loss is not None for s in out.moe_stats)
    assert sorted(log) == ["layers.1", "layers.2", "mtp.0"] and log["layers.1"].shape == (2, 24, 2)
    targets = [ids.roll(-1 - j, 1) for j in range(2)]
    targets[0][:, -1] = IGNORE_INDEX
    fused = model(ids, doc_ids=docs, targets=targets, return_logits=False)
    plain = model(ids, doc_ids=docs, targets=targets)
    assert fused.logits is None and len(fused.token_nll) == 2
    for a, b in zip(fused.token_nll, plain.token_nll):
        assert torch.allclose(a, b, atol=1e-5)
    replayed = model(ids, doc_ids=docs, routes={k: v.flip(-1) for k, v in log.items()})
    assert torch.allclose(replayed.logits, out.logits, atol=1e-5)  # the same experts, in another order
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[:, 20:] = False
    counted = model(ids, doc_ids=docs, token_mask=mask).moe_stats[0].counts
    assert counted.sum().item() == 2 * 20 * cfg.num_experts_per_tok


class _TwoShards:
    """The second of two context-parallel shards, for tracing: ``gather`` stands in for the all-gather (this
    rank's rows twice; the collective itself is traced in tests/test_context_parallel.py's compiled run)."""

    rank, size = 1, 2

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat((x, x), dim=1)


@pytest.mark.parametrize("make,shard", [(tiny_v3, None), (tiny_moonlight, None), (tiny_v3, _TwoShards())],
                         ids=["tiny-v3", "tiny-moonlight", "tiny-v3-cp"])
def test_every_block_kind_compiles_without_a_graph_break(make, shard):
    """The dense block, the MoE block (group-limited routing for tiny-v3), the MTP layer and the fused LM
    head + loss: one graph each under torch._dynamo.explain; under context parallelism too (a shard's rows,
    MLA's latents gathered, the causal mask offset by the shard's first row)."""
    torch.manual_seed(0)
    cfg = make()
    model = build_model(cfg, seed=0).train()
    ids = torch.randint(0, cfg.vocab_size, (2, 32))
    docs = torch.zeros_like(ids)
    docs[0, 11:] = 1
    ctx = sequence_context(cfg, ids, docs, shard=shard)
    x = model.embed(ctx.input_ids)
    cases = [("dense block", model.layers[0], (x, ctx)), ("moe block", model.layers[1], (x, ctx)),
             ("LM head + loss", model.head_nll, (x, ctx.input_ids))]
    cases += [("mtp layer", model.mtp[0], (x, x, ctx))] if model.mtp else []
    for name, fn, args in cases:
        explained = torch._dynamo.explain(fn)(*args)
        assert explained.graph_break_count == 0, f"{name}: {[b.reason for b in explained.break_reasons]}"
        assert explained.graph_count == 1, name


def test_a_training_step_reads_nothing_back_to_the_host():
    cfg = tiny_v3()
    model = build_model(cfg, seed=0).train()
    ids = torch.randint(0, cfg.vocab_size, (2, 24))
    docs = torch.zeros_like(ids)
    docs[0, 7:] = 1
    targets = [ids.roll(-1, 1), ids.roll(-2, 1)]
    with SyncCounter() as syncs:
        out = model(ids, doc_ids=docs, targets=targets, return_logits=False, token_mask=ids >= 0)
        loss = sum(t.mean() for t in out.token_nll) + sum(s.balance_loss for s in out.moe_stats)
        loss.backward()
    assert syncs.count == 0, syncs.report()


def _released_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 e4m3 with one fp32 scale per 128 x 128 block, amax / 448, as DeepSeek's V3 checkpoints."""
    amax = quantize._block_amax(w, 128, 128).clamp(min=1e-4)
    scale = amax / quantize.E4M3_MAX
    q = (w / quantize._expand(scale, 128, 128, *w.shape)).to(torch.float8_e4m3fn)
    return q, scale


def test_dequantize_fp8_reads_fp32_scales():
    w = torch.randn(300, 200) * 0.05
    q, scale = _released_fp8(w)
    assert scale.dtype == torch.float32 and scale.shape == (3, 2)
    back = quantize.dequantize_fp8(q, scale)
    assert torch.equal(back, q.float() * quantize._expand(scale, 128, 128, 300, 200))
    assert (back - w).abs().max() <= 0.07 * w.abs().max()  # e4m3: 3 mantissa bits
    with pytest.raises(quantize.QuantFormatError, match="block scale"):
        quantize.dequantize_fp8(q, scale.to(torch.int32))


def test_a_released_style_fp8_checkpoint_loads(tmp_path):
    """Every linear of a tiny V3 stored as the release stores it (e4m3 + fp32 ``weight_scale_inv``, HF
    names, per-expert tensors, the MTP layer as ``model.layers.{n}``): the loaded model holds the
    dequantised weights."""
    cfg = tiny_v3(hidden_size=256, q_lora_rank=160)  # dims over one 128 block, partial blocks included
    model = build_model(cfg, seed=0)
    n = cfg.num_hidden_layers
    names = _hf_names(model, n)
    tensors, expected = {}, {}
    for hf, (key, expert) in names.items():
        value = dict(model.state_dict())[key]
        value = value[expert] if expert is not None else value
        if value.dim() == 2 and not key.endswith(("embed.weight", "head.weight", "gate.weight", "eh_proj.weight")):
            q, scale = _released_fp8(value)
            tensors[hf], tensors[hf + "_scale_inv"] = q, scale
            value = quantize.dequantize_fp8(q, scale)
        else:
            tensors[hf] = value.clone()
        expected[(key, expert)] = value
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    loaded = dict(load_pretrained(str(tmp_path), dtype=torch.float32, device="cpu").state_dict())
    for (key, expert), value in expected.items():
        got = loaded[key][expert] if expert is not None else loaded[key]
        assert torch.equal(got, value), key
    assert len({k for k, _ in expected}) == len(loaded)


def _hf_names(model, n_layers: int) -> dict[str, tuple[str, int | None]]:
    """Released name -> (trex key, expert) for every tensor of ``model``, found by inverting the reader's
    mapping over the names the release uses."""
    parts = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn": "self_attn",
             "ffn": "mlp", "wq_a": "q_a_proj", "q_norm": "q_a_layernorm", "wq_b": "q_b_proj", "wq": "q_proj",
             "wkv_a": "kv_a_proj_with_mqa", "kv_norm": "kv_a_layernorm", "wkv_b": "kv_b_proj", "wo": "o_proj",
             "w1": "gate_proj", "w3": "up_proj", "w2": "down_proj", "bias": "e_score_correction_bias"}
    out = {}
    for key, value in model.state_dict().items():
        comps = key.split(".")
        if comps[0] == "mtp":
            comps = ["layers", str(n_layers + int(comps[1]))] + (["shared_head"] if comps[2] == "norm" else []) + comps[2:]
        comps = [parts.get(c, c) for c in comps]
        if comps[0] == "embed":
            comps[0] = "embed_tokens"
        experts = ".experts." in key and comps[-1] in ("gate_proj", "up_proj", "down_proj")
        for e in range(value.shape[0]) if experts else [None]:
            name = ".".join(comps[:-1] + ([str(e), comps[-1], "weight"] if experts else [comps[-1]]))
            name = "lm_head.weight" if key == "head.weight" else "model." + name
            targets = trex_targets(name, "hf", "deepseek_v3", n_layers)
            assert [(t.key, t.expert) for t in targets] == [(key, e)], (name, targets)
            out[name] = (key, e)
    return out
