"""DeepSeek-V3.2's two training stages on ``tiny-v3.2`` (the indexer keeps 8 keys of up to 64), as DeepSeek's
V3.2 report describes them and docs/model.md says what trex does at each:

  dense warm-up  ``[train] indexer_warmup = true`` + ``indexer_loss`` > 0: dense attention, only the
                 indexer trains, by its KL to the main attention over every visible token
  sparse         ``[train] indexer_loss`` > 0, ``freeze_indexer = false``: top-k attention, the indexer
                 trained by its KL over its picks (inputs detached), the rest by the LM loss

Here: the KL against its definition, gradient separation, each stage a few steps through the loop, blocks
compiled without graph breaks, no host sync in a step, and (slow) one process against FSDP2 + EP2."""

from __future__ import annotations

import json
import os

import pytest
import torch
from trex_run import ROOT, trex

from trex import device as device_layer
from trex.kernels.dense_attention import document_causal_mask
from trex.models import build_model
from trex.models.deepseek_v3.config import tiny_v32
from trex.models.deepseek_v3.model import sequence_context
from trex.precision import PrecisionPolicy
from trex.recipe import load
from trex.syncs import SyncCounter
from trex.train.config import TrainRecipe
from trex.train.loop import model_for, tokenizer_for, train

FIDELITY = os.path.join(ROOT, "recipes", "fidelity_default.toml")
V32 = ['model.preset="tiny-v3.2"', "model.overrides={initializer_range=0.1}", "train.progress=false",
       "fidelity.every=0", 'optim.name="adamw"', "schedule.warmup_steps=0"]
WARMUP = ["train.indexer_warmup=true", "train.indexer_loss=1.0", "train.freeze_indexer=false"]
SPARSE = ["train.indexer_loss=1.0", "train.freeze_indexer=false"]


def _batch(cfg, B=2, S=40, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (B, S), generator=gen)
    docs = torch.zeros_like(ids)
    docs[1, 17:] = 1
    return ids, docs


def _kl_by_hand(model, ids, docs, layer: int, warmup: bool) -> torch.Tensor:
    """One layer's indexer KL from the definitions: the main attention's probabilities averaged over heads
    (= summed and L1-normalised), over every visible key (warm-up) or renormalised over the picks, against
    softmax of I[t, s] = sum_h w[t, h] relu(q[t, h] . k[s]) over the same keys; mean over queries that have
    two keys or more."""
    seen = {}
    attn = model.layers[layer].attn
    hook = attn.register_forward_hook(lambda m, args, out: seen.update(x=args[0], ctx=args[1]))
    with torch.no_grad():
        model(ids, doc_ids=docs)
    hook.remove()
    x, ctx = seen["x"], seen["ctx"]
    B, S, _ = x.shape
    with torch.no_grad():
        qr = attn.q_norm(attn.wq_a(x))
        q = attn.wq_b(qr).view(B, S, attn.n_heads, -1)
        latent, k_pe = attn.wkv_a(x).split([attn.kv_lora, attn.rope], dim=-1)
        from trex.models.common.rope import apply_rope
        cos, sin = ctx.rope["main"]
        q = apply_rope(q, cos[:, :, None], sin[:, :, None])
        k_pe = apply_rope(k_pe, cos, sin)
        k_nope = attn.wkv_b(attn.kv_norm(latent)).view(B, S, attn.n_heads, -1)[..., :attn.nope]
        k = torch.cat((k_nope, k_pe[:, :, None].expand(-1, -1, attn.n_heads, -1)), dim=-1)
        visible = document_causal_mask(ctx.doc)[:, 0]
        scores = torch.einsum("bthd,bshd->bhts", q, k) * attn.softmax_scale
        qi, w, keys = attn.indexer.project(x, qr, ctx)
        index = torch.einsum("bth,bths->bts", w, torch.einsum("bthc,bsc->bths", qi, keys).relu())
        keep = visible.clone()
        if not warmup:
            top = index.masked_fill(~visible, float("-inf")).topk(attn.indexer.topk, dim=-1).indices
            keep &= torch.zeros_like(visible).scatter_(-1, top, True)
        p = scores.masked_fill(~keep[:, None], float("-inf")).softmax(-1).mean(1)
        logq = index.masked_fill(~keep, float("-inf")).log_softmax(-1)
        kl = torch.where(keep, p * (p.clamp(min=1e-30).log() - logq), 0.0).sum(-1)
        counted = keep.sum(-1) > 1
    return (kl * counted).sum() / counted.sum()


@pytest.mark.parametrize("warmup", [True, False])
def test_the_indexer_loss_is_the_kl_of_the_report(warmup):
    """Layer by layer, the model's KL (out.indexer_loss: the mean over layers of each layer's mean over
    queries) equals the hand computation, in both stages; in the sparse stage over 8 picks of up to 40."""
    cfg = tiny_v32(initializer_range=0.1, num_nextn_predict_layers=0)
    model = build_model(cfg, seed=0).train()
    ids, docs = _batch(cfg)
    model.align_indexer, model.dense_warmup = True, warmup
    with torch.no_grad():
        got = model(ids, doc_ids=docs).indexer_loss
    want = torch.stack([_kl_by_hand(model, ids, docs, i, warmup) for i in range(cfg.num_hidden_layers)]).mean()
    assert got.item() == pytest.approx(want.item(), rel=1e-5)
    assert want > 1e-3


def test_sparse_stage_keeps_the_two_gradients_apart():
    """The LM loss reaches every parameter but the indexer's (its top-k takes no gradient); the KL reaches
    only the indexer's (its inputs are detached). The recall (the main attention's mass on the picks) is
    below 1 with 8 picks and 1 with every key; warm-up's dense attention does not depend on the picks."""
    cfg = tiny_v32(initializer_range=0.1)
    model = build_model(cfg, seed=0).train()
    model.align_indexer = True
    ids, docs = _batch(cfg)
    out = model(ids, labels=ids, doc_ids=docs)
    out.loss.backward(retain_graph=True)
    indexer = {n for n, _ in model.named_parameters() if ".attn.indexer." in n}
    assert len(indexer) == 5 * (cfg.num_hidden_layers + cfg.num_nextn_predict_layers)
    lm = {n for n, p in model.named_parameters() if p.grad is not None}
    assert lm.isdisjoint(indexer) and lm | indexer >= {n for n, _ in model.named_parameters() if not n.startswith("mtp.")}
    model.zero_grad(set_to_none=True)
    out.indexer_loss.backward()
    assert {n for n, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0} == indexer
    model.measure_recall = True
    with torch.no_grad():
        recall = model(ids, doc_ids=docs).indexer_recall  # the main attention's mass on the 8 picks
        for block in [*model.layers, *model.mtp]:
            block.attn.indexer.topk = 64
        assert 0.2 < recall < 1 and model(ids, doc_ids=docs).indexer_recall.item() == pytest.approx(1.0)
    model.dense_warmup = True
    with torch.no_grad():
        dense = model(ids, doc_ids=docs).logits
        for block in model.layers:
            block.attn.indexer.topk = 1
        assert torch.equal(model(ids, doc_ids=docs).logits, dense)


def _run(overrides, tmp_path, name):
    recipe = load(TrainRecipe, path=FIDELITY, overrides=[*V32, *overrides, f'train.out="{tmp_path / name}"'])
    cpu = device_layer.Device("cpu")
    tokenizer = tokenizer_for(recipe.data.tokenizer)
    model = model_for(recipe, tokenizer, cpu, PrecisionPolicy.resolve("fp32", cpu))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    result = train(recipe, model=model, tokenizer=tokenizer)
    rows = [json.loads(line) for line in open(tmp_path / name / "metrics.jsonl")]
    moved = {k for k, v in result.model.state_dict().items() if not torch.equal(v, before[k])}
    return rows, moved


def test_each_stage_trains_through_the_loop(tmp_path):
    """Four steps of each stage through the loop. Warm-up: only the indexers move (the routers' biases and
    every other parameter stay), its KL falls. Sparse: everything trains, the indexers by their KL, which
    is logged; the LM loss falls."""
    rows, moved = _run([*WARMUP, "train.steps=4", "optim.lr=3e-2"], tmp_path, "warmup")
    assert moved and all(".attn.indexer." in k for k in moved), sorted(moved)[:5]
    assert len(moved) == 5 * 4  # 3 layers and the MTP layer, 5 tensors each
    assert rows[-1]["indexer_loss"] < 0.6 * rows[0]["indexer_loss"], [r["indexer_loss"] for r in rows]

    rows, moved = _run([*SPARSE, "train.steps=4", "optim.lr=1e-2"], tmp_path, "sparse")
    assert any(".attn.indexer." in k for k in moved) and any(k.endswith("gate.bias") for k in moved)
    assert "layers.1.attn.wkv_b.weight" in moved and "embed.weight" in moved
    assert all(r["indexer_loss"] > 0 for r in rows) and rows[-1]["loss"] < rows[0]["loss"]


def test_warmup_needs_an_indexer_and_its_loss(tmp_path):
    with pytest.raises(ValueError, match="set train.indexer_loss > 0"):
        load(TrainRecipe, path=FIDELITY, overrides=[*V32, "train.indexer_warmup=true"])
    recipe = load(TrainRecipe, path=FIDELITY, overrides=['model.preset="tiny-v3"', "model.overrides={}", *WARMUP,
                                                         f'train.out="{tmp_path}/v3"'])
    with pytest.raises(ValueError, match="no lightning indexer"):
        train(recipe)


@pytest.mark.parametrize("warmup", [False, True])
def test_blocks_compile_whole_and_a_step_reads_nothing_back(warmup):
    """The dense block, a MoE block and the MTP layer with the indexer selecting and its KL recorded: one
    graph each; a whole training step (LM loss + KL) without a device-to-host read."""
    cfg = tiny_v32()
    model = build_model(cfg, seed=0).train()
    model.align_indexer, model.dense_warmup = True, warmup
    ids, docs = _batch(cfg, S=40)  # 8 picks of up to 40 keys: sparse_mla's gathers, not its short-row mask form
    ctx = sequence_context(cfg, ids, docs)
    ctx.align_indexer, ctx.measure_recall, ctx.dense_warmup = True, False, warmup
    x = model.embed(ids)
    for name, fn, args in [("dense block", model.layers[0], (x, ctx)), ("moe block", model.layers[1], (x, ctx)),
                           ("mtp layer", model.mtp[0], (x, x, ctx))]:
        explained = torch._dynamo.explain(fn)(*args)
        assert explained.graph_break_count == 0, f"{name}: {[b.reason for b in explained.break_reasons]}"
        assert explained.graph_count == 1, name
    targets = [ids.roll(-1, 1), ids.roll(-2, 1)]
    with SyncCounter() as syncs:
        out = model(ids, doc_ids=docs, targets=targets, return_logits=False, token_mask=ids >= 0)
        loss = sum(t.mean() for t in out.token_nll) + out.indexer_loss
        loss.backward()
    assert syncs.count == 0, syncs.report()


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["sparse", "warmup"])
def test_fsdp2_and_expert_parallelism_give_the_losses_of_one_process(stage, tmp_path):
    """Each stage of tiny-v3.2 SFT under torchrun on two ranks as FSDP2 + EP2 against one process
    accumulating the same 2 x 4 rows: every step's loss, indexer KL and gradient norm within 1e-5 (measured:
    sparse 0, 1.7e-7, 1.2e-7; warm-up 0, 0, 9.3e-8)."""
    keys = SPARSE if stage == "sparse" else WARMUP
    common = ["train", FIDELITY, "--steps", "3", *[a for s in [*V32, *keys, "optim.eps=1e-8"] for a in ("--set", s)]]
    one = trex([*common, "--set", "train.grad_accum=2", "--out", str(tmp_path / "one")], env={"TREX_DEVICE": "cpu"})
    assert one.returncode == 0, one.stderr[-3000:]
    two = trex([*common, "--set", "parallel.dp_shard=2", "--set", "parallel.ep=2", "--out", str(tmp_path / "two")],
               procs=2, env={"TREX_DEVICE": "cpu"})
    assert two.returncode == 0, two.stderr[-3000:]
    rows = {name: [json.loads(line) for line in open(tmp_path / name / "metrics.jsonl")] for name in ("one", "two")}
    for a, b in zip(rows["one"], rows["two"], strict=True):
        for key in ("loss", "indexer_loss", "grad_norm"):
            assert abs(a[key] - b[key]) <= 1e-5 * abs(a[key]), (key, a["step"], a[key], b[key])
