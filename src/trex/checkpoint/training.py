"""Sharded training checkpoints with exact resume (torch.distributed.checkpoint).

    [checkpoint]
    save_every = 100     # 0: no checkpoints
    keep_last = 3
    resume = "auto"      # "" (start fresh), "auto" (newest checkpoint that verifies) or a path

Model parameters and buffers (router biases, hash tables) and the optimizer state (fp32 masters,
moments, momentum buffers) go through DCP, so each rank writes its own shards and a checkpoint
saved at one layout loads at another (DTensor parameters are resharded on load). The rest of the
run's position (LR schedule, step guard and loss scaler, data loader, step) is JSON; RNG states are
one safetensors file per rank. The file layout and the manifest are in `trex.checkpoint.manifest`.

A save is atomic: everything is written to ``<dir>/.tmp.step_<N>``, the manifest last, then the
directory is renamed to ``<dir>/step_<N>``. With ``async_save`` the tensor writes overlap the next
steps and the checkpoint is published when the next save starts or the run ends.

`Checkpointer` is what the training loop uses: resume at set-up, `after_step` (saves every
``save_every`` steps, and on SIGTERM / SIGINT, which it turns into a save-then-stop), `finish`.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import shutil
import signal
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from safetensors.torch import load_file, save_file

from trex import atomic
import trex
from trex.checkpoint import migration
from trex.checkpoint.manifest import (DCP_INDEX, FORMAT, MANIFEST, RNG_DIR, TOKENIZER, TRAINER_STATE,
                                      SafeFileSystemReader, describe_files, manifest_digest, read_dcp_index, rng_file,
                                      tensor_table, verify_checkpoint)

log = logging.getLogger(__name__)
_STEP_DIR = re.compile(r"^step_(\d+)$")
_TMP_PREFIX = ".tmp.step_"


@dataclass
class CheckpointSection:
    """The ``[checkpoint]`` section of a recipe."""

    dir: str = ""
    """Where step_<N> directories go; empty: <train.out>/checkpoints."""
    save_every: int = 0
    """Save every this many optimizer steps and at the end; 0 turns checkpointing off."""
    keep_last: int = 3
    """Keep the newest this many checkpoints (0 keeps all)."""
    async_save: bool = False
    """Write tensors in the background while training continues."""
    resume: str = ""
    """"" (start fresh), "auto" (newest checkpoint in `dir` that verifies) or a checkpoint directory."""

    def __post_init__(self) -> None:
        if self.save_every < 0 or self.keep_last < 0:
            raise ValueError(f"checkpoint: save_every and keep_last must be >= 0, got {self.save_every} "
                             f"and {self.keep_last}")

    def directory(self, out: str) -> str:
        return self.dir or os.path.join(out, "checkpoints")


@dataclass
class RunState:
    """Everything a checkpoint restores. ``guard`` and ``data`` need state_dict/load_state_dict."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    guard: Any
    data: Any  # the objective: data positions and sampler RNG (stored under "loader", the key it always had)
    dev: Any  # trex.device.Device: its RNG states are saved per rank


@dataclass
class Resumed:
    step: int
    path: str
    loop: dict = field(default_factory=dict)
    """Counters the loop saved with the checkpoint (e.g. tokens seen)."""
    saved: dict = field(default_factory=dict)
    """The configuration it was written under (trex.checkpoint.migration.saved_configuration)."""
    versions: dict = field(default_factory=dict)
    """trex and torch versions of the run that wrote it ({} for older checkpoints)."""


# ---- ranks ------------------------------------------------------------------------------------------
def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if _distributed() else (0, 1)


def _barrier() -> None:
    if _distributed():
        dist.barrier()


def _gather(obj: Any) -> list:
    if not _distributed():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _from_rank0(obj: Any) -> Any:
    if not _distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


# ---- what goes into the DCP state dict ----------------------------------------------------------------
def _param_names(model: torch.nn.Module) -> dict[int, str]:
    return {id(p): n for n, p in model.named_parameters()}


def _optimizer_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """{"<parameter name>.<state key>": tensor} of every optimizer state tensor (DTensors stay sharded)."""
    names = _param_names(model)
    out = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            for key, value in optimizer.state.get(p, {}).items():
                if not isinstance(value, torch.Tensor):
                    raise ValueError(f"optimizer state {names[id(p)]}.{key} is a {type(value).__name__}; "
                                     "checkpoints hold tensor optimizer state only")
                out[f"{names[id(p)]}.{key}"] = value
    return out


def _group_records(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[dict]:
    """Per param group: its parameter names and the schedule-owned lr / initial_lr."""
    names = _param_names(model)
    return [{"params": [names[id(p)] for p in g["params"]],
             **{k: g[k] for k in ("lr", "initial_lr") if k in g}} for g in optimizer.param_groups]


def _world(model: torch.nn.Module, world_size: int, config: dict | None) -> dict:
    """World size, the mesh of the first DTensor parameter (if any) and the recipe's [parallel]."""
    world: dict = {"world_size": world_size}
    for p in model.parameters():
        mesh = getattr(p, "device_mesh", None)
        if mesh is not None:
            world["mesh"] = {"shape": list(mesh.shape), "dim_names": list(mesh.mesh_dim_names or [])}
            break
    if config and "parallel" in config:
        world["parallel"] = config["parallel"]
    return world


# ---- save -------------------------------------------------------------------------------------------
@dataclass
class PendingSave:
    """A save whose tensors may still be in flight; `finalize` publishes it (all ranks call it)."""

    directory: str
    step: int
    tmp: str
    manifest: dict
    keep_last: int
    future: Any = None

    def finalize(self) -> str:
        if self.future is not None:
            with _write_errors(self.tmp, self.step):
                self.future.result()
        rank, _ = _rank_world()
        mine = [n for n in os.listdir(self.tmp) if n.startswith(f"__{rank}_")] + [rng_file(rank)]
        if rank == 0:
            mine += [DCP_INDEX, TRAINER_STATE]
            if os.path.exists(os.path.join(self.tmp, TOKENIZER)):  # kept when the run gave its tokenizer
                mine.append(TOKENIZER)
        files = {k: v for part in _gather(describe_files(self.tmp, mine)) for k, v in part.items()}
        final = os.path.join(self.directory, f"step_{self.step}")
        if rank == 0:
            manifest = {**self.manifest, "files": files, "tensors": tensor_table(read_dcp_index(self.tmp))}
            manifest["digest"] = manifest_digest(manifest)
            _write_json(os.path.join(self.tmp, MANIFEST), manifest)
            if os.path.exists(final):  # a re-save of the same step after a resume from an older one
                shutil.rmtree(final)
            os.rename(self.tmp, final)
            prune(self.directory, self.keep_last)
        _barrier()
        return final


@contextlib.contextmanager
def _write_errors(tmp: str, step: int) -> Iterator[None]:
    """A failed tensor write (a full disk, a quota or file-size limit, an I/O error) as one OSError
    naming the checkpoint, the cause and the free space; DCP wraps each rank's error in a
    CheckpointException (a BaseException), and torch's file writer reports a short write as a
    RuntimeError. The partial directory is removed (never published; the room goes back)."""
    try:
        yield
    except CheckpointException as e:
        causes = [exc for exc, _ in e.failures.values()]
        cause = next((exc for exc in causes if isinstance(exc, OSError)), causes[0] if causes else e)
        reason = getattr(cause, "strerror", None) or str(cause).strip().splitlines()[-1]
        shutil.rmtree(tmp, ignore_errors=True)
        free = shutil.disk_usage(os.path.dirname(tmp)).free / 2**30
        raise OSError(getattr(cause, "errno", None) or errno.EIO,
                      f"the checkpoint of step {step} could not be written ({reason}; {free:.2f} GiB free); "
                      "nothing was published: free space or set checkpoint.dir", tmp) from None


def _write_json(path: str, obj: Any) -> None:
    atomic.write_json(path, obj, indent=1, fsync=True)


@contextlib.contextmanager
def one_process_dcp() -> Iterator[None]:
    """Around a DCP save or load: without a process group (one process), torch warns at every call that it
    "is disabled, unavailable or uninitialized, assuming the intent is to save in a single process", even when
    told ``no_dist=True``. One process is what trex means there, so exactly that warning is dropped: it is
    torch's note on a normal case, not something the user can act on (any other warning still shows)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized",
                                category=UserWarning)
        yield


_ASYNC_GROUP = None


def _async_process_group():
    """A CPU process group for background saves, so they never share a stream with training collectives."""
    global _ASYNC_GROUP
    if _distributed() and _ASYNC_GROUP is None:
        _ASYNC_GROUP = dist.new_group(backend="gloo")
    return _ASYNC_GROUP


def save_checkpoint(directory: str, step: int, state: RunState, *, config: dict | None = None,
                    precision: dict | None = None, loop: dict | None = None, keep_last: int = 3,
                    async_save: bool = False, tokenizer: str | None = None) -> PendingSave:
    """Write ``<directory>/step_<step>``; every rank calls it. Returns the save, published when
    ``async_save`` is False, else to be published by ``.finalize()`` (all ranks). ``tokenizer``: the run's
    tokenizer as ``tokenizer.json`` text, kept with the checkpoint (an export writes it with the model)."""
    rank, world_size = _rank_world()
    tmp = os.path.join(directory, f"{_TMP_PREFIX}{step}")
    if rank == 0:
        os.makedirs(directory, exist_ok=True)
        remove_unfinished(directory)
        os.makedirs(os.path.join(tmp, RNG_DIR))
    _barrier()
    save_file(state.dev.get_rng_state(), os.path.join(tmp, rng_file(rank)))
    trainer = {
        "step": step, "loop": loop or {}, "scheduler": state.scheduler.state_dict(),
        "guard": state.guard.state_dict(), "loader": state.data.state_dict(),
        "param_groups": _group_records(state.model, state.optimizer), "config": config, "precision": precision,
        "model_config": state.model.cfg.to_hf_dict() if hasattr(state.model, "cfg") else None,
        "world_size": world_size, "device": state.dev.type, "versions": migration.versions(),
    }
    if rank == 0:
        _write_json(os.path.join(tmp, TRAINER_STATE), trainer)
        if tokenizer is not None:
            atomic.write_text(os.path.join(tmp, TOKENIZER), tokenizer, fsync=True)
    tensors = {"model": state.model.state_dict(), "optim": _optimizer_tensors(state.model, state.optimizer)}
    manifest = {"format": FORMAT, "trex_version": trex.__version__, "step": step,
                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "world": _world(state.model, world_size, config)}
    pending = PendingSave(directory, step, tmp, manifest, keep_last)
    writer = dcp.FileSystemWriter(tmp)
    with one_process_dcp():
        if async_save:
            pending.future = dcp.async_save(tensors, storage_writer=writer, process_group=_async_process_group())
            return pending
        with _write_errors(tmp, step):
            dcp.save(tensors, storage_writer=writer)
    pending.finalize()
    return pending


# ---- listing, pruning, verifying ---------------------------------------------------------------------
def list_checkpoints(directory: str) -> list[tuple[int, str]]:
    """(step, path) of every step_<N> directory, oldest first (complete or not)."""
    if not os.path.isdir(directory):
        return []
    found = [(int(m.group(1)), os.path.join(directory, n)) for n in os.listdir(directory)
             if (m := _STEP_DIR.match(n)) and os.path.isdir(os.path.join(directory, n))]
    return sorted(found)


def remove_unfinished(directory: str) -> list[str]:
    """Delete the ``.tmp.step_<N>`` directories of saves that did not finish (a rank killed while it
    wrote); returns their names. Rank 0 calls it, only where no save of its own run is in flight (at
    resume, and when a save starts: a pending async save is published first)."""
    stale = sorted(n for n in os.listdir(directory) if n.startswith(_TMP_PREFIX)) if os.path.isdir(directory) else []
    for name in stale:
        shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
    return stale


def prune(directory: str, keep_last: int) -> None:
    """Delete all but the newest ``keep_last`` complete checkpoints (0 keeps all)."""
    complete = [p for _, p in list_checkpoints(directory) if os.path.exists(os.path.join(p, MANIFEST))]
    for path in complete[:-keep_last] if keep_last else []:
        shutil.rmtree(path)


def find_resume(directory: str) -> str | None:
    """The newest checkpoint under ``directory`` that verifies; corrupt or partial ones are skipped,
    each with a logged warning (``trex: warning: skipping checkpoint ...``). Rank 0 verifies, the
    others receive its choice."""
    choice = None
    if _rank_world()[0] == 0:
        for _, path in reversed(list_checkpoints(directory)):
            report = verify_checkpoint(path)
            if report.ok:
                choice = path
                break
            log.warning("skipping checkpoint %s: %s", path, "; ".join(report.problems))
    return _from_rank0(choice)


# ---- load -------------------------------------------------------------------------------------------
def _allocate_optimizer_state(state: RunState, index) -> dict[str, dict[str, torch.Tensor]]:
    """Empty tensors, by parameter name and state key, for every optimizer entry in the DCP index,
    placed like their parameter (a DTensor parameter gets DTensor state): the parameter's shape, a
    scalar (a step count) or one per row (V4.1's Engram tables under row-wise AdaGrad)."""
    params = {n: p for n, p in state.model.named_parameters()}
    trained = {id(p) for g in state.optimizer.param_groups for p in g["params"]}
    out: dict[str, dict[str, torch.Tensor]] = {}
    for key, entry in index.state_dict_metadata.items():
        if not key.startswith("optim."):
            continue
        name, leaf = key[len("optim."):].rsplit(".", 1)
        p = params.get(name)
        if p is None or id(p) not in trained:
            raise ValueError(f"checkpoint has optimizer state {key[6:]} but this run does not train parameter {name}")
        dtype, shape = entry.properties.dtype, tuple(entry.size)
        if shape == tuple(p.shape):
            out.setdefault(name, {})[leaf] = torch.zeros_like(p, dtype=dtype, requires_grad=False)
        elif shape == ():  # AdamW's step count, on the parameter's device like the optimizer keeps it
            out.setdefault(name, {})[leaf] = torch.zeros((), dtype=dtype, device=p.device)
        elif p.dim() > 1 and shape == tuple(p.shape[:-1]):  # one value per row (row-wise AdaGrad), split as the rows
            out.setdefault(name, {})[leaf] = torch.zeros_like(p[..., 0], dtype=dtype, requires_grad=False)
        else:
            raise ValueError(f"checkpoint optimizer state {key[6:]} has shape {list(shape)}; parameter {name} "
                             f"has shape {list(p.shape)}")
    return out


def load_checkpoint(path: str, state: RunState) -> Resumed:
    """Restore model, optimizer, schedule, guard, loader and RNG from checkpoint ``path``; all ranks call it.

    Works at any world layout: DTensor parameters and optimizer state are resharded by DCP. The
    optimizer's hyperparameters come from the current recipe, except lr / initial_lr (schedule state).
    """
    reader = SafeFileSystemReader(path)
    index = reader.read_metadata()
    with open(os.path.join(path, TRAINER_STATE)) as f:
        trainer = json.load(f)
    model_sd = state.model.state_dict()
    missing = [k for k in model_sd if f"model.{k}" not in index.state_dict_metadata]
    if missing:
        raise ValueError(f"{path}: the checkpoint lacks model tensors {missing[:5]}"
                         f"{' ...' if len(missing) > 5 else ''} (a different model config?)")
    optim_sd = _allocate_optimizer_state(state, index)
    with one_process_dcp():
        dcp.load({"model": model_sd, "optim": optim_sd}, storage_reader=reader)
    state.model.load_state_dict(model_sd)

    names = _param_names(state.model)
    saved_groups = trainer["param_groups"]
    groups = state.optimizer.param_groups
    if [g["params"] for g in saved_groups] != [[names[id(p)] for p in g["params"]] for g in groups]:
        raise ValueError(f"{path}: the optimizer's parameter groups differ from the checkpoint's "
                         "(different optim.name, model or freezing?)")
    for group, saved in zip(groups, saved_groups):
        group.update({k: v for k, v in saved.items() if k != "params"})
        for p in group["params"]:
            state.optimizer.state[p] = optim_sd.get(names[id(p)], {})
    state.scheduler.load_state_dict(trainer["scheduler"])
    state.guard.load_state_dict(trainer["guard"])
    state.data.load_state_dict(trainer["loader"])

    rank, world_size = _rank_world()
    rng = os.path.join(path, rng_file(rank))
    if os.path.exists(rng):
        state.dev.set_rng_state(load_file(rng))
    else:
        log.warning("%s has no RNG state for rank %d (saved at world size %s): this rank keeps its seeded RNG",
                    path, rank, trainer.get("world_size", "?"))
    return Resumed(step=int(trainer["step"]), path=path, loop=trainer.get("loop", {}),
                   saved=migration.saved_configuration(trainer), versions=trainer.get("versions", {}))


# ---- the loop's view -----------------------------------------------------------------------------------
class Checkpointer:
    """Resume, periodic and final saves, and save-on-signal for one run."""

    def __init__(self, section: CheckpointSection, out: str, state: RunState, *, config: dict | None = None,
                 precision: dict | None = None, tokenizer: str | None = None):
        """``tokenizer``: the run's tokenizer as ``tokenizer.json`` text, written into every checkpoint."""
        self.section, self.state = section, state
        self.directory = section.directory(out)
        self.config, self.precision, self.tokenizer = config, precision, tokenizer
        self.enabled = section.save_every > 0
        self.last_saved: int | None = None
        self.stop_checkpoint = ""
        """The checkpoint written when a stop signal stopped the run ("" until then)."""
        self._pending: PendingSave | None = None
        self._signal: int = 0
        self._previous: dict[int, Any] = {}

    def check_writable(self) -> None:
        """Before step 1, when the run will save: the checkpoint directory can be made and written, and
        its file system has room for one checkpoint (parameters as stored plus up to two fp32 moments
        and an fp32 master per parameter, this rank's shards). Raises OSError naming the directory."""
        if not self.enabled:
            return
        try:
            os.makedirs(self.directory, exist_ok=True)
            probe = os.path.join(self.directory, f".write-test-{os.getpid()}")
            with open(probe, "wb") as f:
                f.write(b"0")
            os.remove(probe)
        except OSError as e:
            raise OSError(e.errno, f"checkpoint directory cannot be written ({e.strerror}); set checkpoint.dir "
                                   "or train.out", self.directory) from None
        params = [p.to_local() if hasattr(p, "to_local") else p for p in self.state.model.parameters()]
        need = sum(p.numel() * (p.element_size() + 12) for p in params)
        free = shutil.disk_usage(self.directory).free
        if free < need:
            raise OSError(errno.ENOSPC, f"{free / 2**30:.2f} GiB free, one checkpoint of this run needs up to "
                                        f"{need / 2**30:.2f} GiB; free space or set checkpoint.dir", self.directory)

    def resume(self) -> Resumed | None:
        """Load the checkpoint ``section.resume`` names; None when starting fresh."""
        spec = self.section.resume
        if not spec:
            return None
        path = find_resume(self.directory) if spec == "auto" else spec
        # rank 0 looks and decides, every rank acts on its view: ranks that saw the directory differently
        # (a rank-local disk) would part ways here and wait for each other in the next collective
        found = _from_rank0(self._look() if _rank_world()[0] == 0 else None)
        if path is None:
            if found:  # a run that had checkpoints never restarts from scratch on its own
                raise ValueError(f"checkpoint.resume = auto: none of the {len(found)} checkpoints in {self.directory} "
                                 f"verifies ({', '.join(os.path.basename(p) for p in found)}; `trex ckpt verify "
                                 "PATH` says why); to start this run again from step 1, move them away or pass "
                                 "--resume \"\"")
            log.info("resume = auto: no checkpoint in %s yet, starting from step 1", self.directory)
            return None
        if spec != "auto":
            report = _from_rank0(verify_checkpoint(path).to_dict() if _rank_world()[0] == 0 else None)
            if not report["ok"]:
                raise ValueError(f"checkpoint.resume = {path}: " + "; ".join(report["problems"]))
        resumed = load_checkpoint(path, self.state)
        self.last_saved = resumed.step
        log.info("resumed from %s at step %d", path, resumed.step)
        return resumed

    def _look(self) -> list[str]:
        """Rank 0, at resume: the checkpoint directories there (complete or not), after removing (and
        naming) the saves that did not finish."""
        unfinished = remove_unfinished(self.directory)
        if unfinished:
            log.warning("removed %s that did not finish (%s, in %s): the run was stopped while writing it",
                        "a checkpoint save" if len(unfinished) == 1 else f"{len(unfinished)} checkpoint saves",
                        ", ".join(unfinished), self.directory)
        return [p for _, p in list_checkpoints(self.directory)]

    # -- signals: the handler only records the signal; the loop saves after the step it is in --
    @contextlib.contextmanager
    def signals(self) -> Iterator[None]:
        """SIGTERM / SIGINT are recorded (the loop saves and stops after its step) for the whole block,
        the summary and plot written after the loop included. Once a stop signal has arrived the
        process ignores further SIGTERMs: torchrun and schedulers send follow-up ones, and the default
        handler (which Python itself restores at exit) would kill the rank while it writes its last
        files or shuts down; SIGKILL still stops it. A run without checkpoints stops the same way, with
        nothing saved."""
        try:
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._on_signal)
        except ValueError:  # not the main thread: leave signals alone
            self._previous.clear()
        try:
            yield
        finally:
            for sig, handler in self._previous.items():
                signal.signal(sig, signal.SIG_IGN if self._signal and sig == signal.SIGTERM else handler)
            self._previous.clear()

    def _on_signal(self, signum: int, frame) -> None:
        if self._signal == signal.SIGINT and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C stops at once
        self._signal = signum

    def _agreed_signal(self) -> int:
        """The signal any rank received (the same answer on every rank)."""
        if not _distributed():
            return self._signal
        flag = torch.tensor([self._signal], device=self.state.dev.torch_device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())

    # -- saves --
    def save(self, step: int, loop: dict | None = None, async_save: bool | None = None) -> None:
        self._publish_pending()
        use_async = self.section.async_save if async_save is None else async_save
        pending = save_checkpoint(self.directory, step, self.state, config=self.config, precision=self.precision,
                                  loop=loop, keep_last=self.section.keep_last, async_save=use_async,
                                  tokenizer=self.tokenizer)
        self._pending = pending if use_async else None
        self.last_saved = step

    def after_step(self, step: int, loop: dict | None = None) -> int:
        """Call after optimizer step ``step`` (1-based). Saves when due; returns the signal number
        (SIGTERM / SIGINT) if the run must stop now, after its checkpoint is written (none when
        checkpointing is off), else 0."""
        stop = self._agreed_signal()
        if not self.enabled:
            return stop
        if stop:
            self.save(step, loop, async_save=False)
            self.stop_checkpoint = os.path.join(self.directory, f"step_{step}")
        elif step % self.section.save_every == 0:
            self.save(step, loop)
        return stop

    def finish(self, step: int, loop: dict | None = None) -> None:
        """The end-of-run save (unless ``step`` was just saved); publishes any pending save."""
        if self.enabled and self.last_saved != step:
            self.save(step, loop, async_save=False)
        self._publish_pending()

    def close(self) -> None:
        """Publish a pending save."""
        self._publish_pending()

    def _publish_pending(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.finalize()
