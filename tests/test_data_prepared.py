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
from trex.data.prepared import FILES, FORMAT_VERSION, WORKER_BYTES, auto_workers, content_key, ensure, identity, open_prepared, prepare
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


def _data_file(tmp_path: Path, monkeypatch, records: int) -> DataSection:
    """``records`` generated records in one JSONL file, with a cache of the test's own."""
    monkeypatch.setenv("TREX_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "train.jsonl"
    write_jsonl(path, _records(records))
    return DataSection(paths=[str(path)], tokenizer="compact", seq_len=96, micro_batch_size=2)


@pytest.fixture()
def data(tmp_path, monkeypatch):
    return _data_file(tmp_path, monkeypatch, 300)


def test_rows_are_those_of_shuffling_then_next_fit_packing_in_memory(data):
    """The packing of runs before prepared data: documents shuffled with data.seed, then next-fit in
    that order. The prepared loader yields exactly those rows, under the same fingerprint."""
    data = dataclasses.replace(data, packing="next_fit")
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
    assert content_key(identity(dataclasses.replace(data, packing="next_fit"), TOK)) != key
    assert content_key(identity(dataclasses.replace(data, packing="best_fit"), TOK)) == key  # what auto packs
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
    with pytest.raises(PreparedDataError, match=f"format version 0; this trex reads version {FORMAT_VERSION}"):
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
    # rank 0 says it prepared, waited, or (when the other node was quicker) neither; rank 1 shows only
    # warnings. The lock itself is tested above; here: one entry, and rank 0 prepared at most once
    assert logs.count("preparing ") <= 1 and logs.count("waiting for another process") <= 1, logs[-3000:]
    entries = [p for p in (tmp_path / "cache" / "data").iterdir() if not p.name.endswith(".lock")]
    assert len(entries) == 1 and (entries[0] / "manifest.json").is_file()
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps_completed"] == 3 and summary["data"]["prepared"] == str(entries[0])


# ---- stale inputs: what the key sees, what the stamps catch (docs/data.md#what-the-key-sees) ----------
def _edit_keeping_size_mtime_and_samples(path: Path) -> None:
    """Change bytes that no sampled block covers, keep the size, then put the mtime back (as an editor
    followed by `touch -d` does; cp -p and rsync -a of an edited copy give the same file)."""
    from trex.data.prepared import SAMPLE_BLOCKS, SAMPLE_BYTES

    st = path.stat()
    raw = bytearray(path.read_bytes())
    span = (st.st_size - SAMPLE_BYTES) // (SAMPLE_BLOCKS - 1)
    assert span > 2 * SAMPLE_BYTES, "the file is too small to edit between sampled blocks"
    at = raw.index(b"xxx", SAMPLE_BYTES + 16)  # inside the first gap: a query of x's...
    assert at + 3 < span
    raw[at:at + 3] = b"yyy"  # ...becomes y's: the same size, other tokens
    path.write_bytes(bytes(raw))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


@pytest.fixture()
def big(tmp_path, monkeypatch):
    """A data file of ~200 KB: wide gaps between the sampled blocks."""
    return _data_file(tmp_path, monkeypatch, 4000)


def test_an_edit_with_its_mtime_put_back_is_never_a_stale_hit(big, caplog):
    path, manifest, here = ensure(big, TOK)
    tokens = (path / FILES["tokens"][0]).read_bytes()
    key = manifest["key"]
    _edit_keeping_size_mtime_and_samples(Path(big.paths[0]))
    assert content_key(identity(big, TOK)) == key  # the sampled key cannot see it...
    with caplog.at_level("WARNING", logger="trex"):
        again, manifest2, here = ensure(big, TOK)
    assert here and again == path  # ...the stamps can: prepared again, loudly
    assert "changed since it was prepared" in caplog.text and big.paths[0] in caplog.text
    assert (path / FILES["tokens"][0]).read_bytes() != tokens
    assert manifest2["stamps"][str(Path(big.paths[0]).resolve())]["digest"] != manifest["stamps"][
        str(Path(big.paths[0]).resolve())]["digest"]
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".")]  # the old entry is gone


def test_a_rewrite_with_the_same_content_is_hashed_once_then_a_stat(big, monkeypatch):
    import trex.data.prepared as prepared

    path, manifest, _ = ensure(big, TOK)
    src = Path(big.paths[0])
    copy = src.with_suffix(".copy")
    subprocess.run(["cp", "-p", str(src), str(copy)], check=True)
    os.replace(copy, src)  # what rsync -a does: a new inode, the mtime kept
    hashed = []
    real = prepared.content_digest
    monkeypatch.setattr(prepared, "content_digest", lambda p, *a: hashed.append(p) or real(p, *a))
    again, _, here = ensure(big, TOK)
    assert again == path and not here and len(hashed) == 1  # verified by content, not prepared again
    assert (path / prepared.VERIFIED_FILE).is_file()
    os.chmod(src, 0o600)  # a change time of its own
    os.chmod(src, 0o644)
    hashed.clear()
    assert not ensure(big, TOK)[2] and len(hashed) == 1
    hashed.clear()
    assert not ensure(big, TOK)[2] and hashed == []  # recorded: the next start is a stat


def test_data_prepared_refuses_a_stale_copy_with_a_fix_that_works(big, tmp_path):
    out = tmp_path / "prep"
    recipe = tmp_path / "recipe.toml"
    recipe.write_text(f'[data]\npaths = ["{big.paths[0]}"]\ntokenizer = "compact"\nseq_len = 96\n'
                      f'prepared = "{out}"\n[train]\nsteps = 1\nprogress = false\n[fidelity]\nevery = 0\n'
                      f'[model]\npreset = "tiny"\n')
    assert trex(["data", "prepare", str(recipe), "--workers", "1", "--out", str(out)]).returncode == 0
    _edit_keeping_size_mtime_and_samples(Path(big.paths[0]))
    with pytest.raises(PreparedDataError, match="changed since it was prepared"):
        build_loader(dataclasses.replace(big, prepared=str(out)), 0, 1, TOK)
    # the mismatch names the command that fixes it, with this train's recipe and --set options
    run = trex(["train", str(recipe), "--out", str(tmp_path / "run"), "--set", "data.seq_len=128"])
    assert run.returncode == 2 and run.stderr.count("trex train:") == 1 and "Traceback" not in run.stderr, run.stderr
    assert "data.seq_len = 96; the recipe has 128" in run.stderr
    fix = run.stderr.split("prepare it again: ")[1].split(", or unset")[0]
    assert fix == f"trex data prepare {recipe} --set data.seq_len=128 --out {out} --refresh"
    import shlex

    assert trex(shlex.split(fix)[1:] + ["--workers", "1"]).returncode == 0  # works as written
    assert json.loads((out / "manifest.json").read_text())["options"]["seq_len"] == 128
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".prep")]  # nothing left beside it


def test_refresh_prepares_again_and_unusable_places_name_their_option(data, tmp_path, monkeypatch):
    recipe = tmp_path / "recipe.toml"
    recipe.write_text(f'[data]\npaths = ["{data.paths[0]}"]\ntokenizer = "compact"\nseq_len = 96\n')
    run = lambda *a: trex(["data", "prepare", str(recipe), "--workers", "1", *a])
    assert run().stdout.startswith("prepared ")
    assert run().stdout.startswith("already prepared ")
    assert run("--refresh").stdout.startswith("prepared ")
    out = tmp_path / "mine"
    assert run("--out", str(out)).returncode == 0
    exists = run("--out", str(out))
    assert exists.returncode == 2 and "add --refresh" in exists.stderr
    assert run("--out", str(out), "--refresh").returncode == 0 and (out / "manifest.json").is_file()
    blocked = tmp_path / "a_file"
    blocked.write_text("")
    bad_out = run("--out", str(blocked / "prep"))
    assert bad_out.returncode == 2 and bad_out.stderr.startswith(f"trex data prepare: --out {blocked / 'prep'}")
    assert ".tmp-" not in bad_out.stderr and "Traceback" not in bad_out.stderr
    monkeypatch.setenv("TREX_CACHE_DIR", str(blocked))
    bad_cache = trex(["data", "prepare", str(recipe), "--workers", "1"], env={"TREX_CACHE_DIR": str(blocked)})
    assert bad_cache.returncode == 2 and f"TREX_CACHE_DIR = {blocked}" in bad_cache.stderr, bad_cache.stderr


# ---- best-fit by default, a resumed run keeps its packing ---------------------------------------------
def test_new_runs_pack_best_fit_and_a_resumed_run_keeps_what_it_recorded(data, tmp_path):
    from trex.recipe import to_dict
    from trex.train.config import TrainRecipe
    from trex.train.loop import keep_recorded_packing

    recipe = TrainRecipe(data=data)
    recipe.train.out = str(tmp_path / "run")
    assert keep_recorded_packing(recipe).data.packing == "best_fit"  # a new run
    os.makedirs(recipe.train.out)
    old = to_dict(recipe)
    old["data"]["packing"] = "next_fit"  # what a run before best_fit became the default saved
    import tomli_w

    (tmp_path / "run" / "config.toml").write_text(tomli_w.dumps(old))
    recipe.checkpoint.resume = "auto"
    assert keep_recorded_packing(recipe).data.packing == "next_fit"
    recipe.checkpoint.resume = ""
    assert keep_recorded_packing(recipe).data.packing == "best_fit"  # not resuming: a new run
    recipe.data.packing = "next_fit"
    assert keep_recorded_packing(recipe).data.packing == "next_fit"  # said in the recipe: kept
