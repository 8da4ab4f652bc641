"""Summarise a checkpoint directory from its headers alone (no tensor data is read)."""

from __future__ import annotations

import os
from collections import Counter

from trex.checkpoint.reader import CheckpointReader
from trex.checkpoint.safetensors_io import DTYPE_NAMES
from trex.models import build_model, count_parameters
from trex.models.registry import ARCHITECTURES, drafter_kind


def inspect_checkpoint(path: str, layout: str = "auto") -> dict:
    """layout, dtypes, quantisation, tensor count, total/active parameters of the config (and its drafter's
    kind: ``registry.drafter_kind``), missing and unexpected keys versus the config, and shard sizes in bytes."""
    reader = CheckpointReader(path, layout)
    model = build_model(reader.config, device="meta")
    expected = {k: tuple(v.shape) for k, v in [*model.named_parameters(), *model.named_buffers()]}
    diagnosis = reader.diagnose(expected)
    dtypes = Counter(DTYPE_NAMES[info.dtype] for f in reader.files for info in f.tensors.values())
    params = count_parameters(reader.config)
    return {
        "path": path,
        "architecture": reader.config.architecture,
        "layout": reader.layout,
        "quantization": reader.quantized or ["none"],
        "dtypes": dict(sorted(dtypes.items())),
        "tensors": sum(len(f.tensors) for f in reader.files),
        "parameters": {"total": params.total, "active": params.active, "mtp": params.mtp, "engram": params.engram},
        "drafter": drafter_kind(reader.config),
        "carried_through": len(reader.passthrough),  # Architecture.passthrough (V4.1: vision tower, DSpark stages)
        "mtp_copies": sorted(s.name for copies in reader.copies.values() for s in copies),  # V3: shapes checked
        "missing": diagnosis.missing,
        "missing_optional": diagnosis.missing_optional,
        "unexpected": diagnosis.unexpected,
        "problems": diagnosis.problems,
        "shards": {os.path.basename(f.path): os.path.getsize(f.path) for f in reader.files},
    }


def format_report(report: dict) -> str:
    """Human-readable lines for ``inspect_checkpoint``'s result."""
    p = report["parameters"]
    carries = ARCHITECTURES[report["architecture"]].passthrough is not None
    drafter = "DSpark drafter" if report["drafter"] == "dspark" else "mtp"
    mtp = (f"carried:       {report['carried_through']} tensors the model does not train, kept as stored" if carries
           else f"no MTP:        {len(report['missing_optional'])} tensors" if report["missing_optional"]
           else "MTP:           present" + (f", with {len(report['mtp_copies'])} copies of the embedding and head"
                                              if report["mtp_copies"] else ""))
    lines = [
        f"path:          {report['path']}",
        f"architecture:  {report['architecture']}",
        f"layout:        {report['layout']}",
        f"quantization:  {', '.join(report['quantization'])}",
        f"dtypes:        {', '.join(f'{k} x{v}' for k, v in report['dtypes'].items())}",
        f"tensors:       {report['tensors']}",
        f"parameters:    total {p['total']:,}  active {p['active']:,}  "
        + (f"Engram tables {p['engram']:,}  " if p["engram"] else "") + f"{drafter} {p['mtp']:,}",
        f"missing:       {len(report['missing'])} {report['missing'][:5]}",
        mtp,
        f"unexpected:    {len(report['unexpected'])} {report['unexpected'][:5]}",
        f"shards:        {len(report['shards'])}, {sum(report['shards'].values()) / 1e9:.3f} GB",
    ]
    lines += [f"  {name}  {size / 1e6:,.1f} MB" for name, size in report["shards"].items()]
    lines += [f"problem: {p}" for p in report["problems"]]
    return "\n".join(lines)
