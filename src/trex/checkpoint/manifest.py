"""What a training checkpoint directory holds, its manifest, and `verify_checkpoint`.

A checkpoint is a directory ``<checkpoints>/step_<N>/``::

    .metadata               torch.distributed.checkpoint index (which bytes of which file hold which shard)
    __<rank>_<i>.distcp     tensor data written by each rank: model parameters and buffers, optimizer state
    trainer_state.json      step, LR schedule, step guard and loss scaler, data position, optimizer
                            hyperparameters, resolved recipe, precision policy, model config
    rng/rank_<r>.safetensors  the RNG states of rank r
    tokenizer.json          the tokenizer the run trained with (what `trex ckpt export` writes with the
                            model: V4.1's Engram hashes through it); absent in checkpoints of older trex
    manifest.json           written last: every file with its size and sha256, every tensor with its
                            global shape and dtype, the world layout, the trex version

A directory without a manifest is a save that did not finish. `verify_checkpoint` checks that
every listed file is present with the listed size and sha256, that the DCP index names only listed
files, and that the tensors it describes are the manifest's.

DCP writes its index with pickle. `SafeFileSystemReader` reads it with an unpickler that accepts only
the DCP metadata classes, ``torch.Size`` and dtypes, so a checkpoint can never run code; tensors are
read by DCP with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import pathlib
import pickle
from dataclasses import dataclass, field

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_metadata

MANIFEST = "manifest.json"
TRAINER_STATE = "trainer_state.json"
TOKENIZER = "tokenizer.json"
DCP_INDEX = ".metadata"
RNG_DIR = "rng"
FORMAT = "trex-train-checkpoint/1"
_CHUNK = 8 << 20


def rng_file(rank: int) -> str:
    return f"{RNG_DIR}/rank_{rank:05d}.safetensors"


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            h.update(block)
    return h.hexdigest()


def describe_files(root: str, names: list[str]) -> dict[str, dict]:
    """{relative name: {"bytes", "sha256"}} for files under ``root``."""
    return {n: {"bytes": os.path.getsize(os.path.join(root, n)), "sha256": sha256_file(os.path.join(root, n))}
            for n in sorted(names)}


# ---- the DCP index, read without executing code --------------------------------------------------------
_ALLOWED_GLOBALS = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
                    ("pathlib", "WindowsPath"), ("torch.distributed.checkpoint.filesystem", "_StorageInfo")}


class _IndexUnpickler(pickle._Unpickler):  # the Python unpickler: its BUILD can be checked
    """Builds only allowed classes (``find_class``), and sets on an object only the fields of its
    dataclass (``BUILD``): a rewritten index cannot call other code or plant attributes."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def load_build(self) -> None:
        state, inst = self.stack[-1], self.stack[-2]
        fields = {f.name for f in dataclasses.fields(inst)} if dataclasses.is_dataclass(inst) else set()
        own_setstate = type(inst).__dict__.get("__setstate__") is not None and type(inst).__module__ == dcp_metadata.__name__
        if isinstance(state, tuple) and len(state) == 2 and state[0] is None:
            state = state[1]  # (no dict state, slot state)
        if isinstance(state, dict):
            ok = bool(fields) and set(state) <= fields
        else:
            ok = own_setstate and isinstance(state, tuple) and len(state) <= len(fields)
        if not ok:
            raise pickle.UnpicklingError(f"state {type(state).__name__} for {type(inst).__name__} sets other than "
                                         "its fields")
        super().load_build()

    dispatch[pickle.BUILD[0]] = load_build

    def find_class(self, module: str, name: str):
        allowed = (module, name) in _ALLOWED_GLOBALS
        allowed |= module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        allowed |= module == dcp_metadata.__name__ and isinstance(getattr(dcp_metadata, name, None), type)
        if not allowed:
            raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a checkpoint index")
        return super().find_class(module, name)


def read_dcp_index(path: str) -> dcp_metadata.Metadata:
    """The DCP ``.metadata`` of checkpoint directory ``path``; ValueError if it is malformed or unsafe."""
    file = os.path.join(path, DCP_INDEX)
    try:
        with open(file, "rb") as f:
            meta = _IndexUnpickler(io.BytesIO(f.read())).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError) as e:
        raise ValueError(f"{file}: not a readable checkpoint index ({e})") from None
    if not isinstance(meta, dcp_metadata.Metadata):
        raise ValueError(f"{file}: expected a DCP Metadata object, got {type(meta).__name__}")
    for key, entry in meta.state_dict_metadata.items():
        if not isinstance(entry, dcp_metadata.TensorStorageMetadata):
            raise ValueError(f"{file}: entry {key!r} is not a tensor; trex checkpoints hold tensors only")
    return meta


class SafeFileSystemReader(FileSystemReader):
    """A DCP `FileSystemReader` whose index is read by `read_dcp_index` (once, then cached)."""

    def __init__(self, path: str):
        super().__init__(path)
        self._index: dcp_metadata.Metadata | None = None

    def read_metadata(self, *args, **kwargs) -> dcp_metadata.Metadata:
        if self._index is None:
            self._index = read_dcp_index(str(self.path))
            self._index.storage_meta = dcp_metadata.StorageMeta(load_id=self.load_id)
        return self._index


def tensor_table(meta: dcp_metadata.Metadata) -> dict[str, dict]:
    """{key: {"shape": global shape, "dtype": name}} of every tensor in a DCP index."""
    return {k: {"shape": list(v.size), "dtype": str(v.properties.dtype).removeprefix("torch.")}
            for k, v in sorted(meta.state_dict_metadata.items())}


def index_files(meta: dcp_metadata.Metadata) -> set[str]:
    return {info.relative_path for info in meta.storage_data.values()}


# ---- verification ------------------------------------------------------------------------------------
@dataclass
class VerifyReport:
    path: str
    ok: bool = False
    step: int | None = None
    problems: list[str] = field(default_factory=list)
    files: int = 0
    bytes: int = 0
    tensors: int = 0
    world: dict = field(default_factory=dict)
    trex_version: str = ""

    def format(self) -> str:
        head = f"{self.path}: {'OK' if self.ok else 'FAILED'}"
        if self.step is not None:
            head += f" (step {self.step}, {self.files} files, {self.bytes / 1e6:.1f} MB, {self.tensors} tensors"
            head += f", world size {self.world.get('world_size', '?')}, trex {self.trex_version})"
        return "\n".join([head, *(f"  - {p}" for p in self.problems)])

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def manifest_digest(manifest: dict) -> str:
    """sha256 of the manifest's canonical JSON without its own ``digest`` field: a changed byte of
    the manifest (which checks every other file) is caught too."""
    body = {k: v for k, v in manifest.items() if k != "digest"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def verify_checkpoint(path: str) -> VerifyReport:
    """Completeness and checksums of checkpoint directory ``path`` against its manifest."""
    report = VerifyReport(str(path))
    manifest_path = os.path.join(path, MANIFEST)
    if not os.path.isdir(path):
        report.problems.append("not a directory")
        return report
    if not os.path.exists(manifest_path):
        report.problems.append(f"no {MANIFEST}: the save did not finish (partial checkpoint)")
        return report
    try:
        manifest = json.loads(pathlib.Path(manifest_path).read_text())
        files, tensors = manifest["files"], manifest["tensors"]
        report.step, report.world, report.trex_version = int(manifest["step"]), manifest["world"], manifest["trex_version"]
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        report.problems.append(f"{MANIFEST} is malformed: {e!r}")
        return report
    if "digest" in manifest and manifest["digest"] != manifest_digest(manifest):  # absent: written by an earlier trex
        report.problems.append(f"{MANIFEST}: its digest does not match its content (corrupted or edited)")
        return report
    if manifest.get("format") != FORMAT:
        report.problems.append(f"{MANIFEST}: format {manifest.get('format')!r}, expected {FORMAT!r}")
    for name, want in files.items():
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            report.problems.append(f"{name}: missing")
            continue
        size = os.path.getsize(file)
        if size != want["bytes"]:
            report.problems.append(f"{name}: {size} bytes, the manifest says {want['bytes']} (truncated or rewritten)")
        elif sha256_file(file) != want["sha256"]:
            report.problems.append(f"{name}: sha256 differs from the manifest (corrupted)")
        report.files += 1
        report.bytes += size
    for required in (DCP_INDEX, TRAINER_STATE):
        if required not in files:
            report.problems.append(f"{required}: not listed in the manifest")
    if not report.problems:
        try:
            meta = read_dcp_index(path)
        except ValueError as e:
            report.problems.append(str(e))
        else:
            unlisted = sorted(index_files(meta) - set(files))
            if unlisted:
                report.problems.append(f"the DCP index names files the manifest does not list: {unlisted}")
            if tensor_table(meta) != tensors:
                report.problems.append("the tensors of the DCP index differ from the manifest's")
            report.tensors = len(tensors)
    report.ok = not report.problems
    return report
