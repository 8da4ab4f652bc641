"""Prepared data (trex.data.prepared): the same rows as packing in memory, whatever the worker count;
a content key that never gives a stale hit; nothing half-written (kill -9, a full disk); clean errors
for damaged or mismatched directories; best-fit packing; the inputs users have (HF datasets' Arrow,
ShareGPT, prompt/response); `trex data prepare`; one preparer for two nodes."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from trex_run import trex

from trex.data import DataSection, PreparedDataError, build_loader, compact_tokenizer
from trex.data.documents import build_documents
from trex.data.packing import PackedRows, pack, pack_best_fit
from trex.data.prepared import FILES, WORKER_BYTES, auto_workers, content_key, ensure, identity, open_prepared, prepare
from trex.data.records import BadRecordPolicy, write_jsonl

TOK = compact_tokenizer()
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _records(n: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        q = "x" * int(rng.integers(1, 20))
        out.append({"messages": [{"role": "user", "content": f"{i}:{q}"},
                                 {"role": "assistant", "content": q[::-1] * int(rng.integers(1, 3))}]})
    return out


@pytest.fixture()
def data(tmp_path, monkeypatch):
    monkeypatch.setenv("TREX_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "train.jsonl"
    write_jsonl(path, _records(300))
    return DataSection(paths=[str(path)], tokenizer="compact", seq_len=96, micro_batch_size=2)


def test_rows_are_those_of_shuffling_then_next_fit_packing_in_memory(data):
    """The packing of runs before prepared data: documents shuffled with data.seed, then next-fit in
    that order. The prepared loader yields exactly those rows, under the same fingerprint."""
    docs = build_documents(data, TOK, BadRecordPolicy("fail"))
    order = np.random.default_rng(data.seed).permutation(len(docs))
    lengths = docs.lengths[order]
    bounds = pack(lengths, data.seq_len)
    loader = build_loader(data, 0, 1, TOK)
    assert loader.prepared and np.array_equal(loader.rows.order, order) and np.array_equal(loader.rows.bounds, bounds)
    ids, _, _ = loader.rows.rows(np.arange(len(loader.rows)))
    for r in range(len(bounds) - 1):
        want = np.concatenate([docs.tokens[docs.offsets[d]:docs.offsets[d + 1]] for d in order[bounds[r]:bounds[r + 1]]])
        assert ids[r, :len(want)].tolist() == want.tolist()
    assert loader.fingerprint == PackedRows(docs, order, bounds, data.seq_len, TOK.pad_id).fingerprint


def test_any_worker_count_writes_the_same_bytes(data, tmp_path):
    data = dataclasses.replace(data, encode_chunk=64, bad_record_policy="skip")
    with open(data.paths[0], "a") as f:
        f.write("{not json\n")  # a skip, counted the same way by any worker
    one = prepare(data, TOK, tmp_path / "one", workers=1)
    two = prepare(data, TOK, tmp_path / "two", workers=2)
    for file, _ in FILES.values():
        assert (tmp_path / "one" / file).read_bytes() == (tmp_path / "two" / file).read_bytes(), file
    assert one["counts"] == two["counts"] and one["skips"] == two["skips"] and one["skips"]["skipped"] == 1


def test_a_start_that_must_prepare_picks_workers_by_input_size(data, monkeypatch):
    """data.prepare_workers = 0: one worker per WORKER_BYTES of input, at most the cores this process may
    use; the tiny set gets one (no pool to start); the manifest records the count used."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    assert [auto_workers(n) for n in (0, WORKER_BYTES - 1, WORKER_BYTES, 2 * WORKER_BYTES, 100 * WORKER_BYTES)] == [1, 1, 2, 3, 4]
    loader = build_loader(data, 0, 1, TOK)
    assert json.loads((Path(loader.prepared) / "manifest.json").read_text())["prepared"]["workers"] == 1
    with pytest.raises(ValueError, match="data.prepare_workers = -1"):
        dataclasses.replace(data, prepare_workers=-1)


def test_progress_reaches_every_input_whatever_its_format(data, tmp_path):
    """The ETA is measured in input bytes: a JSONL line counts its length, a Parquet or Arrow row its
    share of its file, so the progress of JSONL + Parquet + Arrow inputs ends at their total size."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.Table.from_pylist(_records(100, seed=1))
    pq.write_table(table, tmp_path / "part.parquet", row_group_size=30)
    with pa.OSFile(str(tmp_path / "part.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table, max_chunksize=30)
    paths = [data.paths[0], str(tmp_path / "part.parquet"), str(tmp_path / "part.arrow")]
    seen = []
    prepare(dataclasses.replace(data, paths=paths, encode_chunk=40), TOK, tmp_path / "mixed",
            report=lambda p: seen.append((p.bytes, p.total_bytes, p.line())))
    total = sum(os.path.getsize(p) for p in paths)
    assert len(seen) == 13 and all(t == total for _, t, _ in seen)  # 300/40 + 100/40 + 100/40 chunks
    assert all(a < b for (a, _, _), (b, _, _) in zip(seen, seen[1:])) and seen[-1][0] == pytest.approx(total)
    assert all("ETA" in line for _, _, line in seen)


def test_the_cache_hits_and_any_change_is_a_new_key(data, tmp_path):
    path, manifest, here = ensure(data, TOK)
    assert here and (path / "manifest.json").is_file()
    again, _, here = ensure(data, TOK)
    assert again == path and not here  # the second start tokenizes nothing
    key = manifest["key"]
    assert content_key(identity(dataclasses.replace(data, seq_len=128), TOK)) != key
    assert content_key(identity(dataclasses.replace(data, packing="best_fit"), TOK)) != key
    assert content_key(identity(dataclasses.replace(data, micro_batch_size=4), TOK)) == key  # rows unchanged
    other_tok = json.loads(TOK.backend.to_str())
    vocab = other_tok["model"]["vocab"]
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]  # two ids swapped: other tokens
    from tokenizers import Tokenizer as HF
    from trex.data.tokenizer import Tokenizer
    assert content_key(identity(data, Tokenizer(HF.from_str(json.dumps(other_tok)), "other"))) != key
    with open(data.paths[0], "a") as f:  # a changed input file
        f.write(json.dumps(_records(1, seed=5)[0]) + "\n")
    changed, _, here = ensure(data, TOK)
    assert here and changed != path


def test_a_live_lock_makes_others_wait_and_a_dead_ones_lock_is_broken(data, tmp_path):
    import threading

    import trex.data.prepared as prepared

    root = tmp_path / "cache" / "data"
    root.mkdir(parents=True)
    key = content_key(identity(data, TOK))
    lock = root / f"{key}.lock"
    lock.write_text(f"{prepared.socket.gethostname()} {os.getpid()}\n")  # a live preparer: this process
    got = []
    waiter = threading.Thread(target=lambda: got.append(ensure(data, TOK, poll_s=0.05)))
    waiter.start()
    time.sleep(0.5)
    assert waiter.is_alive() and not (root / key).exists()  # it waits while the lock lives
    lock.unlink()  # the preparer went away without publishing: the waiter takes over
    waiter.join(60)
    assert got and got[0][2] and (root / key / "manifest.json").is_file()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    other = dataclasses.replace(data, seed=1)
    (root / f"{content_key(identity(other, TOK))}.lock").write_text(
        f"{prepared.socket.gethostname()} {dead.stdout.strip()}\n")  # a process of this host that has ended
    start = time.time()
    assert ensure(other, TOK)[2] and time.time() - start < prepared.LOCK_STALE_S / 4


def test_a_prepared_directory_that_does_not_fit_is_one_clear_error(data, tmp_path):
    out = tmp_path / "prep"
    prepare(data, TOK, out)
    build_loader(dataclasses.replace(data, prepared=str(out)), 0, 1, TOK)  # it fits
    with pytest.raises(PreparedDataError, match=r"data.seq_len = 96; the recipe has 128"):
        build_loader(dataclasses.replace(data, prepared=str(out), seq_len=128), 0, 1, TOK)
    moved = dataclasses.replace(data, prepared=str(out), paths=[str(tmp_path / "elsewhere.jsonl")])
    assert build_loader(moved, 0, 1, TOK).prepared == str(out)  # shipped without its raw data: the manifest speaks
    tokens = out / FILES["tokens"][0]
    tokens.write_bytes(tokens.read_bytes()[:-8])
    with pytest.raises(PreparedDataError, match=r"tokens.i32: \d+ bytes; the manifest expects \d+ bytes .* truncated"):
        open_prepared(out, TOK.pad_id)
    manifest = json.loads((out / "manifest.json").read_text())
    (out / "manifest.json").write_text(json.dumps({**manifest, "format_version": 0}))
    with pytest.raises(PreparedDataError, match="format version 0; this trex reads version 1"):
        open_prepared(out, TOK.pad_id)
    with pytest.raises(PreparedDataError, match="not a prepared data directory"):
        open_prepared(tmp_path, TOK.pad_id)


def test_a_full_disk_leaves_nothing_and_says_so(data, tmp_path, monkeypatch):
    import builtins

    import trex.data.prepared as prepared

    class Full:
        def __init__(self, f):
            self.f = f

        def write(self, b):
            raise OSError(errno.ENOSPC, "No space left on device")

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    monkeypatch.setattr(prepared, "open", lambda p, mode="r": Full(builtins.open(p, mode)), raising=False)
    with pytest.raises(OSError, match="no space left while preparing data"):
        ensure(data, TOK)
    cache = tmp_path / "cache" / "data"
    assert [p.name for p in cache.iterdir()] == []  # no directory, no temporary one, no lock


def test_kill_9_during_prepare_leaves_nothing_that_trains_and_a_rerun_prepares(tmp_path):
    path = tmp_path / "big.jsonl"
    write_jsonl(path, _records(20000))
    recipe = tmp_path / "recipe.toml"
    recipe.write_text(f'[data]\npaths = ["{path}"]\ntokenizer = "compact"\nseq_len = 96\nencode_chunk = 256\n')
    env = {**os.environ, "TREX_CACHE_DIR": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "trex", "data", "prepare", str(recipe), "--workers", "1"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    cache = tmp_path / "cache" / "data"
    deadline = time.time() + 120
    while not (cache.is_dir() and any(p.name.startswith(".") and p.name.endswith(f"-{proc.pid}")
                                      for p in cache.iterdir())):
        assert proc.poll() is None and time.time() < deadline, "the prepare ended before it could be killed"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not any((p / "manifest.json").is_file() for p in cache.iterdir())  # nothing looks complete
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("prepared ") and "20,000 records" in done.stdout
    assert not any(p.name.startswith(".") for p in cache.iterdir())  # the killed one's temporary directory is gone


def test_best_fit_packs_a_long_tailed_chat_distribution_at_97_percent():
    rng = np.random.default_rng(0)
    for seq_len in (4096, 8192):
        lengths = np.minimum(rng.lognormal(np.log(600), 1.0, 50000).astype(np.int64) + 20, seq_len)
        perm, bounds = pack_best_fit(lengths, seq_len, 16384)
        assert sorted(perm.tolist()) == list(range(len(lengths)))  # every document once
        per_row = np.add.reduceat(lengths[perm], bounds[:-1])
        assert per_row.max() <= seq_len
        best = lengths.sum() / (len(per_row) * seq_len)
        next_fit = lengths.sum() / ((len(pack(lengths, seq_len)) - 1) * seq_len)
        assert best >= 0.97 > next_fit, (seq_len, best, next_fit)
        again = pack_best_fit(lengths, seq_len, 16384)
        assert np.array_equal(again[0], perm) and np.array_equal(again[1], bounds)  # deterministic


def test_best_fit_rows_train_and_report_their_efficiency(data):
    loader = build_loader(dataclasses.replace(data, packing="best_fit", pack_window=64), 0, 1, TOK)
    summary = loader.summary()
    assert summary["padding_share"] == pytest.approx(1 - summary["packing_efficiency"], abs=1e-4)
    ids, labels, doc_ids = loader.rows.rows(np.arange(len(loader.rows)))
    assert (ids[:, 0] == TOK.bos_id).all()
    assert sorted(loader.rows.order.tolist()) == list(range(summary["documents"]))


def test_hf_datasets_arrow_sharegpt_and_prompt_response_read_as_messages(data, tmp_path):
    import pyarrow as pa

    messages = _records(20)
    base = build_documents(dataclasses.replace(data, paths=data.paths), TOK, BadRecordPolicy("fail"))
    sharegpt = [{"conversations": [{"from": "human" if m["role"] == "user" else "gpt", "value": m["content"]}
                                   for m in r["messages"]]} for r in messages]
    pairs = [{"prompt": r["messages"][0]["content"], "response": r["messages"][1]["content"]} for r in messages]
    write_jsonl(tmp_path / "msgs.jsonl", messages)
    write_jsonl(tmp_path / "pairs.jsonl", pairs)
    hf = tmp_path / "hf_dataset"  # the layout of datasets' save_to_disk: Arrow IPC streams listed in state.json
    hf.mkdir()
    table = pa.Table.from_pylist(sharegpt)
    with pa.OSFile(str(hf / "data-00000-of-00001.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
        for batch in table.to_batches(max_chunksize=7):
            w.write_batch(batch)
    (hf / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}))
    (hf / "dataset_info.json").write_text("{}")
    got = {}
    for name, paths in (("messages", [tmp_path / "msgs.jsonl"]), ("pairs", [tmp_path / "pairs.jsonl"]),
                        ("hf sharegpt", [hf])):
        docs = build_documents(dataclasses.replace(data, paths=[str(p) for p in paths]), TOK, BadRecordPolicy("fail"))
        got[name] = (docs.tokens.tolist(), docs.loss_mask.tolist())
    assert got["messages"] == got["pairs"] == got["hf sharegpt"]
    assert len(got["messages"][0]) < len(base.tokens)  # 20 of the 300 records


def test_the_cli_prepares_once_and_says_what_it_made(data, tmp_path):
    recipe = tmp_path / "recipe.toml"
    recipe.write_text(f'[data]\npaths = ["{data.paths[0]}"]\ntokenizer = "compact"\nseq_len = 96\n')
    run = lambda *a: trex(["data", "prepare", str(recipe), *a])
    first = run("--workers", "1", "--set", 'data.packing="best_fit"')  # (more workers: the byte-equality test)
    assert first.returncode == 0, first.stderr
    assert first.stdout.startswith("prepared ") and "best_fit packing" in first.stdout and "300 records" in first.stdout
    again = run("--workers", "1", "--set", 'data.packing="best_fit"', "--format", "json")
    assert json.loads(again.stdout)["prepared_here"] is False
    out = tmp_path / "mine"
    assert run("--workers", "1", "--out", str(out)).returncode == 0 and (out / "manifest.json").is_file()
    exists = run("--workers", "1", "--out", str(out))
    assert exists.returncode == 2 and exists.stderr.count("\n") == 1 and "exists" in exists.stderr
    missing = run("--workers", "1", "--set", 'data.paths=["nope.jsonl"]')
    assert missing.returncode == 2 and "nope.jsonl" in missing.stderr and "Traceback" not in missing.stderr


@pytest.mark.slow
def test_two_nodes_prepare_once_and_train(tmp_path):
    """Two torchrun agents (--nnodes 2, c10d rendezvous on 127.0.0.1), one process each, sharing a cache
    directory as a shared file system would: one process prepares, the other waits, both train."""
    from test_distributed import _free_port

    write_jsonl(tmp_path / "train.jsonl", _records(400))
    (tmp_path / "recipe.toml").write_text("# everything set on the command line\n")
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TREX_DEVICE": "cpu", "TREX_CACHE_DIR": str(tmp_path / "cache")}
    agents = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "1",
         "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "two-nodes",
         "-m", "trex", "train", str(tmp_path / "recipe.toml"), "--out", str(tmp_path / "run"),
         "--set", f'data.paths=["{tmp_path}/train.jsonl"]', "--set", 'data.tokenizer="compact"',
         "--set", "data.seq_len=96", "--set", "train.steps=3", "--set", "train.progress=false",
         "--set", "fidelity.every=0", "--set", "parallel.dp_shard=2"],
        env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for node in (0, 1)]
    outs = [a.communicate(timeout=400) for a in agents]
    assert [a.returncode for a in agents] == [0, 0], [o[1][-6000:] for o in outs]
    logs = outs[0][1] + outs[1][1]
    assert logs.count("preparing ") == 1, logs[-3000:]  # one process prepared for both nodes
    entries = [p for p in (tmp_path / "cache" / "data").iterdir() if not p.name.endswith(".lock")]
    assert len(entries) == 1 and (entries[0] / "manifest.json").is_file()
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps_completed"] == 3 and summary["data"]["prepared"] == str(entries[0])
