"""Read a DeepSeek-V4, V4.1 or V3-family checkpoint directory tensor by tensor, in any layout and precision.

``CheckpointReader(path)`` opens every shard header (nothing else), pairs each FP8/FP4 weight
with its block scale and maps every tensor to the trex key it fills. ``check(expected)``
compares that against the model's shapes before a byte of data is read: missing shards,
truncated files, shapes that disagree with the config and scales that do not fit their weight
are all reported together, naming file and tensor. ``fill(key, out, region)`` then reads only
the tensors that overlap ``region`` of the key's full shape and writes them into ``out``,
dequantised to ``out.dtype``: a rank that owns rows [a, b) of a parameter reads just those.

A DeepSeek-V3 family checkpoint stores, in its MTP layer, copies of the embedding and head that trex shares
with the main model (``copies``): their shapes are checked with the headers, and ``fill`` of the embedding or
head compares each copy with what it read (a copy that differs is a ``CheckpointError``: trex would
silently give the MTP layer the main model's).

A V4.1 checkpoint also holds what trex does not train: the vision tower and the DSpark drafter's
stages (``passthrough``, with their scales); they are checked for nothing but presence and are copied
as they are when the model is saved in the official layout.
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from trex.checkpoint.errors import CheckpointError
from trex.checkpoint.naming import (LAYOUTS, Target, detect_layout, mtp_copy_of, scale_candidates, trex_targets,
                                    written_name)
from trex.checkpoint.safetensors_io import SafetensorsFile
from trex.kernels import quantize as quant
from trex.models.registry import architecture, config_from_file, with_overrides

Region = tuple[tuple[int, int], ...]
"""Per dim [start, stop) of a tensor's full (unsharded) shape."""
_COMPARE_BYTES = 64 * 2**20  # a copy (MTP's embedding, head) is compared with what was read in pieces this large
_STACKED = re.compile(r"\.ffn\.experts\.w[123]$")  # routed experts stacked [E, ...] in one trex tensor


def _numbers(key: str, expert: int | None) -> tuple[tuple[str, ...], list[int]]:
    """trex ``key`` (with routed expert ``expert``) as its kind (the name, numbers blanked) and its numbers."""
    parts = key.split(".")
    kind = tuple("#" if p.isdigit() else p for p in parts) + (("#",) if expert is not None else ())
    return kind, [int(p) for p in parts if p.isdigit()] + ([expert] if expert is not None else [])


def full_region(shape: Sequence[int]) -> Region:
    return tuple((0, int(n)) for n in shape)


def checkpoint_files(path: str) -> list[str]:
    """The safetensors files of a checkpoint directory (single file, or sharded with an index)."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        weight_map = read_index(index)
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not os.path.exists(os.path.join(path, f))]
        if missing:
            first = {f: next(k for k, v in weight_map.items() if v == f) for f in missing}
            detail = ", ".join(f"{f} (holds {k} ...)" for f, k in first.items())
            raise CheckpointError(f"{index}: names shard(s) that do not exist: {detail}")
        return [os.path.join(path, f) for f in files]
    single = os.path.join(path, "model.safetensors")
    if os.path.exists(single):
        return [single]
    found = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not found:
        raise CheckpointError(f"{path}: no model.safetensors, no index and no *.safetensors files")
    return [os.path.join(path, f) for f in found]


def read_index(index: str) -> dict[str, str]:
    """The ``weight_map`` (tensor name -> shard file) of a ``model.safetensors.index.json``."""
    try:
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"{index}: not a safetensors index ({e})") from None
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index}: weight_map is not an object")
    return weight_map


@dataclass(frozen=True)
class Source:
    """One checkpoint tensor feeding (part of) a trex key, with its block scale if quantised."""

    file: SafetensorsFile
    name: str
    target: Target
    scale_file: SafetensorsFile | None = None
    scale: str | None = None

    @property
    def where(self) -> str:
        return f"{self.file.path}: {self.name}"

    @property
    def stored_shape(self) -> tuple[int, ...]:
        return self.file.tensors[self.name].shape

    @property
    def codec(self) -> str:
        """plain, fp8 (e4m3 + block scales: ue8m0 128x128, 32x32 or 1x32; V3's fp32 128x128) or fp4 (packed
        e2m1 + 1x32 scales)."""
        if self.scale is None:
            return "plain"
        return "fp4" if self.file.tensors[self.name].dtype in (torch.int8, torch.uint8) else "fp8"


@dataclass
class Diagnosis:
    """problems: every error (file and tensor named); missing: the tensors a loadable checkpoint would hold
    that this one lacks (required trex keys absent, routed experts absent from a stacked one), by the names the
    checkpoint would store them under (`CheckpointReader.stored_name`); missing_optional: optional trex keys
    absent (MTP); unexpected: checkpoint names the model lacks."""

    problems: list[str]
    missing: list[str]
    missing_optional: list[str]
    unexpected: list[str]


def problems_error(what: str, problems: Sequence[str], path: str, shown: int = 5) -> CheckpointError:
    """One line: ``cannot load <what>: p1; p2; ...``, the first ``shown`` problems and how many more (which
    ``trex ckpt inspect`` lists)."""
    more = len(problems) - shown
    tail = f"; and {more} more (`trex ckpt inspect {path}` lists them)" if more > 0 else ""
    return CheckpointError(f"cannot load {what}: " + "; ".join(problems[:shown]) + tail)


class CheckpointReader:
    """Headers, scales and trex keys of a checkpoint directory; data is read by ``fill``."""

    def __init__(self, path: str, layout: str = "auto", overrides: dict | None = None):
        """``overrides``: config fields set on top of the checkpoint's config.json (a recipe's
        ``model.overrides``, e.g. ``num_nextn_predict_layers = 0`` for a checkpoint without MTP weights); the
        tensors are then checked against the model that config builds."""
        if layout not in ("auto", *LAYOUTS):
            raise CheckpointError(f"layout must be auto, {' or '.join(LAYOUTS)}; got {layout!r}")
        self.path = path
        self.config = with_overrides(config_from_file(path), overrides or {}, f"{path}: model.overrides")
        self.files = [SafetensorsFile(f) for f in checkpoint_files(path)]
        self.problems: list[str] = []
        located: dict[str, SafetensorsFile] = {}
        for file in self.files:
            for name in file.keys():
                if name in located:
                    self.problems.append(f"{file.path}: {name}: also in {located[name].path}")
                located[name] = file
        self._check_index(located)
        self.located = located
        self.layout = detect_layout(list(located)) if layout == "auto" else layout
        self.sources: dict[str, list[Source]] = {}
        scale_of = {n: c for n in located for c in scale_candidates(n) if c in located and c != n}
        scales = set(scale_of.values())
        # what the architecture carries untrained (Architecture.passthrough; V4.1's vision tower and DSpark
        # stages): carried through, not loaded into the model (names with their files); the drafter stages'
        # sources are kept apart, for the drafter (``load_drafter``)
        self.passthrough: dict[str, SafetensorsFile] = {}
        self.drafter_sources: dict[str, list[Source]] = {}
        self.copies: dict[str, list[Source]] = {}  # trex key -> tensors that duplicate it (V3's MTP embed, head)
        arch, n_layers = self.config.architecture, self.config.num_hidden_layers
        carried = architecture(self.config).passthrough
        if carried is not None:
            self.passthrough = {n: f for n, f in located.items() if carried.match(n)}
        for name, file in located.items():
            drafter = name in self.passthrough and name.startswith("mtp.")
            if name in scales or (name in self.passthrough and not drafter):
                continue
            scale = scale_of.get(name)
            problem = self._codec_problem(file, name, scale)
            if problem:
                self.problems.append(f"{file.path}: {name}: {problem}")
                continue
            copy_of = mtp_copy_of(name, self.layout, arch, n_layers)
            if copy_of is not None:
                self.copies.setdefault(copy_of, []).append(
                    Source(file, name, Target(copy_of), located[scale] if scale else None, scale))
            for target in trex_targets(name, self.layout, arch, n_layers):
                (self.drafter_sources if drafter else self.sources).setdefault(target.key, []).append(
                    Source(file, name, target, located[scale] if scale else None, scale))
        self.quantized = sorted({s.codec for srcs in self.sources.values() for s in srcs} - {"plain"})
        self._kinds: dict[int, dict] = {}  # stored_name's index of the tensors of each kind

    def _check_index(self, located: Mapping[str, SafetensorsFile]) -> None:
        index = os.path.join(self.path, "model.safetensors.index.json")
        if not os.path.exists(index):
            return
        for name, shard in read_index(index).items():
            file = located.get(name)
            if file is None:
                self.problems.append(f"{index}: {name}: listed in shard {shard} but not in it")
            elif os.path.basename(file.path) != shard:
                self.problems.append(f"{index}: {name}: listed in {shard} but found in {file.path}")

    @staticmethod
    def _codec_problem(file: SafetensorsFile, name: str, scale: str | None) -> str | None:
        dtype = file.tensors[name].dtype
        if scale is None and dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            return f"{dtype} weight without a block scale (looked for {' or '.join(scale_candidates(name))})"
        if scale is not None and dtype not in (torch.float8_e4m3fn, torch.int8, torch.uint8):
            return f"has block scale {scale} but dtype {dtype} is neither FP8 (e4m3) nor packed FP4 (int8)"
        return None

    # ---- validation ------------------------------------------------------------------------
    def diagnose(self, expected: Mapping[str, Sequence[int]], optional_prefixes: tuple[str, ...] = ("mtp.",),
                 drafter: bool = False) -> Diagnosis:
        """Everything wrong with this checkpoint for a model of ``expected`` shapes (trex key ->
        full shape), from the headers alone; ``drafter``: for V4.1's DSpark drafter, from its stages."""
        problems = list(self.problems)
        unexpected = []
        available = self.drafter_sources if drafter else self.sources
        for key, sources in available.items():
            if key not in expected:
                unexpected += [s.name for s in sources]
                problems += [f"{s.where}: unexpected tensor (the model has no {key})" for s in sources]
                continue
            problems += [p for s in sources if (p := self._shape_problem(s, tuple(expected[key])))]
            problems += self._coverage_problems(key, sources)
        for key, copies in self.copies.items():
            problems += [p for s in copies if key in expected and (p := self._shape_problem(s, tuple(expected[key])))]
        optional = [k for k in expected if k not in available and k.startswith(optional_prefixes)]
        missing: list[str] = []
        for key, shape in expected.items():
            if key not in available and key.startswith(optional_prefixes):
                continue
            experts = {s.target.expert for s in available.get(key, ())}
            if key not in available:
                stacked = _STACKED.search(key) is not None
                missing += self._stored_names(key, range(shape[0]) if stacked else [None], available)
            elif None not in experts:  # routed experts, one tensor each: those not there
                missing += self._stored_names(key, [j for j in range(shape[0]) if j not in experts], available)
        if missing:
            problems.append(f"{self.path}: missing tensor(s): {missing[:20]}{' ...' if len(missing) > 20 else ''}")
        return Diagnosis(problems, missing, optional, unexpected)

    def check(self, expected: Mapping[str, Sequence[int]], optional_prefixes: tuple[str, ...] = ("mtp.",)
              ) -> list[str]:
        """Raise ``CheckpointError`` naming the problems in one line (see ``diagnose``, `problems_error`);
        returns the optional keys (e.g. MTP) that the checkpoint lacks."""
        d = self.diagnose(expected, optional_prefixes)
        if d.problems:
            raise problems_error("checkpoint", d.problems, self.path)
        return d.missing_optional

    def stored_name(self, key: str, expert: int | None = None,
                    available: Mapping[str, list[Source]] | None = None) -> str:
        """The name under which this checkpoint holds, or would hold, trex tensor ``key`` (routed expert ``expert``
        of a stacked one): that of a tensor it holds of the same kind (another expert, another layer), its
        numbers moved to ``key``'s, so that it follows the file's own naming; else the name trex writes in
        its layout."""
        available = self.sources if available is None else available
        if id(available) not in self._kinds:  # kind -> (numbers, name) of the first tensor of that kind
            kinds: dict[tuple[str, ...], tuple[list[int], str]] = {}
            for other, sources in available.items():
                for s in sources:
                    kind, have = _numbers(other, s.target.expert)
                    if sum(part.isdigit() for part in s.name.split(".")) == len(have):
                        kinds.setdefault(kind, (have, s.name))
            self._kinds[id(available)] = kinds
        kind, want = _numbers(key, expert)
        if kind not in self._kinds[id(available)]:
            return self._written_name(key, expert)
        have, name = self._kinds[id(available)][kind]
        parts = name.split(".")
        for i, w, h in zip([i for i, part in enumerate(parts) if part.isdigit()], want, have):
            parts[i] = str(int(parts[i]) + w - h)
        return ".".join(parts)

    def _stored_names(self, key: str, experts, available: Mapping[str, list[Source]]) -> list[str]:
        """`stored_name` of each of ``experts`` (None: the whole tensor) of ``key``, each once (transformers'
        fused expert tensors hold them all)."""
        return list(dict.fromkeys(self.stored_name(key, j, available) for j in experts))

    def _written_name(self, key: str, expert: int | None) -> str:
        """What trex writes ``key`` as in this checkpoint's layout (`trex.checkpoint.layouts`)."""
        return written_name(key, self.layout, self.config.architecture, self.config.num_hidden_layers, expert)

    def logical_shape(self, source: Source, cols: int | None = None) -> tuple[int, ...]:
        """Shape of ``source`` once dequantised (FP4 needs the column count; default 2x packed)."""
        shape = source.stored_shape
        if source.codec == "fp4":
            return (*shape[:-1], cols if cols is not None else 2 * shape[-1])
        return shape

    def _shape_problem(self, s: Source, full: tuple[int, ...]) -> str | None:
        t = s.target
        want = full[1:] if t.expert is not None else full
        if t.half is not None:
            want = (full[0], 2 * full[1], *full[2:])
        shape = self.logical_shape(s, cols=want[-1] if want else None)
        if shape != want:
            return f"{s.where}: shape {shape} does not match the config's {want} for {t.key}"
        if t.expert is not None and not 0 <= t.expert < full[0]:
            return f"{s.where}: expert index {t.expert} out of range for {t.key} with {full[0]} experts"
        scale_shape = s.scale_file.tensors[s.scale].shape if s.scale else None
        if s.codec == "fp8":
            problem = quant.check_fp8_scale(shape, scale_shape)
        elif s.codec == "fp4":
            problem = quant.check_fp4(s.stored_shape, scale_shape, shape[-1])
        else:
            return None
        return f"{s.where}: {problem} (scale tensor {s.scale} in {s.scale_file.path})" if problem else None

    def _coverage_problems(self, key: str, sources: list[Source]) -> list[str]:
        """A trex key filled by more than one whole tensor, by a whole tensor and experts, or by an expert twice
        (experts that are absent: ``diagnose``'s missing)."""
        experts = [s.target.expert for s in sources if s.target.expert is not None]
        whole = [s for s in sources if s.target.expert is None]
        if len(whole) > 1 or (whole and experts):
            return [f"{self.path}: {key}: given more than once ({', '.join(s.where for s in sources)})"]
        count = Counter(experts)
        twice = sorted({s.name for s in sources if s.target.expert is not None and count[s.target.expert] > 1})
        return [f"{self.path}: an expert of {key} given twice: {', '.join(twice)}"] if twice else []

    # ---- data ------------------------------------------------------------------------------
    def stored(self, name: str) -> torch.Tensor | None:
        """Checkpoint tensor ``name`` as stored (its own dtype, nothing converted), or None if absent."""
        file = self.located.get(name)
        return None if file is None else file.read(name)

    def fill(self, key: str, full_shape: Sequence[int], out: torch.Tensor, region: Region | None = None) -> None:
        """Write ``region`` (default: all) of trex tensor ``key`` of shape ``full_shape`` into
        ``out`` (shaped like the region), reading only the checkpoint tensors that overlap it."""
        region = region or full_region(full_shape)
        for source in self.sources.get(key) or self.drafter_sources[key]:
            self._fill_from(source, tuple(full_shape), out, region)
        for copy in self.copies.get(key, ()):
            self._compare_copy(copy, key, tuple(full_shape), out, region)

    def _compare_copy(self, copy: Source, key: str, full: tuple[int, ...], out: torch.Tensor, region: Region) -> None:
        """CheckpointError unless ``copy`` holds, in ``region``, what ``out`` was filled with; read a block
        of rows at a time (memory: ``_COMPARE_BYTES``, not a second tensor)."""
        (start, stop), rest = region[0], region[1:]
        row_bytes = max(1, out[:1].numel() * out.element_size())
        step = max(1, _COMPARE_BYTES // row_bytes)
        for a in range(start, stop, step):
            b = min(stop, a + step)
            piece = torch.empty((b - a, *out.shape[1:]), dtype=out.dtype)
            self._fill_from(copy, full, piece, ((a, b), *rest))
            if not torch.equal(piece, out[a - start:b - start].to(piece.device)):
                main = ", ".join(s.where for s in self.sources[key])
                raise CheckpointError(f"{copy.where}: differs from {main} (rows {a}-{b}): the MTP layer's copy of "
                                      f"{key} must equal the main model's, which trex shares with the MTP layer")

    def read(self, key: str, full_shape: Sequence[int], dtype: torch.dtype, region: Region | None = None
             ) -> torch.Tensor:
        """Region (default: all) of trex tensor ``key`` as a new CPU tensor of ``dtype``."""
        region = region or full_region(full_shape)
        out = torch.empty([b - a for a, b in region], dtype=dtype)
        self.fill(key, full_shape, out, region)
        return out

    def _fill_from(self, s: Source, full: tuple[int, ...], out: torch.Tensor, region: Region) -> None:
        t = s.target
        origin = [0] * len(full)
        extent = list(full)
        if t.expert is not None:
            origin[0], extent[0] = t.expert, t.expert + 1
        inter = [(max(a, o), min(b, e)) for (a, b), o, e in zip(region, origin, extent)]
        if any(a >= b for a, b in inter):
            return  # nothing of this tensor lies in the region: not read at all
        if s.codec == "plain" and t.expert is None:
            value = s.file.read(s.name, rows=inter[0])  # only the rows in the region
            origin[0] = inter[0][0]
        else:
            value = self._dequantized(s, out.dtype, cols=full[-1])
        if t.half is not None:
            inter_dim = value.shape[1] // 2
            value = value[:, t.half * inter_dim:(t.half + 1) * inter_dim]
        if t.expert is not None:
            value = value.unsqueeze(0)
        src = tuple(slice(a - o, b - o) for (a, b), o in zip(inter, origin))
        dst = tuple(slice(a - r, b - r) for (a, b), (r, _) in zip(inter, region))
        with torch.no_grad():
            out[dst].copy_(value[src])

    def _dequantized(self, s: Source, dtype: torch.dtype, cols: int) -> torch.Tensor:
        weight = s.file.read(s.name)
        if s.codec == "plain":
            return weight
        scale = s.scale_file.read(s.scale)
        try:
            if s.codec == "fp8":
                return quant.dequantize_fp8(weight, scale, dtype)
            return quant.dequantize_fp4(weight, scale, cols=cols, dtype=dtype)
        except quant.QuantFormatError as e:
            raise CheckpointError(f"{s.where}: {e}") from None
