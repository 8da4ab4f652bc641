"""Packing invariants, the loader's resumable position and rank sharding."""

import numpy as np
import pytest
import torch

from trex.data import DataSection, build_loader, compact_tokenizer
from trex.data.documents import Documents
from trex.data.packing import IGNORE_INDEX, PackedRows, pack
from trex.data.records import write_jsonl
from trex.models.common.context import shift_labels

TOK = compact_tokenizer()
SEQ = 48


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "convos.jsonl"
    rng = np.random.default_rng(1)
    records = []
    for i in range(120):
        q = str(rng.integers(0, 10 ** rng.integers(1, 12)))
        records.append({"messages": [{"role": "user", "content": f"{i}:{q}"},
                                     {"role": "assistant", "content": q[::-1] * int(rng.integers(1, 3))}]})
    write_jsonl(path, records)
    return path


def loader_for(path, rank=0, world=1, batch=2, seed=0):
    cfg = DataSection(paths=[str(path)], tokenizer="compact", seq_len=SEQ, micro_batch_size=batch, seed=seed)
    return build_loader(cfg, rank, world, TOK)


def documents_of_row(input_ids, labels, doc_ids):
    """Split one packed row back into (ids, labels) per document, padding excluded."""
    pad_doc = doc_ids[-1]
    out = []
    for d in np.unique(doc_ids):
        sel = doc_ids == d
        assert np.all(np.diff(np.flatnonzero(sel)) == 1), "a document is not contiguous"
        if d == pad_doc and input_ids[sel][0] != TOK.bos_id:
            assert np.all(labels[sel] == IGNORE_INDEX) and np.all(input_ids[sel] == TOK.pad_id)
            continue
        out.append((tuple(input_ids[sel].tolist()), tuple(labels[sel].tolist())))
    return out


def test_pack_next_fit():
    assert pack(np.array([5, 5, 3, 8, 1]), 10).tolist() == [0, 2, 3, 5]
    assert pack(np.array([10, 10]), 10).tolist() == [0, 1, 2]
    with pytest.raises(ValueError, match="exceeds seq_len"):
        pack(np.array([11]), 10)


def test_packing_invariants(data_file):
    loader = loader_for(data_file)
    rows, docs = loader.rows, loader.rows.docs
    input_ids, labels, doc_ids = rows.rows(np.arange(len(rows)))
    seen = []
    for r in range(len(rows)):
        row_docs = documents_of_row(input_ids[r], labels[r], doc_ids[r])
        assert [d[0][0] for d in row_docs] == [TOK.bos_id] * len(row_docs)  # every document starts at its BOS
        assert np.all(np.diff(doc_ids[r]) >= 0)
        seen += row_docs
    spans = [(docs.offsets[d], docs.offsets[d + 1]) for d in rows.order.tolist()]
    want = [(tuple(docs.tokens[a:b].tolist()),
             tuple(np.where(docs.loss_mask[a:b], docs.tokens[a:b], IGNORE_INDEX).tolist())) for a, b in spans]
    assert seen == want  # each document exactly once, whole, in packing order, labels = masked ids
    assert sorted(rows.order.tolist()) == list(range(len(docs)))
    assert 0.5 < rows.efficiency <= 1.0


def test_labels_are_assistant_tokens_only(data_file):
    batch = next(loader_for(data_file))
    for ids, labels in zip(batch.input_ids.tolist(), batch.labels.tolist()):
        text = TOK.decode([i for i, l in zip(ids, labels) if l != IGNORE_INDEX])
        assert "<｜User｜>" not in text and ":" not in text  # the user turn "i:q" carries no loss
        assert text.count("<｜end▁of▁sentence｜>") == sum(1 for i in ids if i == TOK.bos_id)


def test_n_loss_tokens_matches_the_model_shift(data_file):
    batch = next(loader_for(data_file, batch=3))
    targets = shift_labels(batch.labels, 1, batch.doc_ids)
    assert batch.n_loss_tokens == int((targets != IGNORE_INDEX).sum()) > 0
    assert batch.input_ids.dtype == batch.labels.dtype == batch.doc_ids.dtype == torch.long
    assert batch.input_ids.shape == (3, SEQ)
    rows = zip(batch.input_ids.numpy(), batch.labels.numpy(), batch.doc_ids.numpy())
    assert batch.n_tokens == sum(len(ids) for row in rows for ids, _ in documents_of_row(*row))


@pytest.mark.parametrize("extra", [-2, 1])  # save late in epoch 0 (resume crosses into 1) / early in epoch 1
def test_resume_yields_exactly_the_remaining_batches(data_file, extra):
    first = loader_for(data_file)
    for _ in range(first.micro_batches_per_epoch + extra):
        next(first)
    state = first.state_dict()
    expected = [next(first) for _ in range(5)]
    resumed = loader_for(data_file)
    resumed.load_state_dict(state)
    for want in expected:
        got = next(resumed)
        assert torch.equal(got.input_ids, want.input_ids) and torch.equal(got.labels, want.labels)
        assert torch.equal(got.doc_ids, want.doc_ids)
    assert resumed.state_dict() == first.state_dict() and resumed.epoch == 1
    assert resumed.rows_consumed > 0


def test_resume_refuses_other_data_or_seed(data_file, tmp_path):
    state = loader_for(data_file).state_dict()
    with pytest.raises(ValueError, match="seed"):
        loader_for(data_file, seed=1).load_state_dict(state)
    other = tmp_path / "other.jsonl"
    write_jsonl(other, [{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}] * 9)
    with pytest.raises(ValueError, match="fingerprint"):
        loader_for(other).load_state_dict(state)


def row_keys(batch):
    return [tuple(r) for r in batch.input_ids.tolist()]


def test_rank_shards_are_disjoint_and_equal(data_file):
    world = 3
    loaders = [loader_for(data_file, rank=r, world=world, batch=2) for r in range(world)]
    counts = {l.micro_batches_per_epoch for l in loaders}
    assert len(counts) == 1
    n = counts.pop()
    assert n == len(loaders[0].rows) // (world * 2)
    shards = []
    for l in loaders:
        rows = [key for _ in range(n) for key in row_keys(next(l))]
        shards.append(rows)
        assert l.epoch == 0 and l.state_dict() == loaders[0].state_dict()
    assert all(len(s) == 2 * n for s in shards)
    flat = [k for s in shards for k in s]
    assert len(set(flat)) == len(flat)  # no row on two ranks (rows hold distinct documents)
    # the same global batch as a single rank with world * micro_batch_size rows
    single = loader_for(data_file, world=1, batch=world * 2)
    assert row_keys(next(single)) == shards[0][:2] + shards[1][:2] + shards[2][:2]


def test_epochs_reshuffle_deterministically(data_file):
    a, b = loader_for(data_file), loader_for(data_file)
    n = a.micro_batches_per_epoch
    epoch0 = [row_keys(next(a)) for _ in range(n)]
    epoch1 = [row_keys(next(a)) for _ in range(n)]
    assert epoch0 == [row_keys(next(b)) for _ in range(n)]
    assert epoch0 != epoch1
    assert row_keys(next(loader_for(data_file, seed=5))) != epoch0[0]


def test_too_few_rows_is_a_clear_error(tmp_path):
    path = tmp_path / "tiny.jsonl"
    write_jsonl(path, [{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}])
    with pytest.raises(ValueError, match=r"^data.paths = \[.*tiny.jsonl'\]: 1 packed rows of 48 tokens, but one step "
                                         r"takes 2 \(data.micro_batch_size = 1 x 2 ranks\)"):
        loader_for(path, world=2, batch=1)
    cfg = DataSection(paths=[str(path)], tokenizer="compact", seq_len=32, micro_batch_size=4)
    with pytest.raises(ValueError, match=r"^fidelity.probe_paths = .*\(fidelity.probe_rows = 4 x 1 rank\); add "
                                         r"records or lower fidelity.probe_rows"):  # names the setting to change
        build_loader(cfg, 0, 1, compact_tokenizer(), paths_key="fidelity.probe_paths", batch_key="fidelity.probe_rows")


def test_padding_rows_from_synthetic_documents():
    docs = Documents(tokens=np.arange(1, 8, dtype=np.int32), loss_mask=np.array([0, 1, 1, 0, 1, 1, 1], bool),
                     offsets=np.array([0, 3, 7]), records_read=2)
    rows = PackedRows.build(docs, DataSection(seq_len=5, shuffle=False, packing="next_fit"), pad_id=0)
    ids, labels, doc_ids = rows.rows(np.array([0, 1]))
    assert ids.tolist() == [[1, 2, 3, 0, 0], [4, 5, 6, 7, 0]]
    assert labels.tolist() == [[-100, 2, 3, -100, -100], [-100, 5, 6, 7, -100]]
    assert doc_ids.tolist() == [[0, 0, 0, 1, 1], [0, 0, 0, 0, 1]]
    assert rows.used(np.array([0, 1])).tolist() == [3, 4]


def test_bench_reports_rates_and_headroom(data_file):
    from trex.data.bench import bench_data

    cfg = DataSection(paths=[str(data_file)], tokenizer="compact", seq_len=SEQ, micro_batch_size=2)
    result = bench_data(cfg, TOK, n_batches=30)  # more than one epoch
    report = result.report(step_tokens_per_s=result.iter_tokens_per_s / 4)
    assert report["headroom"] == pytest.approx(4.0)
    assert result.build_tokens_per_s > 0 and result.summary["documents"] == 120
