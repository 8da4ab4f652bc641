"""Export a training checkpoint's model as a safetensors checkpoint (official or HF layout).

The model tensors are read from the DCP shards one at a time (whatever layout saved them: DCP
assembles each tensor from its shards) and handed to the weights writer of `trex.checkpoint`,
which casts / quantises and writes them shard by shard. Host memory stays near the two largest
tensors (a stacked expert tensor and its partner), never the whole model.
"""

from __future__ import annotations

import json
import logging
import os
from collections import OrderedDict

import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open

from trex.checkpoint.layouts import SAVE_DTYPES, TrexTensor, plan_outputs
from trex.checkpoint.manifest import MANIFEST, TOKENIZER, TRAINER_STATE, SafeFileSystemReader, verify_checkpoint
from trex.checkpoint.reader import CheckpointReader
from trex.checkpoint.save import (check_output, checkpoint_config, passthrough_tensors, tokenizer_files,
                                  written_scale_fmt)
from trex.checkpoint.training import one_process_dcp
from trex.checkpoint.writer import check_destination, write_checkpoint
from trex.models.build import build_model
from trex.models.registry import architecture, config_from_dict

log = logging.getLogger(__name__)


class _TensorSource:
    """Reads full model tensors from a DCP checkpoint, keeping the last two read."""

    def __init__(self, path: str):
        self.reader = SafeFileSystemReader(path)
        self.index = self.reader.read_metadata().state_dict_metadata
        self.cache: OrderedDict[str, torch.Tensor] = OrderedDict()

    def read(self, key: str) -> torch.Tensor:
        if key not in self.cache:
            entry = self.index[f"model.{key}"]
            tensor = torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
            with one_process_dcp():
                dcp.load({"model": {key: tensor}}, storage_reader=self.reader, no_dist=True)
            self.cache[key] = tensor
            if len(self.cache) > 2:
                self.cache.popitem(last=False)
        return self.cache[key]


def export_checkpoint(path: str, out: str, layout: str = "hf", dtype: str = "bf16", quantize: str | None = None,
                      max_shard_size: int | str = "5GB", overwrite: bool = False, source: str | None = None
                      ) -> list[str]:
    """Write the model of training checkpoint ``path`` to ``out``; returns the shard names.

    The checkpoint must verify; a run's checkpoint directory (``runs/x/checkpoints``) stands for its
    newest checkpoint that verifies. layout, dtype, quantize, max_shard_size: as `save_pretrained`.
    ``out`` may not be ``path``, lie inside it or hold it (`check_destination`).

    ``source``: the checkpoint the run started from (default: its recipe's ``model.path``), whose
    tokenizer files (else the tokenizer the run trained with, kept in the checkpoint), and for DeepSeek-V4.1
    the tensors trex carries untrained (vision tower, DSpark stages), are written with the model as they are
    stored, so the export serves as its source did and loads back (`_tokenizer_copies`). A V4.1 run that
    started from a checkpoint which is not here is an error naming it. A run whose ``[drafter]`` re-fitted the
    DSpark stages to this checkpoint's model (``<checkpoints>/drafter/released``, fitted to its step) exports
    those stages instead of the source's; one that re-fitted the model's multi-token prediction modules
    (``<checkpoints>/drafter/mtp``) exports them in place of the checkpoint's.
    """
    from trex.checkpoint.training import find_resume, list_checkpoints

    sources = (path,)
    check_destination(out, overwrite, sources)
    if not os.path.exists(os.path.join(path, MANIFEST)) and list_checkpoints(path):
        newest = find_resume(path)
        if newest is None:
            raise ValueError(f"{path}: none of its checkpoints verifies (`trex ckpt verify {path}` says why)")
        log.info("exporting %s, the newest checkpoint in %s that verifies", newest, path)
        path = newest
    report = verify_checkpoint(path)
    if not report.ok:
        raise ValueError(f"{path}: does not verify: " + "; ".join(report.problems))
    with open(os.path.join(path, TRAINER_STATE)) as f:
        raw_config = json.load(f).get("model_config")
    if not raw_config:
        raise ValueError(f"{path}/{TRAINER_STATE}: no model_config; this checkpoint cannot be exported")
    cfg = config_from_dict(raw_config, source=f"{path}/{TRAINER_STATE}")
    check_output(cfg.architecture, layout, dtype)
    origin = _origin(path, source, cfg)
    meta_model = build_model(cfg, device="meta")
    copies = _tokenizer_copies(path, origin, meta_model)
    source = _TensorSource(path)
    refit_mtp = _refit_drafter(path, "mtp")
    if refit_mtp is not None:
        log.info("the multi-token prediction modules re-fitted to this model: %s", refit_mtp)
    tensors = []
    for key, v in [*meta_model.named_parameters(), *meta_model.named_buffers()]:
        if f"model.{key}" not in source.index:
            raise ValueError(f"{path}: the checkpoint has no tensor model.{key}")

        def get(expert: int | None, key: str = key) -> torch.Tensor:
            if refit_mtp is not None and key.startswith("mtp."):
                with safe_open(os.path.join(refit_mtp, "model.safetensors"), "pt") as f:
                    full = f.get_tensor(key)
            else:
                full = source.read(key)
            return full if expert is None else full[expert]
        tensors.append(TrexTensor(key, tuple(v.shape), v.dtype, get))
    groups = plan_outputs(tensors, layout, SAVE_DTYPES[dtype], quantize, cfg.architecture,
                          n_layers=cfg.num_hidden_layers, scale_fmt=written_scale_fmt(origin, quantize))
    carried = []
    if origin is not None:
        reader = CheckpointReader(origin)
        carried = passthrough_tensors(reader)
        log.info("carrying %d untrained tensors and %s from %s", len(carried), sorted(copies) or "no tokenizer", origin)
    refit = _refit_drafter(path, "released")
    if refit is not None:
        carried = [g for g in carried if not g[0].name.startswith("mtp.")] + passthrough_tensors(CheckpointReader(refit))
        log.info("the DSpark stages re-fitted to this model: %s", refit)
    return write_checkpoint(out, groups + carried, checkpoint_config(cfg, layout, dtype, quantize, origin),
                            max_shard_size, overwrite, sources=(*sources, origin), copies=copies)


def _tokenizer_copies(path: str, origin: str | None, meta_model) -> dict[str, str]:
    """What an export of training checkpoint ``path`` copies besides the weights (name -> file): the tokenizer
    files of the checkpoint the run started from (``origin``, `tokenizer_files`), else the tokenizer the run
    trained with, which the checkpoint keeps (``tokenizer.json``; checkpoints of older trex lack it). A
    DeepSeek-V4.1 model whose Engram needs a tokenizer (`set_engram_tokenizer`) and would get none is a
    ValueError, raised before anything is written."""
    copies = tokenizer_files(origin)
    with open(os.path.join(path, MANIFEST)) as f:
        kept = TOKENIZER in json.load(f).get("files", {})  # listed: verified with the checkpoint
    if kept and not {"tokenizer.json", "tokenizer"} & set(copies):
        copies["tokenizer.json"] = os.path.join(path, TOKENIZER)
    hasher = getattr(meta_model, "engram_hasher", None)
    if hasher is not None and not hasher.ready and not {"tokenizer.json", "tokenizer"} & set(copies):
        raise ValueError(f"{path}: no tokenizer.json, here or in a checkpoint the run started from: DeepSeek-V4.1's "
                         "Engram hashes token ids through the tokenizer the run trained with, so the export would not "
                         "load (checkpoints written by this trex keep it; older ones do not)")
    return copies


def _refit_drafter(path: str, name: str) -> str | None:
    """The drafter a ``[drafter]`` re-fit wrote beside training checkpoint ``path`` (trex.train.drafter_refit:
    ``drafter/<name>`` in its checkpoint directory: ``released`` DSpark stages, ``mtp`` modules) when it was
    fitted to this checkpoint's step, else None."""
    released = os.path.join(os.path.dirname(os.path.abspath(path)), "drafter", name)
    try:
        with open(os.path.join(released, "target.json")) as f:
            fitted = json.load(f).get("target_step")
        with open(os.path.join(path, TRAINER_STATE)) as f:
            step = json.load(f).get("step")
    except (OSError, ValueError):
        return None
    return released if fitted == step else None


def _origin(path: str, source: str | None, cfg) -> str | None:
    """The checkpoint directory the run of training checkpoint ``path`` started from: ``source``, else its
    recipe's ``model.path`` when that is here; None when the run started from a preset."""
    if source is not None:
        if not os.path.isfile(os.path.join(source, "config.json")):
            raise ValueError(f"--source {source}: no checkpoint there (expected config.json and safetensors)")
        return source
    with open(os.path.join(path, TRAINER_STATE)) as f:
        started = ((json.load(f).get("config") or {}).get("model") or {}).get("path") or ""
    if not started:
        return None
    if os.path.isfile(os.path.join(started, "config.json")):
        return started
    if architecture(cfg).passthrough is not None:
        raise ValueError(f"{path}: the run started from {started}, which is not here; the export carries the tensors "
                         f"{cfg.architecture} keeps untrained (V4.1's vision tower and DSpark stages) and its tokenizer: "
                         "name that checkpoint with --source DIR")
    log.warning("%s: the run started from %s, which is not here: its tokenizer files are not copied", path, started)
    return None
