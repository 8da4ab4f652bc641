"""DeepSeek-V3.2 at scale: the indexer's selection, KL and recall by query chunks give one chunk's results,
and MLA over the picks (the absorbed ``sparse_mla``) is MLA's expanded attention when the picks are every key,
with and without wkv_b's FP8 input rounding."""

from __future__ import annotations

import pytest
import torch

from trex.kernels import sparse_mla
from trex.models import build_model
from trex.models.common.linear import QuantSim
from trex.models.deepseek_v3 import dsa
from trex.models.deepseek_v3.config import tiny_v32


def _batch(cfg, B=2, S=40):
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (B, S), generator=gen)
    docs = torch.zeros_like(ids)
    docs[1, 17:] = 1
    return ids, docs


def _step(model, ids, docs):
    """Logits, the indexer's KL and recall, and every gradient of loss + KL."""
    out = model(ids, labels=ids, doc_ids=docs)
    model.zero_grad(set_to_none=True)
    (out.loss + out.indexer_loss).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach(), out.indexer_loss.detach(), out.indexer_recall, grads


@pytest.mark.parametrize("warmup", [False, True])
def test_query_chunks_give_the_results_of_one_chunk(monkeypatch, warmup):
    """Budgets small enough for 40 queries to run in 5 chunks (the indexer's scores and the KL's target) and
    7 (the op's gathers): the same picks, logits, KL, recall and gradients (indexer's and the rest) as one chunk."""
    cfg = tiny_v32(initializer_range=0.1, num_nextn_predict_layers=0)
    model = build_model(cfg, seed=0).train()
    model.align_indexer, model.dense_warmup, model.measure_recall = True, warmup, not warmup
    ids, docs = _batch(cfg)
    whole = _step(model, ids, docs)
    indexer = model.layers[0].attn.indexer
    assert len(indexer.chunks(2, 40, 40, cfg.num_attention_heads)) == 1
    monkeypatch.setattr(dsa, "CHUNK_BYTES", 8 * 3 * 4 * 2 * (indexer.n_heads + cfg.num_attention_heads) * 40)
    per_query = 2 * cfg.index_topk * (12 * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) + 4 * 4 * cfg.num_attention_heads)
    monkeypatch.setattr(sparse_mla, "CHUNK_BYTES", 6 * per_query)  # 6 queries a chunk
    assert len(indexer.chunks(2, 40, 40, cfg.num_attention_heads)) == 5
    chunked = _step(model, ids, docs)
    for a, b in zip(whole[:2], chunked[:2]):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    if not warmup:
        torch.testing.assert_close(chunked[2], whole[2], rtol=1e-6, atol=1e-6)
    assert whole[3].keys() == chunked[3].keys() and any(".indexer." in n for n in whole[3])
    for name in whole[3]:
        torch.testing.assert_close(chunked[3][name], whole[3][name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("fp8_inputs", [False, True])
def test_every_key_picked_is_the_expanded_dense_attention(fp8_inputs):
    """index_topk >= S: the absorbed sparse path (q_nope through wkv_b's key rows, the latent as the values,
    lifted by its value rows) gives the expanded dense path's logits and gradients (the warm-up's MLA.core),
    also with wkv_b's FP8 input rounding simulated (the latent rounded as the expanded form's wkv_b input)."""
    cfg = tiny_v32(initializer_range=0.1, num_nextn_predict_layers=0, index_topk=64)
    model = build_model(cfg, seed=0).train()
    if fp8_inputs:
        model.set_quant(QuantSim(activations=True))
    ids, docs = _batch(cfg)
    runs = []
    for warmup in (False, True):
        model.dense_warmup = warmup
        out = model(ids, labels=ids, doc_ids=docs)
        model.zero_grad(set_to_none=True)
        out.loss.backward()
        runs.append((out.logits.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (sparse, g_sparse), (dense, g_dense) = runs
    torch.testing.assert_close(sparse, dense, rtol=1e-5, atol=1e-5)
    assert g_sparse.keys() == g_dense.keys()
    for name in g_dense:
        torch.testing.assert_close(g_sparse[name], g_dense[name], rtol=1e-4, atol=1e-6, msg=name)
