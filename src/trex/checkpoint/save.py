"""Save a model, or convert a checkpoint directory, to the official or HF layout.

Both stream: ``save_pretrained`` casts/quantises one parameter at a time from the model;
``convert`` reads one source tensor (or one expert slice of it) at a time, so its memory stays
near the largest tensor whatever the checkpoint size.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable

import torch

from trex.checkpoint.layouts import SAVE_DTYPES, SCALE_FORMATS, TrexTensor, plan_outputs, quantization_config
from trex.checkpoint.naming import LAYOUTS, checkpoint_names
from trex.checkpoint.reader import CheckpointReader
from trex.checkpoint.safetensors_io import PlannedTensor
from trex.checkpoint.writer import check_destination, write_checkpoint
from trex.models import build_model
from trex.models.registry import AnyConfig, architecture

log = logging.getLogger(__name__)
_LAYER = re.compile(r"^layers\.(\d+)\.")
# what a source checkpoint holds of its tokenizer, copied to the written one (V4.1's Engram hashes through it;
# a serving engine reads it; Kimi-K2's tiktoken BPE)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer", "tiktoken.model")


def save_pretrained(model: torch.nn.Module, path: str, layout: str = "hf", dtype: str = "bf16",
                    quantize: str | None = None, max_shard_size: int | str = "5GB", overwrite: bool = False,
                    progress: bool = False) -> list[str]:
    """Write ``model`` (a trex model of any family) as sharded safetensors + index + ``config.json``.

    layout: "hf" (transformers module names, fused experts) or "official" (released names,
    per-expert tensors). dtype: "bf16" or "fp32" for unquantised tensors. quantize: None, "fp8"
    or "fp8+fp4experts" (reference formats, power-of-two scales). Returns the shard names.
    ``path`` may not be (or lie in, or hold) the directory the model was loaded from
    (``model.loaded_from``, set by `load_pretrained`): save the trained model beside its source.
    """
    sources = (getattr(model, "loaded_from", None),)
    check_destination(path, overwrite, sources)
    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    tensors = [TrexTensor(k, tuple(v.shape), v.dtype, _getter(v)) for k, v in _ordered(state)]
    src = sources[0] if sources[0] and os.path.isdir(sources[0]) else None
    reader = CheckpointReader(src) if src else None
    carried = passthrough_tensors(reader) if reader else []
    return _write(tensors, model.cfg, path, layout, dtype, quantize, max_shard_size, overwrite, progress, sources,
                  carried, _scale_hint(reader, layout), src)


def convert(src: str, dst: str, layout: str = "hf", dtype: str = "bf16", quantize: str | None = None,
            max_shard_size: int | str = "5GB", src_layout: str = "auto", overwrite: bool = False,
            progress: bool = False) -> list[str]:
    """Convert checkpoint directory ``src`` (any layout/precision) to ``dst``, tensor by tensor.
    ``dst`` is a new directory: never ``src``, inside it or above it (`check_destination`)."""
    check_destination(dst, overwrite, (src,))
    reader = CheckpointReader(src, src_layout)
    model = build_model(reader.config, device="meta")
    meta = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    fresh = set(reader.check({k: tuple(v.shape) for k, v in meta.items()}))
    tensors = []
    for key, v in _ordered(meta):
        if key in fresh:
            continue  # e.g. no MTP in the source: nothing to convert
        read_dtype = v.dtype if not v.dtype.is_floating_point else torch.float32
        tensors.append(TrexTensor(key, tuple(v.shape), read_dtype, _reader_getter(reader, key, tuple(v.shape),
                                                                                  read_dtype)))
    return _write(tensors, reader.config, dst, layout, dtype, quantize, max_shard_size, overwrite, progress, (src,),
                  passthrough_tensors(reader), _scale_hint(reader, layout), src)


def check_output(arch: str, layout: str, dtype: str) -> None:
    """ValueError unless a model of architecture ``arch`` is written in ``layout`` with unquantised tensors in
    ``dtype``: in a layout the architecture is written in (``CheckpointNames.layout_refused``: DeepSeek-V4.1 only
    in the official layout, what its Hugging Face repository holds; the V3 family only in the hf one, its released
    names). Every writer asks before it writes."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if dtype not in SAVE_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(SAVE_DTYPES)}, got {dtype!r}")
    refused = checkpoint_names(arch).layout_refused(layout)
    if refused:
        raise ValueError(refused)


def tokenizer_files(src: str | None) -> dict[str, str]:
    """What checkpoint directory ``src`` holds besides its weights that a checkpoint written from it keeps, by
    name: the tokenizer files and folder (``TOKENIZER_FILES``) and the code modules that its config.json and
    tokenizer_config.json name in ``auto_map`` (Kimi-K2's ``configuration_deepseek.py``,
    ``tokenization_kimi.py``: what engines load with trust_remote_code; trex copies them, never runs them)."""
    if not src:
        return {}
    names = list(TOKENIZER_FILES)
    for config in ("config.json", "tokenizer_config.json"):
        auto_map = _json(os.path.join(src, config)).get("auto_map") or {}
        for ref in auto_map.values():
            for item in ref if isinstance(ref, list) else [ref]:
                if isinstance(item, str) and "--" not in item:  # "repo--module.Class" lives in another repository
                    names.append(item.rsplit(".", 1)[0] + ".py")
    return {name: os.path.join(src, name) for name in dict.fromkeys(names) if os.path.exists(os.path.join(src, name))}


def carried_config(src: str | None, quantize: str | None) -> dict:
    """Fields of checkpoint ``src``'s config.json that trex does not model and a checkpoint written from it
    keeps: ``auto_map`` (Kimi-K2's remote code, copied by `tokenizer_files`) and, when it is written
    quantised, ``quantization_config.scale_fmt`` (DeepSeek-V3.1's ue8m0: how engines read the weight scales
    and quantise activations), which the written scales then follow (`written_scale_fmt`). A format trex
    cannot write is dropped with a warning rather than claimed."""
    raw = _json(os.path.join(src, "config.json")) if src else {}
    out = {"auto_map": raw["auto_map"]} if isinstance(raw.get("auto_map"), dict) else {}
    scale_fmt = (raw.get("quantization_config") or {}).get("scale_fmt")
    if quantize is not None and scale_fmt is not None:
        if scale_fmt in SCALE_FORMATS:
            out["quantization_config"] = {"scale_fmt": scale_fmt}
        else:
            log.warning("%s/config.json: quantization_config.scale_fmt %r is not a format trex writes scales in "
                        "(%s): the written config leaves it out", src, scale_fmt, ", ".join(SCALE_FORMATS))
    return out


def written_scale_fmt(src: str | None, quantize: str | None) -> str | None:
    """The ``quantization_config.scale_fmt`` a checkpoint written from ``src`` under ``quantize`` declares,
    and its fresh FP8 scales follow (None: the architecture's own format)."""
    return (carried_config(src, quantize).get("quantization_config") or {}).get("scale_fmt")


def _json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        try:
            raw = json.load(f)
        except json.JSONDecodeError:
            return {}
    return raw if isinstance(raw, dict) else {}


def passthrough_tensors(reader: CheckpointReader) -> list[list[PlannedTensor]]:
    """The tensors the source checkpoint's architecture carries untrained (``Architecture.passthrough``: V4.1's
    vision tower and DSpark stages), to be written as they are stored; none for an architecture without them."""
    return [[PlannedTensor(name, file.tensors[name].dtype, tuple(file.tensors[name].shape),
                           lambda file=file, name=name: file.read(name))] for name, file in reader.passthrough.items()]


def _scale_hint(reader: CheckpointReader | None, layout: str):
    """The source's block scales by name when it is stored in ``layout`` (a weight they still represent
    exactly keeps its scale: an unchanged checkpoint re-exports byte for byte), else None."""
    return reader.stored if reader is not None and reader.layout == layout else None


def _getter(value: torch.Tensor) -> Callable[[int | None], torch.Tensor]:
    return lambda expert: (value if expert is None else value[expert]).detach()


def _reader_getter(reader, key: str, shape: tuple[int, ...], dtype: torch.dtype):
    def get(expert: int | None) -> torch.Tensor:
        if expert is None:
            return reader.read(key, shape, dtype)
        region = ((expert, expert + 1), *((0, n) for n in shape[1:]))
        return reader.read(key, shape, dtype, region)[0]
    return get


def _ordered(state: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """Embedding, layers in numeric order, top-level tensors, then MTP (the official order)."""
    def rank(item: tuple[str, torch.Tensor]) -> tuple:
        key = item[0]
        m = _LAYER.match(key)
        group = 0 if key.startswith("embed.") else 1 if m else 3 if key.startswith("mtp.") else 2
        return group, int(m.group(1)) if m else 0
    return sorted(state.items(), key=rank)


def _write(tensors: list[TrexTensor], cfg: AnyConfig, path: str, layout: str, dtype: str,
           quantize: str | None, max_shard_size: int | str, overwrite: bool, progress: bool,
           sources: tuple[str | None, ...], carried: list[list[PlannedTensor]] = (), scale_hint=None,
           origin: str | None = None) -> list[str]:
    check_output(cfg.architecture, layout, dtype)
    arch = cfg.architecture
    groups = plan_outputs(tensors, layout, SAVE_DTYPES[dtype], quantize, arch, scale_hint,
                          cfg.num_hidden_layers, written_scale_fmt(origin, quantize)) + list(carried)
    config = checkpoint_config(cfg, layout, dtype, quantize, origin)
    files = tokenizer_files(origin)
    if not progress:
        return write_checkpoint(path, groups, config, max_shard_size, overwrite, sources=sources, copies=files)
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn

    total = sum(t.nbytes for g in groups for t in g)
    with Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                  TransferSpeedColumn(), TimeRemainingColumn()) as bar:
        task = bar.add_task(f"writing {path}", total=total)

        def advance(t: PlannedTensor) -> None:
            bar.update(task, advance=t.nbytes)

        return write_checkpoint(path, groups, config, max_shard_size, overwrite, on_written=advance, sources=sources,
                                copies=files)


def official_config_fields() -> dict:
    """What DeepSeek's released config.json carries (``official_config.json``, taken from the files):
    ``keys``, the ``constants`` trex's config does not model, and what is written only when quantised."""
    with open(os.path.join(os.path.dirname(__file__), "official_config.json"), encoding="utf-8") as f:
        return json.load(f)


def checkpoint_config(cfg: AnyConfig, layout: str, dtype: str, quantize: str | None, origin: str | None = None
                      ) -> dict:
    """config.json for a saved checkpoint: transformers' fields for "hf"; for "official", every field
    of the released checkpoints' config.json (`official_config_fields`: legacy ``compress_ratios``
    with the MTP entry, ``num_hash_layers``, flat ``rope_scaling``, and the fields serving engines
    read such as ``hidden_act`` and ``topk_method``). Both read back to ``cfg``. ``origin``: the checkpoint
    the model came from, whose fields trex does not model are kept (`carried_config`)."""
    out = cfg.to_hf_dict()
    out["torch_dtype"] = {"bf16": "bfloat16", "fp32": "float32"}[dtype]
    carried = carried_config(origin, quantize)
    out.update({k: v for k, v in carried.items() if k != "quantization_config"})
    qcfg = quantization_config(quantize, cfg.architecture)
    if qcfg is not None:
        out["quantization_config"] = {**qcfg, **carried.get("quantization_config", {})}
        if quantize == "fp8+fp4experts":
            out["expert_dtype"] = "fp4"
    official = architecture(cfg).load("official_config")
    if layout == "hf" or official is None:
        return out
    out = official(cfg, out)
    out.update(official_config_fields()["constants"])
    return out
