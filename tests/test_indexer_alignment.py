"""The indexer alignment loss (``[train] indexer_loss``) and the indexer's recall of the attention,
against a per-query computation written out here."""

from __future__ import annotations

import pytest
import torch

from trex.models import build_model
from trex.models.deepseek_v4.compressor import Indexer
from trex.models.deepseek_v4.config import tiny
from trex.train.config import TrainSection


def _captured(model, ids):
    """Run a training forward with alignment and recall on, keeping each CSA layer's attention
    query, entries, picks and visibility."""
    seen = {}
    original = Indexer.align

    def spy(self, x, qr, q, scale, compressed, idx, valid, ctx, layout, rows, first_row):
        seen[id(self)] = dict(q=q.detach(), scale=scale, compressed=compressed.detach(), idx=idx, valid=valid,
                              visible=layout.visible(ctx.t0, ctx.t1), x=x.detach(), qr=qr.detach(), ctx=ctx)
        return original(self, x, qr, q, scale, compressed, idx, valid, ctx, layout, rows, first_row)

    Indexer.align = spy
    try:
        out = model(ids)
    finally:
        Indexer.align = original
    return out, seen


def _naive(model, rec, indexer):
    """KL and recall of one layer, query by query, from the definitions in the docs."""
    q, comp, idx, valid, visible = rec["q"], rec["compressed"], rec["idx"], rec["valid"], rec["visible"]
    with torch.no_grad():
        keys = indexer.compressor(rec["x"], rec["ctx"].layout(indexer.compressor.m)).float()
        qi, w = indexer._query(rec["x"], rec["qr"], rec["ctx"])
    B, S, H, _ = q.shape
    kl = torch.zeros(B, S, dtype=torch.float64)
    recall = []
    for b in range(B):
        for t in range(S):
            picks = [int(j) for j, ok in zip(idx[b, t], valid[b, t]) if ok]
            seen = [n for n in range(comp.shape[1]) if visible[b, t, n]]
            if seen:  # mass of the picks in the attention over all visible entries, heads averaged
                dense = torch.stack([torch.softmax(torch.stack([q[b, t, h].double() @ comp[b, n].double() * rec["scale"]
                                                                for n in seen]), 0) for h in range(H)]).mean(0)
                recall.append(sum(float(dense[seen.index(j)]) for j in picks))
            if len(picks) < 2:
                continue
            p = torch.stack([torch.softmax(torch.stack([q[b, t, h].double() @ comp[b, j].double() * rec["scale"]
                                                        for j in picks]), 0) for h in range(H)]).mean(0)
            score = torch.stack([sum(w[b, t, h].double() * torch.relu(qi[b, t, h].double() @ keys[b, j].double())
                                     for h in range(qi.shape[2])) for j in picks])
            kl[b, t] = (p * (p.log() - torch.log_softmax(score, 0))).sum()
    counted = (valid.sum(-1) > 1).sum()
    return kl.sum() / counted, sum(recall) / len(recall)


def test_alignment_and_recall_match_the_per_query_definitions():
    model = build_model(tiny(index_topk=3), seed=0).train()
    model.align_indexer = model.measure_recall = True
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(0))
    out, seen = _captured(model, ids)
    csa = [b.attn for b in model.layers if b.attn.indexer is not None]
    kls, recalls = zip(*(_naive(model, seen[id(a.indexer)], a.indexer) for a in csa))
    assert out.indexer_loss.item() == pytest.approx(float(sum(kls) / len(kls)), rel=1e-5)
    assert out.indexer_recall.item() == pytest.approx(float(sum(recalls) / len(recalls)), rel=1e-5)
    assert 0 < out.indexer_recall.item() < 1


def test_the_alignment_trains_only_the_indexer_and_leaves_the_forward_unchanged():
    ids = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(1))
    model = build_model(tiny(index_topk=3), seed=0).train()
    plain = model(ids, labels=ids)
    model.align_indexer = True
    aligned = model(ids, labels=ids)
    assert torch.equal(plain.loss, aligned.loss) and plain.indexer_loss is None
    aligned.indexer_loss.backward()
    learners = {n for n, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert learners and all(".indexer." in n for n in learners)
    assert any(".indexer.compressor." in n for n in learners) and any("weights_proj" in n for n in learners)
    model.eval()
    assert model(ids).indexer_loss is None  # training forwards only


def test_training_the_indexer_on_the_loss_aligns_it_with_the_attention():
    model = build_model(tiny(index_topk=3), seed=0).train()
    model.align_indexer = model.measure_recall = True
    indexer_params = [p for n, p in model.named_parameters() if ".indexer." in n]
    opt = torch.optim.Adam(indexer_params, lr=3e-2)
    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(2))
    first = model(ids)
    for _ in range(20):
        out = model(ids)
        opt.zero_grad()
        out.indexer_loss.backward()
        opt.step()
    last = model(ids)
    assert last.indexer_loss < 0.5 * first.indexer_loss
    assert last.indexer_recall > first.indexer_recall


def test_the_setting_needs_a_trainable_indexer():
    with pytest.raises(ValueError, match="set train.freeze_indexer = false"):
        TrainSection(indexer_loss=0.1)
    with pytest.raises(ValueError, match="train.indexer_loss: -1"):
        TrainSection(indexer_loss=-1.0, freeze_indexer=False)
    assert TrainSection(indexer_loss=0.1, freeze_indexer=False).indexer_loss == 0.1
