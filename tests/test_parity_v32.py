"""DeepSeek-V3.2 (DeepSeek Sparse Attention) against transformers 5.23 ``DeepseekV32ForCausalLM``.

A random-weight tiny model (the indexer keeping 8 of up to 37 keys: really sparse) saved with
``save_pretrained`` and loaded with ``trex.checkpoint.load_pretrained``: logits, loss and every gradient
transformers has must match in fp32. transformers' indexer runs under ``no_grad`` (no gradient, no KL
loss), so its parameters have no gradient there, and none in trex without ``align_indexer`` (the top-k
takes no LM gradient); the indexer's own loss is tested against its definition in test_train_v32.py. And the other way: what trex
writes in the released names, transformers reads.
"""

from __future__ import annotations

import torch

from hf_oracle_v3 import hf_config_v32, random_hf_v32
from trex.checkpoint import load_pretrained
from trex.checkpoint.naming import to_trex


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp(min=1e-12)).item()


def test_logits_loss_and_gradients_match_transformers(tmp_path):
    ref = random_hf_v32(hf_config_v32())
    ref.save_pretrained(tmp_path)
    ours = load_pretrained(str(tmp_path), dtype=torch.float32, device="cpu")
    n_layers = ref.config.num_hidden_layers
    assert ours.cfg.sparse and ours.cfg.index_topk == 8
    ids = torch.randint(0, ref.config.vocab_size, (2, 37), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[0, :5] = -100

    r = ref(ids, labels=labels)
    o = ours(ids, labels=labels)
    assert (r.logits - o.logits).abs().max().item() <= 1e-4
    assert _rel(o.logits, r.logits) <= 1e-5  # measured 6.0e-7
    assert abs(r.loss.item() - o.loss.item()) <= 1e-5 * abs(r.loss.item())
    ref.config.index_topk = ours.cfg.index_topk = 64  # every visible key: the picks above did matter
    for layer in [*ref.model.layers]:
        layer.self_attn.indexer.index_topk = 64
    for block in ours.layers:
        block.attn.indexer.topk = 64
    with torch.no_grad():
        dense = ref(ids).logits
    assert _rel(dense, r.logits) > 1e-2

    r.loss.backward()
    o.loss.backward()
    ours_params = dict(ours.named_parameters())
    compared, indexer = set(), set()
    for hf_name, p in ref.named_parameters():
        for key, _expert, ref_grad in to_trex(hf_name, p.grad if p.grad is not None else torch.zeros_like(p),
                                               arch="deepseek_v3", n_layers=n_layers):
            if ".attn.indexer." in key:  # no gradient on either side
                assert p.grad is None and ours_params[key].grad is None, key
                indexer.add(key)
                continue
            err = _rel(ours_params[key].grad, ref_grad)
            assert err <= 1e-3, f"{key}: relative gradient error {err:.2e}"
            compared.add(key)
    assert len(indexer) == 5 * n_layers  # wq_b, wk, k_norm weight and bias, weights_proj
    assert compared | indexer == set(ours_params)


def test_a_transformers_v32_checkpoint_has_no_mtp_layer_and_gains_none(tmp_path, caplog):
    """transformers' DeepseekV32Config has no num_nextn_predict_layers and its checkpoints no MTP tensors: a
    missing field means no MTP layer (not V3's 1), so nothing is initialised fresh and convert writes none."""
    import json

    from trex.checkpoint.save import convert

    ref = random_hf_v32(hf_config_v32())
    ref.save_pretrained(tmp_path / "hf")
    assert "num_nextn_predict_layers" not in json.loads((tmp_path / "hf" / "config.json").read_text())
    with caplog.at_level("WARNING"):
        ours = load_pretrained(str(tmp_path / "hf"), dtype=torch.float32, device="cpu")
    assert ours.cfg.num_nextn_predict_layers == 0 and not any(k.startswith("mtp.") for k, _ in ours.named_parameters())
    assert "initialised fresh" not in caplog.text
    convert(str(tmp_path / "hf"), str(tmp_path / "conv"))
    written = json.loads((tmp_path / "conv" / "config.json").read_text())
    assert written["num_nextn_predict_layers"] == 0
    index = json.loads((tmp_path / "conv" / "model.safetensors.index.json").read_text())["weight_map"]
    assert not any(k.startswith(f"model.layers.{ref.config.num_hidden_layers}.") for k in index)


def test_save_pretrained_is_read_by_load_pretrained_and_transformers(tmp_path):
    """A tiny-v3.2 (the k_norm's bias random) written in the released names (``self_attn.indexer.wq_b`` keeps
    its name): trex reads it back to the same logits exactly, transformers' DeepseekV32ForCausalLM to within
    fp32 rounding (measured 2.5e-7 norm-relative; it ignores the MTP layer, which it does not build)."""
    import transformers

    from trex.checkpoint.save import save_pretrained
    from trex.models import build_model, get_preset

    model = build_model(get_preset("tiny-v3.2"), seed=3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("k_norm.bias"):
                p.normal_(0.0, 0.1, generator=torch.Generator().manual_seed(1))
    save_pretrained(model, str(tmp_path / "m"), dtype="fp32")
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model.eval()(ids).logits
        assert torch.equal(load_pretrained(str(tmp_path / "m")).eval()(ids).logits, want)
        hf = transformers.DeepseekV32ForCausalLM.from_pretrained(str(tmp_path / "m"), dtype=torch.float32,
                                                                 attn_implementation="eager").eval()
        got = hf(ids).logits
    assert (got - want).abs().max() < 1e-5 and (got - want).norm() / want.norm() < 1e-6
