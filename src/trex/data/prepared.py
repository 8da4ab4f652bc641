"""Prepared data: a recipe's records read, validated, rendered, tokenized and packed once, into files
that every rank memory-maps.

    trex data prepare RECIPE [--set ...] [--workers N] [--out DIR]
    trex train RECIPE        # data.prepared = DIR, or the cache entry of the data's content key

A prepared directory holds raw little-endian arrays and a manifest:

    tokens.i32        int32  [T]    document tokens back to back, documents in file order
    loss_mask.u8      uint8  [T]    1 where the token is a training target
    doc_offsets.i64   int64  [N+1]  document i is tokens[doc_offsets[i]:doc_offsets[i+1]]
    order.i64         int64  [N]    the documents in packing order (data.seed's shuffle, then the packer's)
    bounds.i64        int64  [R+1]  row r holds documents order[bounds[r]:bounds[r+1]]
    manifest.json     format version, content key, inputs, tokenizer, options, counts, skips by reason,
                      packing (algorithm, efficiency), every file's dtype, count and size

5 bytes per token and 24 per document. Plain arrays rather than Arrow: a row is a handful of
``np.memmap`` slices (no per-access decoding), the pages are the page cache's, shared by the ranks of
a node, and opening reads only the manifest (bench/data_pipeline.py measures both).

The content key hashes the format version, the inputs (path, size, mtime and a sampled digest of each
file), the tokenizer (a digest of its serialised form), every data option that changes tokens or
rows, and the packing algorithm; a change to any of them is a new key. Beside the key the manifest
records each input's stamp (inode and change time, which no tool can put back: ``cp -p`` and
``rsync -a`` write a new inode, ``touch`` sets the change time to now) and a digest of its whole
content, read once while preparing. A hit whose stamps differ is hashed in full before it is used:
equal content is recorded as verified (``verified.json``) and used, changed content is prepared
again (the cache) or refused (``data.prepared``). A directory is written under a temporary name and
renamed when complete, so a killed prepare leaves nothing that trains; ``ensure`` lets one process
per cache directory prepare or verify (a lock file it keeps fresh) while the others wait on the
file system, outside any collective.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import socket
import time
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from trex import atomic
from trex.data.config import DataSection
from trex.data.documents import Documents, EncodedChunk, account, encode_chunk, record_chunks
from trex.data.packing import PackedRows, plan_rows
from trex.data.records import BadRecordPolicy, SkipCounter, resolve_paths
from trex.data.tokenizer import Tokenizer

log = logging.getLogger(__name__)

FORMAT_VERSION = 2  # 2: inputs' stamps and content digests (version 1 could not tell a restored mtime)
FILES = {  # name -> (file, dtype)
    "tokens": ("tokens.i32", np.dtype("<i4")), "loss_mask": ("loss_mask.u8", np.dtype("u1")),
    "doc_offsets": ("doc_offsets.i64", np.dtype("<i8")), "order": ("order.i64", np.dtype("<i8")),
    "bounds": ("bounds.i64", np.dtype("<i8")),
}
# the options of [data] that change the tokens or the rows (micro_batch_size and encode_chunk do not)
KEYED_OPTIONS = ("format", "mode", "chat_format", "messages_field", "text_field", "thinking", "drop_thinking", "loss_on",
                 "bad_record_policy", "seq_len", "seed", "shuffle", "packing", "pack_window")
WORKER_BYTES = 32 << 20  # automatic workers: one per this much input
LOCK_STALE_S = 120.0  # a lock not refreshed for this long belongs to a process that died
SAMPLE_BLOCKS, SAMPLE_BYTES = 16, 1 << 12  # 64 KiB read per input file to key it
HASH_BLOCK = 8 << 20  # bytes read at a time when an input is hashed whole
VERIFIED_FILE = "verified.json"  # stamps whose content was hashed equal to the prepared one after it


class PreparedDataError(ValueError):
    """A prepared directory that cannot be used: names the file and what was expected. ``refresh`` is
    the directory to prepare again (``trex data prepare RECIPE --out DIR --refresh``), if that fixes it."""

    def __init__(self, message: str, refresh: str = ""):
        self.detail, self.refresh = message, refresh
        super().__init__(message + (f"; prepare it again (trex data prepare RECIPE --out {refresh} --refresh, with "
                                    f"the recipe and --set options you train with) or unset data.prepared"
                                    if refresh else ""))


# ---- the content key ------------------------------------------------------------------------------------
def file_identity(path: Path) -> dict:
    """Path, size, mtime and a digest of SAMPLE_BLOCKS evenly spaced blocks (first and last included):
    constant time whatever the file's size, so a start never reads the whole data set to key it."""
    st = path.stat()
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        for k in range(SAMPLE_BLOCKS):
            f.seek(max(0, st.st_size - SAMPLE_BYTES) * k // (SAMPLE_BLOCKS - 1))
            h.update(f.read(SAMPLE_BYTES))
    return {"path": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "sample_digest": h.hexdigest()}


def file_stamp(path: Path) -> dict:
    """What a rewrite of ``path`` cannot keep: its inode and device (a copy or rsync writes a new file)
    and change time (set to now by every write, chmod or touch, which is how an mtime is put back)."""
    st = path.stat()
    return {"inode": st.st_ino, "device": st.st_dev, "ctime_ns": st.st_ctime_ns}


def content_digest(path: Path, keep_alive: Callable[[], None] | None = None) -> str:
    """blake2b of the whole file, HASH_BLOCK bytes at a time (memory stays at one block); ``keep_alive``
    is called every 128 blocks (1 GiB: a lock's owner refreshes it)."""
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        for n, block in enumerate(iter(lambda: f.read(HASH_BLOCK), b"")):
            h.update(block)
            if keep_alive and n % 128 == 127:
                keep_alive()
    return h.hexdigest()


def identity(cfg: DataSection, tokenizer: Tokenizer, inputs: list[dict] | None = None) -> dict:
    """What the key is made of: format version, inputs (read from ``cfg.paths`` unless given), tokenizer,
    options."""
    if inputs is None:
        inputs = [{**file_identity(p), "format": kind} for p, kind in resolve_paths(cfg.paths, cfg.format)]
    tok = hashlib.blake2b(tokenizer.backend.to_str().encode(), digest_size=16).hexdigest()
    return {"format_version": FORMAT_VERSION, "inputs": inputs, "tokenizer": {"source": tokenizer.source, "digest": tok},
            "options": {k: cfg.packing_algorithm if k == "packing" else getattr(cfg, k) for k in KEYED_OPTIONS
                        if k != "chat_format" or cfg.chat_format != "deepseek-v4"}}  # V4 data keeps its old key


def input_stamps(ident: dict, digest: bool = False, keep_alive: Callable[[], None] | None = None) -> dict:
    """{path: stamp} of the identity's inputs (and each one's content digest when ``digest``)."""
    return {i["path"]: {**file_stamp(Path(i["path"])),
                        **({"digest": content_digest(Path(i["path"]), keep_alive)} if digest else {})}
            for i in ident["inputs"]}


def content_key(ident: dict) -> str:
    return hashlib.blake2b(json.dumps(ident, sort_keys=True).encode(), digest_size=12).hexdigest()


def describe_mismatch(want: dict, have: dict) -> str:
    """The first difference between the identity the recipe asks for and a manifest's."""
    if have.get("format_version") != want["format_version"]:
        return f"format version {have.get('format_version')}; this trex reads {want['format_version']}"
    for k, v in want["options"].items():
        if have.get("options", {}).get(k) != v:
            return f"data.{k} = {have.get('options', {}).get(k)!r}; the recipe has {v!r}"
    if have.get("tokenizer", {}).get("digest") != want["tokenizer"]["digest"]:
        return f"tokenizer {have.get('tokenizer', {}).get('source')!r}; the recipe's ({want['tokenizer']['source']}) differs"
    old = {i["path"]: i for i in have.get("inputs", [])}
    for i in want["inputs"]:
        if i["path"] not in old:
            return f"no input {i['path']}"
        if old.pop(i["path"]) != i:
            return f"input {i['path']} has changed since (size, mtime or content)"
    return f"inputs {sorted(old)} are not in the recipe" if old else "a different key"


# ---- writing ------------------------------------------------------------------------------------------
_WORKER: tuple | None = None


def _init_worker(tokenizer_json: str, source: str, cfg: DataSection) -> None:
    global _WORKER
    os.environ["RAYON_NUM_THREADS"] = "1"  # one core per worker: the workers are the parallelism
    from tokenizers import Tokenizer as HFTokenizer

    _WORKER = (Tokenizer(HFTokenizer.from_str(tokenizer_json), source), cfg)


def _encode_in_worker(records) -> EncodedChunk:
    tokenizer, cfg = _WORKER
    return encode_chunk(records, cfg, tokenizer)


def encoded_chunks(cfg: DataSection, tokenizer: Tokenizer, counter: SkipCounter, workers: int) -> Iterator[EncodedChunk]:
    """Every chunk of ``cfg.encode_chunk`` records, encoded, in file order: by this process
    (``workers`` <= 1) or by a pool with at most 2 chunks per worker in flight (bounded memory). The
    result does not depend on ``workers``."""
    chunks = record_chunks(cfg, counter)
    if workers <= 1:
        for chunk in chunks:
            yield encode_chunk(chunk, cfg, tokenizer)
        return
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")  # the tokenizer's threads do not survive a fork
    with ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker,
                             initargs=(tokenizer.backend.to_str(), tokenizer.source, cfg)) as pool:
        window: deque = deque()
        for chunk in chunks:
            window.append(pool.submit(_encode_in_worker, chunk))
            if len(window) >= 2 * workers:
                yield window.popleft().result()
        while window:
            yield window.popleft().result()


@dataclass
class Progress:
    """Records, documents, tokens and input bytes so far; ``report`` is called with it after each chunk."""
    total_bytes: int  # of every input file (what the ETA is measured against; a table row is its share)
    records: int = 0
    documents: int = 0
    tokens: int = 0
    bytes: float = 0.0
    started: float = 0.0

    def line(self) -> str:
        dt = max(1e-9, time.perf_counter() - self.started)
        eta = (f", ETA {_duration(dt * (self.total_bytes - self.bytes) / self.bytes)}"
               if self.bytes and self.total_bytes else "")
        return (f"{self.records:,} records, {self.tokens / 1e6:,.1f}M tokens: {self.records / dt:,.0f} records/s, "
                f"{self.tokens / dt / 1e6:,.2f}M tokens/s{eta}")


def every(seconds: float, emit: Callable[[str], None]) -> Callable[[Progress], None]:
    """A progress report that calls ``emit`` with the progress line at most once per ``seconds``."""
    last = [time.perf_counter()]

    def report(progress: Progress) -> None:
        if time.perf_counter() - last[0] >= seconds:
            last[0] = time.perf_counter()
            emit(progress.line())
    return report


def auto_workers(input_bytes: int) -> int:
    """Workers for ``input_bytes`` of input: one per WORKER_BYTES, at most the cores this process may use."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(cores, 1 + input_bytes // WORKER_BYTES))


def _duration(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    return f"{m // 60}h{m % 60:02d}m" if m >= 60 else f"{m}m{s:02d}s"


def write_prepared(cfg: DataSection, tokenizer: Tokenizer, ident: dict, dest: Path, workers: int = 1,
                   report: Callable[[Progress], None] | None = None,
                   keep_alive: Callable[[], None] | None = None) -> dict:
    """Prepare ``cfg``'s data into the new directory ``dest`` (its parent must exist) with ``workers``
    processes (0: :func:`auto_workers`); returns the manifest. Bad records go through
    ``cfg.bad_record_policy`` (under ``fail``: BadRecordError, file and line). Memory holds a few chunks
    and the document lengths (8 bytes a document)."""
    policy = BadRecordPolicy(cfg.bad_record_policy)
    dest.mkdir()
    stamps = input_stamps(ident, digest=True, keep_alive=keep_alive)  # read once more: ~2% of tokenizing
    total = sum(i["size"] for i in ident["inputs"])
    workers = workers or auto_workers(total)
    progress = Progress(total_bytes=total, started=time.perf_counter())
    n_docs, n_tokens, loss_tokens = 0, 0, 0
    lengths: list[np.ndarray] = []
    names = {k: dest / FILES[k][0] for k in FILES}
    with open(names["tokens"], "wb") as tok_f, open(names["loss_mask"], "wb") as mask_f, \
            open(names["doc_offsets"], "wb") as off_f:
        off_f.write(np.zeros(1, FILES["doc_offsets"][1]).tobytes())
        for chunk in encoded_chunks(cfg, tokenizer, policy.counter, workers):
            account(chunk, policy)
            tok_f.write(chunk.tokens.astype(FILES["tokens"][1], copy=False).tobytes())
            mask_f.write(chunk.loss_mask.astype(FILES["loss_mask"][1], copy=False).tobytes())
            off_f.write((n_tokens + np.cumsum(chunk.lengths)).astype(FILES["doc_offsets"][1]).tobytes())
            lengths.append(chunk.lengths)
            n_docs += len(chunk.lengths)
            n_tokens += int(chunk.lengths.sum())
            loss_tokens += int(chunk.loss_mask.sum())
            progress.records, progress.documents, progress.tokens = policy.records_read, n_docs, n_tokens
            progress.bytes += chunk.n_bytes
            if report:
                report(progress)
        for f in (tok_f, mask_f, off_f):
            f.flush()
            os.fsync(f.fileno())
    if not n_docs:
        raise ValueError(f"no usable documents in {cfg.paths} ({policy.records_read} records read; "
                         f"skipped: {policy.counter.as_dict()['skipped_by_reason']})")
    all_lengths = np.concatenate(lengths)
    order, bounds = plan_rows(all_lengths, cfg)
    for name, arr in (("order", order), ("bounds", bounds)):
        with open(names[name], "wb") as f:
            f.write(arr.astype(FILES[name][1]).tobytes())
            f.flush()
            os.fsync(f.fileno())
    if input_stamps(ident) != {p: {k: v for k, v in st.items() if k != "digest"} for p, st in stamps.items()}:
        raise PreparedDataError(f"{cfg.paths}: an input file changed while it was being prepared; prepare again "
                                f"once nothing writes to it")
    rows = len(bounds) - 1
    counts = {"records_read": policy.records_read, "documents": n_docs, "tokens": n_tokens,
              "loss_tokens": loss_tokens, "rows": rows}
    efficiency = n_tokens / max(1, rows * cfg.seq_len)
    manifest = {
        **ident, "key": content_key(ident), "stamps": stamps, "counts": counts, "skips": policy.counter.as_dict(),
        "packing": {"algorithm": cfg.packing_algorithm, "window": cfg.pack_window, "seq_len": cfg.seq_len,
                    "efficiency": round(efficiency, 6), "padding_share": round(1 - efficiency, 6),
                    "fingerprint": PackedRows.fingerprint_of(all_lengths[order], bounds, cfg.seq_len)},
        "files": {k: {"file": f, "dtype": dt.str, "count": _count(k, counts),
                      "bytes": _count(k, counts) * dt.itemsize} for k, (f, dt) in FILES.items()},
        "prepared": {"seconds": round(time.perf_counter() - progress.started, 3), "workers": workers,
                     "host": socket.gethostname()},
    }
    atomic.write_json(dest / "manifest.json", manifest, fsync=True)
    return manifest


def _count(name: str, counts: dict) -> int:
    return {"tokens": counts["tokens"], "loss_mask": counts["tokens"], "doc_offsets": counts["documents"] + 1,
            "order": counts["documents"], "bounds": counts["rows"] + 1}[name]


def prepare(cfg: DataSection, tokenizer: Tokenizer, dest: Path, workers: int = 1,
            report: Callable[[Progress], None] | None = None, ident: dict | None = None,
            replace: bool = False, keep_alive: Callable[[], None] | None = None) -> dict:
    """Write ``dest`` whole or not at all: into ``dest``'s sibling temporary directory, renamed when
    complete; a failure (bad record, full disk, interrupt) removes the temporary directory. ``replace``:
    an existing ``dest`` is swapped for the new one only once that is complete. Returns the manifest
    (the existing one when another process published ``dest`` first)."""
    ident = ident or identity(cfg, tokenizer)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f".{dest.name}.tmp-{socket.gethostname()}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    try:
        manifest = write_prepared(cfg, tokenizer, ident, tmp, workers, report, keep_alive)
        if replace and dest.exists():
            _retire(dest)
        try:
            os.rename(tmp, dest)
        except OSError:
            if not (dest / "manifest.json").is_file():
                raise
            shutil.rmtree(tmp)  # published by another process meanwhile: the same key, the same data
            return read_manifest(dest)
        atomic.fsync_dir(dest.parent)
        return manifest
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(err, OSError) and err.errno == 28:  # ENOSPC
            raise OSError(28, f"no space left while preparing data (nothing was kept; free space or set "
                              f"data.cache_dir elsewhere)", str(dest)) from None
        raise


# ---- reading ------------------------------------------------------------------------------------------
def read_manifest(path: Path) -> dict:
    """The manifest of prepared directory ``path``, its format version checked."""
    file = path / "manifest.json"
    try:
        manifest = json.loads(file.read_text())
    except FileNotFoundError:
        raise PreparedDataError(f"{path}: not a prepared data directory (no manifest.json); expected the "
                                f"output of `trex data prepare`") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PreparedDataError(f"{file}: unreadable ({e}); prepare the data again") from None
    if not isinstance(manifest, dict) or manifest.get("format_version") != FORMAT_VERSION:
        version = manifest.get("format_version") if isinstance(manifest, dict) else None
        raise PreparedDataError(f"{file}: written by prepared-data format version {version}; this trex reads "
                                f"version {FORMAT_VERSION}: prepare the data again")
    return manifest


def open_prepared(path: Path, pad_id: int) -> tuple[PackedRows, dict]:
    """Memory-map prepared directory ``path``: its rows and manifest. Every file's size is checked
    against the manifest first (a truncated or missing file is an error naming it)."""
    manifest = read_manifest(path)
    arrays = {}
    for name, (fname, dtype) in FILES.items():
        spec = manifest["files"].get(name, {})
        file = path / fname
        size = file.stat().st_size if file.is_file() else None
        if size != spec.get("bytes") or spec.get("dtype") != dtype.str:
            found = "missing" if size is None else f"{size} bytes"
            raise PreparedDataError(f"{file}: {found}; the manifest expects {spec.get('bytes')} bytes of "
                                    f"{spec.get('dtype')} (a truncated or partial copy): prepare the data again")
        count = spec["count"]
        # a plain ndarray over the mapping: slices of an np.memmap are np.memmap objects, slower to make
        mapped = np.memmap(file, dtype=dtype, mode="r", shape=(count,)) if count else np.zeros(0, dtype)
        arrays[name] = np.asarray(mapped)
    docs = Documents(arrays["tokens"], arrays["loss_mask"], arrays["doc_offsets"], manifest["counts"]["records_read"])
    rows = PackedRows(docs, arrays["order"], arrays["bounds"], manifest["packing"]["seq_len"], pad_id,
                      fingerprint=manifest["packing"]["fingerprint"])
    return rows, manifest


def skips_of(manifest: dict) -> SkipCounter:
    """The manifest's skips as a SkipCounter (a cache hit reports what preparing left out)."""
    s = manifest["skips"]
    counter = SkipCounter(truncated=s["truncated"], first_seen=dict(s["first_seen"]))
    counter.skipped.update(s["skipped_by_reason"])
    counter.files_skipped.extend(s["files_skipped_first"][:s["files_skipped"]])
    return counter


# ---- stale inputs -------------------------------------------------------------------------------------
def _verified(path: Path) -> list[dict]:
    try:
        return json.loads((path / VERIFIED_FILE).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return []


def unverified_inputs(path: Path, manifest: dict, ident: dict) -> list[str]:
    """The inputs of ``ident`` whose stamp is neither the one prepared from nor one verified since (a
    constant-time stat each; empty when the raw data is not here and the manifest speaks for it)."""
    if ident["inputs"] is manifest.get("inputs"):
        return []
    known = [{p: {k: v for k, v in st.items() if k != "digest"} for p, st in manifest.get("stamps", {}).items()},
             *_verified(path)]
    now = input_stamps(ident)
    return [p for p, st in now.items() if not any(k.get(p) == st for k in known)]


def verify_inputs(path: Path, manifest: dict, ident: dict, inputs: list[str],
                  keep_alive: Callable[[], None] | None = None) -> list[str]:
    """Hash ``inputs`` whole against the digests prepared from; returns those whose content differs.
    Records the others' stamps as verified (atomically), so the next start is a stat again."""
    start, size = time.perf_counter(), sum(Path(p).stat().st_size for p in inputs)
    recorded = manifest.get("stamps", {})
    changed = [p for p in inputs if content_digest(Path(p), keep_alive) != recorded.get(p, {}).get("digest")]
    if not changed:
        now = input_stamps(ident)
        try:
            atomic.write_json(path / VERIFIED_FILE, [*_verified(path), {p: now[p] for p in inputs}])
        except OSError as e:  # a read-only copy: verified again at the next start
            log.info("%s: could not record the verification (%s)", path, e.strerror)
        log.info("%s: %d input file(s) rewritten since they were prepared (new inode or change time); their "
                 "content is unchanged (%.1f GB hashed in %.1fs)", path, len(inputs), size / 1e9,
                 time.perf_counter() - start)
    return changed


def stale_reason(changed: list[str]) -> str:
    return (f"{', '.join(changed)} changed since it was prepared, though its size, modification time and sampled "
            f"blocks did not (an edit with its mtime put back, as cp -p or rsync -a of an edited copy do)")


# ---- the cache and who prepares -----------------------------------------------------------------------
def cache_root(cfg: DataSection) -> Path:
    """data.cache_dir, else $TREX_CACHE_DIR/data, else ~/.cache/trex/data."""
    if cfg.cache_dir:
        return Path(os.path.expandvars(os.path.expanduser(cfg.cache_dir)))
    base = os.environ.get("TREX_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "trex")
    return Path(base) / "data"


def _dead_here(owner: str) -> bool:
    """Whether lock content ``owner`` ("host pid") names a process of this host that no longer runs."""
    host, _, pid = owner.strip().partition(" ")
    if host != socket.gethostname() or not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def _take_lock(lock: Path) -> bool:
    """Create ``lock`` (host and pid inside) unless a live one exists. A lock is a dead preparer's,
    and is broken, when its process no longer runs on this host, or when its mtime is older than
    LOCK_STALE_S (a preparer refreshes it after every chunk)."""
    try:
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        try:
            if _dead_here(lock.read_text()) or time.time() - lock.stat().st_mtime > LOCK_STALE_S:
                log.warning("%s: breaking a stale lock (%s)", lock, lock.read_text().strip())
                lock.unlink()
                return _take_lock(lock)
        except FileNotFoundError:
            return _take_lock(lock)
        return False
    with os.fdopen(fd, "w") as f:
        f.write(f"{socket.gethostname()} {os.getpid()}\n")
    return True


def ensure(cfg: DataSection, tokenizer: Tokenizer, workers: int = 1, poll_s: float = 0.5,
           report: Callable[[Progress], None] | None = None, level: int = logging.INFO,
           refresh: bool = False) -> tuple[Path, dict, bool]:
    """The prepared directory of ``cfg``: ``data.prepared`` (checked against the recipe), or the cache
    entry of its content key, prepared here, by ``workers`` processes (0: automatic), if no process has
    (returns path, manifest, prepared_here). ``refresh`` prepares the cache entry again whatever it holds.

    Every rank may call this at once: the first to take ``<key>.lock`` in the cache directory prepares,
    or hashes inputs whose stamps changed (refreshing the lock as it goes); the others wait for a
    published, verified directory on the file system. No collective is entered meanwhile, so a long
    prepare trips no collective timeout. On a shared file system that is one process for the whole
    job; with node-local cache directories, one per node. Preparing and waiting are logged at ``level``."""
    if cfg.prepared:
        return _use_prepared(cfg, tokenizer, poll_s)
    ident = identity(cfg, tokenizer)
    key = content_key(ident)
    root = cache_root(cfg)
    path, lock = root / key, root / f"{key}.lock"
    waited = False
    while True:
        manifest = _fresh(path, ident) if not refresh else None
        if manifest is not None:  # a read-only cache serves its entries: only a writer needs to write
            return path, manifest, False
        writable_dir(root, "data.cache_dir" if cfg.cache_dir else "TREX_CACHE_DIR"
                     if os.environ.get("TREX_CACHE_DIR") else "the data cache")
        if _take_lock(lock):
            try:
                manifest = _fresh(path, ident) if not refresh else None
                if manifest is not None:
                    return path, manifest, False
                if (path / "manifest.json").is_file():
                    if refresh:
                        log.log(level, "%s: preparing again (--refresh)", path)
                    else:
                        old = read_manifest(path)
                        changed = verify_inputs(path, old, ident, unverified_inputs(path, old, ident),
                                                lambda: os.utime(lock))
                        if not changed:
                            return path, old, False
                        log.warning("%s: preparing again", stale_reason(changed))
                    _retire(path)
                for left in root.glob(f".{key}.tmp-*"):  # a dead preparer's (the lock is ours)
                    shutil.rmtree(left, ignore_errors=True)

                def progress(p: Progress) -> None:
                    os.utime(lock)
                    if report:
                        report(p)
                log.log(level, "preparing %s into %s (once: later starts map it)", cfg.paths, path)
                return path, prepare(cfg, tokenizer, path, workers, progress, ident,
                                     keep_alive=lambda: os.utime(lock)), True
            finally:
                lock.unlink(missing_ok=True)
        if not waited:
            log.log(level, "waiting for another process to prepare %s (%s)", path, lock)
            waited = True
        time.sleep(poll_s)


def _fresh(path: Path, ident: dict) -> dict | None:
    """The manifest of ``path`` if it is published and every input's stamp is known; else None."""
    if not (path / "manifest.json").is_file():
        return None
    manifest = read_manifest(path)
    return None if unverified_inputs(path, manifest, ident) else manifest


def _retire(path: Path) -> None:
    """Take a published directory out of use: renamed aside first (a reader never sees half of it),
    then removed (ranks that still map its files keep them until they unmap)."""
    aside = path.parent / f".{path.name}.old-{socket.gethostname()}-{os.getpid()}"
    os.rename(path, aside)
    shutil.rmtree(aside, ignore_errors=True)


def _use_prepared(cfg: DataSection, tokenizer: Tokenizer, poll_s: float) -> tuple[Path, dict, bool]:
    """``data.prepared``: its manifest checked against the recipe, and its inputs, where they are here,
    against the content it was prepared from (hashed in full once when their stamps changed)."""
    path = Path(cfg.prepared)
    manifest = read_manifest(path)
    try:
        ident = identity(cfg, tokenizer)
    except FileNotFoundError:  # the raw data stayed where it was prepared: its manifest speaks for it
        log.info("data.prepared = %s: the inputs %s are not here; using the prepared copy as its manifest "
                 "describes them", cfg.prepared, cfg.paths)
        ident = identity(cfg, tokenizer, inputs=manifest["inputs"])
    if manifest.get("key") != content_key(ident):
        raise PreparedDataError(f"data.prepared = {cfg.prepared}: {path / 'manifest.json'} does not match the "
                                f"recipe: {describe_mismatch(ident, manifest)}", refresh=cfg.prepared)
    unverified = unverified_inputs(path, manifest, ident)
    if unverified:
        lock = path.parent / f".{path.name}.lock"
        try:
            owned = _take_lock(lock)
        except OSError:  # a read-only place: every process verifies by itself
            owned = True
            lock = None
        if not owned:
            while lock.exists() and unverified_inputs(path, manifest, ident):
                time.sleep(poll_s)
            return _use_prepared(cfg, tokenizer, poll_s)
        try:
            changed = verify_inputs(path, manifest, ident, unverified, lock and (lambda: os.utime(lock)))
        finally:
            if lock is not None:
                lock.unlink(missing_ok=True)
        if changed:
            raise PreparedDataError(f"data.prepared = {cfg.prepared}: {stale_reason(changed)}",
                                    refresh=cfg.prepared)
    return path, manifest, False


def writable_dir(path: Path, what: str) -> Path:
    """``path``, created if missing, after checking that files can be made in it; PreparedDataError
    naming ``what`` (the option or variable that chose it) and the reason otherwise."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-test-{socket.gethostname()}-{os.getpid()}"
        probe.touch()
        probe.unlink()
    except OSError as e:
        raise PreparedDataError(f"{what} = {path}: cannot write there ({e.strerror or e}); choose a writable "
                                f"directory") from None
    return path
