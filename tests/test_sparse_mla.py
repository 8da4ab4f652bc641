"""The ``sparse_mla`` op (DeepSeek-V3.2's MLA over the indexer's picks, absorbed form): the chunked gathers
against the mask-form reference, forward and every gradient, with invalid picks (queries that see fewer
keys than k) over packed documents, several query chunks, a context-parallel shard's picks, and compiled."""

from __future__ import annotations

import pytest
import torch

from trex import kernels
from trex.kernels import sparse_mla
from trex.kernels.dense_attention import document_causal_mask

# measured bf16 gap (largest |gathered - reference| / largest |reference|): out 0, dq 7.1e-3, dkv 4.6e-3 (bf16
# roundings of the scores' gradient before its matmuls); against fp64 both are as far (gathered 4.7e-3, 7.0e-3,
# 4.9e-3; reference 4.7e-3, 4.3e-3, 4.9e-3)
BF16_BOUND = 2e-2
PER_QUERY = 2 * 8 * (20 * (4 + 8) + 4 * 3 * 4)  # sparse_mla._chunks' bytes a query of _inputs (fp32)


def _picks(doc: torch.Tensor, k: int, q_start: int, s: int, seed: int):
    """Random top-k picks among each query's visible keys (rows q_start .. q_start + s - 1): idx, valid [B, s, k]
    as the indexer returns them (distinct indices, the invalid ones where a query sees fewer than k keys)."""
    visible = document_causal_mask(doc, q_start, s)[:, 0]
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(visible.shape, generator=g).masked_fill(~visible, float("-inf"))
    top = scores.topk(k, dim=-1)
    return top.indices, top.values > float("-inf")


def _inputs(dtype, S=40, H=3, c=20, k=8, q_start=0, s=None, seed=0):
    """Row 0: three packed documents; row 1: a padding run (its own segment) then one document."""
    s = S if s is None else s
    g = torch.Generator().manual_seed(seed)
    q, kv, d_out = torch.randn(2, s, H, c, generator=g), torch.randn(2, S, c, generator=g), torch.randn(2, s, H, 16,
                                                                                                         generator=g)
    doc = torch.zeros(2, S, dtype=torch.long)
    doc[0, S // 4:] = 1
    doc[0, S // 2 + 3:] = 2
    doc[1, 13:] = 1
    idx, valid = _picks(doc, k, q_start, s, seed)
    return q.to(dtype).requires_grad_(), kv.to(dtype).requires_grad_(), idx, valid, d_out.to(dtype)


def _run(fn, q, kv, idx, valid, d_out, scale=0.3):
    out = fn(q, kv, scale, idx, valid, 16)
    return [out, *torch.autograd.grad(out, (q, kv), d_out)]


def _rel(got, expected):
    return ((got.float() - expected.float()).abs().max() / expected.float().abs().max()).item()


def test_registry_defaults_to_the_gathered_form_and_honours_reference(monkeypatch):
    assert kernels.get("sparse_mla", "cpu") is sparse_mla.gathered
    assert kernels.reference_of("sparse_mla") is sparse_mla.reference
    monkeypatch.setenv("TREX_KERNELS", "sparse_mla=reference")
    assert kernels.get("sparse_mla", "cpu") is sparse_mla.reference


@pytest.mark.parametrize("chunk_bytes", [sparse_mla.CHUNK_BYTES, 3 * PER_QUERY])
def test_gathered_matches_the_mask_form_fp32(monkeypatch, chunk_bytes):
    """fp32: output, dq and dkv within 1e-5 of the reference, in one chunk and in several (3 queries a
    chunk); invalid picks (the first queries of each document see fewer than k = 8 keys) add
    nothing."""
    monkeypatch.setattr(sparse_mla, "CHUNK_BYTES", chunk_bytes)
    inputs = _inputs(torch.float32)
    assert not inputs[3].all()  # some picks are invalid
    expected = _run(sparse_mla.reference, *inputs)
    got = _run(sparse_mla.gathered, *inputs)
    for name, a, b in zip(("out", "dq", "dkv"), got, expected):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert _rel(a, b) < 1e-5, (name, _rel(a, b))


def test_gathered_matches_the_mask_form_bf16():
    """bf16: within BF16_BOUND of the bf16 reference, and no further from the fp64 result than it."""
    truth = _run(sparse_mla.reference, *_inputs(torch.float64))
    expected = _run(sparse_mla.reference, *_inputs(torch.bfloat16))
    got = _run(sparse_mla.gathered, *_inputs(torch.bfloat16))
    for name, a, b, t in zip(("out", "dq", "dkv"), got, expected, truth):
        assert a.dtype == torch.bfloat16
        assert _rel(a, b) < BF16_BOUND, (name, _rel(a, b))
        assert _rel(a, t) <= 1.5 * _rel(b, t) + 2e-3, (name, _rel(a, t), _rel(b, t))


def test_a_shard_of_queries_gives_its_rows_of_the_whole():
    """Context parallelism needs no q_start: picks of rows 16..31 (absolute key indices) give the reference's
    rows, and kv's gradient is those rows' share."""
    q, kv, idx, valid, d_out = _inputs(torch.float32, q_start=16, s=16)
    expected = _run(sparse_mla.reference, q, kv, idx, valid, d_out)
    got = _run(sparse_mla.gathered, q, kv, idx, valid, d_out)
    for a, b in zip(got, expected):
        assert _rel(a, b) < 1e-5


def test_gathered_compiles_without_a_graph_break(monkeypatch):
    """fullgraph=True over two chunks (the loop unrolled), forward and backward equal to eager. Traced by
    Dynamo and AOT autograd (backend aot_eager: Inductor's code generation adds 20 CPU-s here; it compiles the
    op inside V3.2's blocks in tests/test_train_v32.py)."""
    monkeypatch.setattr(sparse_mla, "CHUNK_BYTES", 20 * PER_QUERY)  # 20 of the 40 queries a chunk
    inputs = _inputs(torch.float32)
    eager = _run(sparse_mla.gathered, *inputs)
    compiled = _run(torch.compile(sparse_mla.gathered, fullgraph=True, backend="aot_eager"), *inputs)
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
