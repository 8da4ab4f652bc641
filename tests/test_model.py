"""Model behaviour beyond parity: packed sequences, the attention core against a dense oracle,
MoE routing, and the full-size builds on the meta device."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from trex.models import build_model, count_parameters, get_preset
from trex.models.common.moe import Experts
from trex.models.deepseek_v4.attention import sparse_attention
from trex.models.deepseek_v4.config import tiny
from trex.kernels.mhc import _Sinkhorn


def test_packed_documents_match_each_document_alone():
    model = build_model(tiny(), seed=0).eval()
    gen = torch.Generator().manual_seed(0)
    a = torch.randint(0, 256, (1, 21), generator=gen)  # lengths not multiples of the rates
    b = torch.randint(0, 256, (1, 30), generator=gen)
    packed = torch.cat([a, b], dim=1)
    doc_ids = torch.cat([torch.zeros_like(a), torch.ones_like(b)], dim=1)
    with torch.no_grad():
        out = model(packed, doc_ids=doc_ids)
        alone_a, alone_b = model(a), model(b)
    assert torch.allclose(out.logits[:, :21], alone_a.logits, atol=1e-5)
    assert torch.allclose(out.logits[:, 21:], alone_b.logits, atol=1e-5)
    # MTP sees the next token; only the last position of a document differs (its loss is masked)
    assert torch.allclose(out.mtp_logits[0][:, :20], alone_a.mtp_logits[0][:, :20], atol=1e-5)
    assert torch.allclose(out.mtp_logits[0][:, 21:], alone_b.mtp_logits[0], atol=1e-5)


def test_packed_loss_ignores_cross_document_targets():
    model = build_model(tiny(), seed=0).eval()
    ids = torch.randint(0, 256, (1, 16))
    doc = torch.tensor([[0] * 8 + [1] * 8])
    with torch.no_grad():
        packed = model(ids, labels=ids, doc_ids=doc).loss
        logits = model(ids, doc_ids=doc).logits[0]
    targets = ids[0, 1:].clone()
    targets[7] = -100  # position 7 would predict the first token of the next document
    expected = F.cross_entropy(logits[:-1], targets, ignore_index=-100)
    assert torch.allclose(packed, expected, atol=1e-6)


def test_forward_without_logits_gives_the_same_losses_and_gradients():
    """return_logits=False fuses the LM head with the loss (no [B, S, V] tensor): the labels' losses,
    the per-head NLL of given targets and every gradient match the forward that keeps the logits."""
    from trex.models.common.context import shift_labels

    model = build_model(tiny(num_nextn_predict_layers=1), seed=0)
    ids = torch.randint(0, 256, (2, 19), generator=torch.Generator().manual_seed(3))
    doc = torch.tensor([[0] * 9 + [1] * 10, [0] * 19])
    targets = [shift_labels(ids, j + 1, doc) for j in range(2)]
    results = []
    for keep in (True, False):
        model.zero_grad(set_to_none=True)
        out = model(ids, labels=ids, doc_ids=doc, targets=targets, return_logits=keep)
        (out.loss + 0.3 * out.mtp_loss + sum(n.sum() for n in out.token_nll) * 1e-2).backward()
        results.append((out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (kept, grads_kept), (fused, grads_fused) = results
    assert fused.logits is None and fused.mtp_logits == [] and kept.logits.shape == (2, 19, 256)
    torch.testing.assert_close(fused.loss, kept.loss)
    torch.testing.assert_close(fused.mtp_loss, kept.mtp_loss)
    for a, b, t in zip(fused.token_nll, kept.token_nll, targets, strict=True):
        torch.testing.assert_close(a, b)
        assert (a[t == -100] == 0).all()
    assert grads_fused.keys() == grads_kept.keys()
    for name, g in grads_kept.items():
        torch.testing.assert_close(grads_fused[name], g, rtol=1e-4, atol=1e-6, msg=name)
    main_only = model(ids, doc_ids=doc, targets=targets[:1], return_logits=False)
    assert len(main_only.token_nll) == 1 and torch.equal(main_only.token_nll[0], fused.token_nll[0])
    with pytest.raises(ValueError, match="one \\[B, S\\] tensor per head"):
        model(ids, targets=targets * 2)


def _dense_attention(q, kv, sink, scale, window, doc, comp, comp_visible):
    """Straightforward oracle: full [S, S + N] score matrix with an explicit mask."""
    B, S, H, c = q.shape
    t = torch.arange(S)
    raw_ok = (t[None, :] <= t[:, None]) & (t[None, :] > t[:, None] - window)
    raw_ok = raw_ok[None] & (doc[:, :, None] == doc[:, None, :])
    keys = torch.cat([kv, comp], dim=1)
    ok = torch.cat([raw_ok, comp_visible], dim=2)
    scores = torch.einsum("bshc,bnc->bhsn", q, keys) * scale
    scores = scores.masked_fill(~ok[:, None], float("-inf"))
    scores = torch.cat([scores, sink.view(1, H, 1, 1).expand(B, H, S, 1)], dim=-1)
    probs = scores.softmax(-1)[..., :-1]
    return torch.einsum("bhsn,bnc->bshc", probs, keys)


def test_sparse_attention_matches_dense_oracle():
    torch.manual_seed(0)
    B, S, H, c, W, N = 2, 45, 3, 16, 8, 6
    q, kv = torch.randn(B, S, H, c), torch.randn(B, S, c)
    sink, comp = torch.randn(H), torch.randn(B, N, c)
    doc = torch.tensor([[0] * 20 + [1] * 25, [0] * 45])
    visible = torch.rand(B, S, N) > 0.5
    dense = _dense_attention(q, kv, sink, c**-0.5, W, doc, comp, visible)
    ours = sparse_attention(q, kv, sink, c**-0.5, W, doc, comp, comp_mask=visible)
    assert torch.allclose(ours, dense, atol=1e-5)
    # the sparse (indexer) form: k distinct entries per query, some of them invalid
    idx = torch.rand(B, S, N).argsort(dim=-1)[..., :3]
    valid = torch.rand(B, S, 3) > 0.3
    chosen = (F.one_hot(idx, N).bool() & valid[..., None]).any(dim=2)
    sparse = sparse_attention(q, kv, sink, c**-0.5, W, doc, comp, comp_mask=valid, comp_idx=idx)
    dense = _dense_attention(q, kv, sink, c**-0.5, W, doc, comp, chosen)
    assert torch.allclose(sparse, dense, atol=1e-5)


def test_grouped_experts_match_per_token_loop():
    torch.manual_seed(0)
    experts = Experts(n=5, dim=12, inter=7, limit=10.0)
    for p in experts.parameters():
        p.data.normal_(0, 0.5)
    x = torch.randn(9, 12)
    idx = torch.stack([torch.randperm(5)[:2] for _ in range(9)])
    w = torch.rand(9, 2)
    expected = torch.zeros(9, 12)
    for t in range(9):
        for j in range(2):
            e = idx[t, j]
            g = (x[t] @ experts.w1[e].T).clamp(max=10.0)
            u = (x[t] @ experts.w3[e].T).clamp(-10.0, 10.0)
            expected[t] += w[t, j] * ((F.silu(g) * u) @ experts.w2[e].T)
    assert torch.allclose(experts(x, idx, w), expected, atol=1e-5)


def test_training_mode_reports_balance_loss_and_expert_counts():
    cfg = tiny()
    model = build_model(cfg, seed=0).train()
    out = model(torch.randint(0, 256, (2, 16)))
    assert len(out.moe_stats) == cfg.num_hidden_layers + cfg.num_nextn_predict_layers
    for stat, mlp_type in zip(out.moe_stats, cfg.mlp_layer_types + ["moe"]):
        assert stat.counts.sum().item() == 2 * 16 * cfg.num_experts_per_tok
        assert (stat.balance_loss is None) == (mlp_type == "hash_moe")
    assert out.moe_stats[1].balance_loss.requires_grad


def _count_from_shapes(d, layers, heads, q_lora, groups, experts, inter, vocab, layer_types):
    """Parameter count from the checkpoint shape table of the reference notes (section 4.2)."""
    c, rd, n, o_lora, ci, hi = 512, 64, 4, 1024, 128, 64
    per_layer = 2 * d + 2 * ((2 + n) * n * n * d + (2 + n) * n + 3)  # norms, mHC attn + ffn
    per_layer += heads + q_lora * d + q_lora + heads * c * q_lora + c * d + c  # sink, q path, kv
    per_layer += groups * o_lora * (heads * c // groups) + d * groups * o_lora  # wo_a, wo_b
    per_layer += experts * d + 3 * experts * inter * d + 3 * inter * d  # router, routed, shared
    total = vocab * d * 2 + d + n * n * d + n + 1 + layers * per_layer  # embed, head, norm, hc_head
    for t in layer_types:
        if t == "compressed_sparse_attention":
            total += 2 * (2 * c) * d + 4 * 2 * c + c  # compressor (overlapping, 2c wide)
            total += hi * ci * q_lora + hi * d + 2 * (2 * ci) * d + 4 * 2 * ci + ci  # indexer
        elif t == "heavily_compressed_attention":
            total += 2 * c * d + 128 * c + c
    active = total - layers * (experts - 6) * 3 * inter * d
    del rd
    return total, active


def test_full_size_models_build_on_meta_with_exact_parameter_counts():
    for name, expected_b in (("deepseek-v4-flash", (284.3, 13.8)), ("deepseek-v4-pro", (1573, 49.8))):
        cfg = get_preset(name)
        count = count_parameters(cfg)
        total, active = _count_from_shapes(cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads,
                                           cfg.q_lora_rank, cfg.o_groups, cfg.n_routed_experts,
                                           cfg.moe_intermediate_size, cfg.vocab_size, cfg.layer_types)
        assert (count.total, count.active) == (total, active)
        assert abs(count.total / 1e9 - expected_b[0]) / expected_b[0] < 0.005
        assert abs(count.active / 1e9 - expected_b[1]) / expected_b[1] < 0.01
        assert count.mtp > 0


def test_full_activation_checkpointing_adds_no_moe_stats_in_backward_and_keeps_gradients():
    """A checkpointed block re-runs in backward; its MoE must not record stats (or a graph) again."""
    from trex.parallel.plan import apply_activation_checkpointing

    cfg = tiny()
    ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    grads, stats = [], []
    for mode in ("none", "full"):
        model = build_model(cfg, device="cpu", dtype=torch.float32, seed=0)
        apply_activation_checkpointing(model, mode)
        out = model(ids, labels=ids)
        (out.loss + out.mtp_loss).backward()
        stats.append([s.layer for s in out.moe_stats])
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
        # nothing of the recompute stays on the modules (a kept balance loss would keep its whole graph)
        assert all(block.ffn.routing is None for block in [*model.layers, *model.mtp]), mode
    assert stats[1] == stats[0] and len(stats[0]) == cfg.num_hidden_layers + cfg.num_nextn_predict_layers
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("iters", [1, 3, 20])
def test_sinkhorn_function_matches_the_plain_normalisation_loop(iters):
    """mHC's Sinkhorn node (hand-written backward) against the loop of divisions autograd differentiates."""
    g = torch.Generator().manual_seed(iters)
    x0 = torch.rand(2, 5, 4, 4, generator=g, dtype=torch.float64) + 1e-3
    upstream = torch.randn(2, 5, 4, 4, generator=g, dtype=torch.float64)
    eps = 1e-6

    def loop(x):
        x = x / (x.sum(-2, keepdim=True) + eps)
        for _ in range(iters - 1):
            x = x / (x.sum(-1, keepdim=True) + eps)
            x = x / (x.sum(-2, keepdim=True) + eps)
        return x

    a, b = x0.clone().requires_grad_(), x0.clone().requires_grad_()
    ya, yb = _Sinkhorn.apply(a, iters, eps), loop(b)
    (ya * upstream).sum().backward()
    (yb * upstream).sum().backward()
    torch.testing.assert_close(ya, yb, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-12)
    if iters == 20:  # columns sum to one after the last normalisation
        torch.testing.assert_close(ya.sum(-2), torch.ones(2, 5, 4, dtype=torch.float64), rtol=0, atol=1e-5)
