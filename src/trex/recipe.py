"""Typed recipes: TOML files loaded into nested dataclasses, with command-line overrides.

A recipe is a dataclass whose fields are section dataclasses (``[data]``, ``[optim]`` ...), each
holding plain values (str, int, float, bool, lists, dicts, optional values). Loading checks every
key: an unknown one is an error naming the file and suggesting the closest valid key, and a value
of the wrong type names the key and the type expected.

    recipe = load(Recipe, "recipes/sft.toml", overrides=["optim.lr=1e-4", "train.steps=10"])
    save(recipe, "runs/x/config.toml")
"""

from __future__ import annotations

import dataclasses
import difflib
import tomllib
import types
import typing
from typing import Any, TypeVar

import tomli_w

from trex import atomic

T = TypeVar("T")


class RecipeError(ValueError):
    """A recipe or override that does not fit the typed config; the message names the key. ``key``: the dotted
    key, when a section's own check raises it (`from_dict` then names what set that key)."""

    def __init__(self, message: str, key: str | None = None):
        super().__init__(message)
        self.key = key


def load(cls: type[T], path: str | None = None, overrides: list[str] | None = None,
         base: dict | None = None) -> T:
    """Build ``cls`` from its defaults (or ``base``), then the TOML file at ``path``, then ``overrides``.

    Values merge key by key, so overriding one field of a section keeps that section's other defaults.
    An error in a value set by an override names the override (``--set train.steps=ten``), not the file.
    """
    raw: dict = _deep_copy(base if base is not None else to_dict(cls()))
    source = "<defaults>"
    if path is not None:
        source = path
        try:
            with open(path, "rb") as f:
                _merge(raw, tomllib.load(f))
        except FileNotFoundError:
            raise RecipeError(f"{path}: no such recipe file") from None
        except tomllib.TOMLDecodeError as e:
            raise RecipeError(f"{path}: invalid TOML: {e}") from None
    origins: dict[str, str] = {}
    for item in overrides or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise RecipeError(f"override {item!r}: expected section.key=value")
        _check_key(cls, key.strip().split("."), f"--set {item}")
        _set_path(raw, key.strip().split("."), _parse_value(value.strip()))
        origins[key.strip()] = f"--set {item}"
    return from_dict(cls, raw, source, origins=origins)


def _check_key(cls: type, parts: list[str], where: str) -> None:
    """An override's dotted key must name a field (down to a table-valued one, whose keys are free);
    the error names the override, not the recipe file, and suggests the closest key."""
    for depth, part in enumerate(parts):
        fields = {f.name: f for f in dataclasses.fields(cls)}
        if part not in fields:
            raise RecipeError(f"{where}: {unknown_key(part, fields, ''.join(f'{p}.' for p in parts[:depth]))}")
        hint = typing.get_type_hints(cls)[part]
        if not dataclasses.is_dataclass(hint):
            return
        cls = hint


def _where(source: str, origins: dict[str, str] | None, key: str) -> str:
    """What set ``key`` (dotted, maybe with a list index): the ``--set`` override that set it or a
    table above it, else the recipe file ``source``."""
    parts = key.split("[", 1)[0].split(".")
    for n in range(len(parts), 0, -1):
        if origins and ".".join(parts[:n]) in origins:
            return origins[".".join(parts[:n])]
    return source


def unknown_key(key: str, known, prefix: str = "") -> str:
    """What every unknown recipe key says: ``unknown key `<prefix><key>`; did you mean `<prefix><closest>`?``, or
    the valid keys (``known``) when none is close. A section that checks the keys of one of its free tables
    itself (``model.overrides``) raises it in ``__post_init__`` as a RecipeError with the key, which `from_dict`
    prefixes with the override or file that set it."""
    close = difflib.get_close_matches(key, list(known), n=1)
    hint = f"; did you mean `{prefix}{close[0]}`?" if close else f"; valid keys: {sorted(known)}"
    return f"unknown key `{prefix}{key}`{hint}"


def from_dict(cls: type[T], raw: dict, source: str = "<dict>", prefix: str = "",
              origins: dict[str, str] | None = None) -> T:
    """``cls`` from ``raw``, every key and value checked; ``origins`` (dotted key -> the ``--set``
    that set it) makes an error name the override rather than ``source``."""
    if not isinstance(raw, dict):
        raise RecipeError(f"{_where(source, origins, prefix.rstrip('.'))}: `{prefix.rstrip('.') or 'recipe'}` must be a "
                          f"table, got {raw!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in raw.items():
        if key not in fields:
            raise RecipeError(f"{source}: {unknown_key(key, fields, prefix)}")
        kwargs[key] = _coerce(hints[key], value, source, f"{prefix}{key}", origins)
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:  # a section's own check names its key: blame the override that set it
        if isinstance(e, RecipeError) and e.key:  # the message names the key in full (`unknown_key`)
            raise RecipeError(f"{_where(source, origins, e.key)}: {e}") from None
        named = [k for k in raw if f"{prefix}{k}" in str(e)]
        where = _where(source, origins, f"{prefix}{named[0]}") if named else source
        raise RecipeError(f"{where}: `{prefix.rstrip('.') or cls.__name__}`: {e}") from None


def to_dict(obj: Any) -> dict:
    """The recipe as plain TOML-able data (None values dropped: TOML has no null)."""
    def clean(v):
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items() if x is not None}
        if isinstance(v, list):
            return [clean(x) for x in v]
        return v

    return clean(dataclasses.asdict(obj))


def save(obj: Any, path: str) -> None:
    """Write the resolved recipe atomically as TOML."""
    atomic.write_text(path, tomli_w.dumps(to_dict(obj)))


# ---- helpers ------------------------------------------------------------------------------------
def check_choices(section: Any, prefix: str) -> None:
    """Raise ValueError for the first field typed ``Literal[...]`` whose value is not one of its
    choices: ``prefix.name = value; expected one of a, b, c``. Sections call it in ``__post_init__``,
    so one built in Python is checked like one loaded from TOML (where ``from_dict`` checks first)."""
    hints = typing.get_type_hints(type(section))
    for f in dataclasses.fields(section):
        if typing.get_origin(hints[f.name]) is typing.Literal:
            choices, value = typing.get_args(hints[f.name]), getattr(section, f.name)
            if value not in choices:
                raise ValueError(f"{prefix}.{f.name} = {value!r}; expected one of {', '.join(map(str, choices))}")


def require_positive(section: Any, prefix: str, names: tuple[str, ...]) -> None:
    """Raise ValueError naming ``prefix.name`` for each of ``names`` whose value is below 1."""
    for name in names:
        value = getattr(section, name)
        if value < 1:
            raise ValueError(f"{prefix}.{name} must be >= 1, got {value}")


def _coerce(hint: Any, value: Any, source: str, key: str, origins: dict[str, str] | None) -> Any:
    origin = typing.get_origin(hint)
    if dataclasses.is_dataclass(hint):
        return from_dict(hint, value, source, prefix=f"{key}.", origins=origins)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(arg, value, source, key, origins)
            except RecipeError as e:
                errors.append(str(e))
        raise RecipeError(errors[0])
    if origin is typing.Literal:
        if value not in typing.get_args(hint):
            raise RecipeError(f"{_where(source, origins, key)}: `{key}` must be one of {list(typing.get_args(hint))}, "
                              f"got {value!r}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise RecipeError(f"{_where(source, origins, key)}: `{key}` must be a list, got {value!r}")
        (item,) = typing.get_args(hint) or (Any,)
        return [_coerce(item, v, source, f"{key}[{i}]", origins) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise RecipeError(f"{_where(source, origins, key)}: `{key}` must be a table, got {value!r}")
        return dict(value)
    if hint is Any:
        return value
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint in (int, float, str, bool):
        if isinstance(value, hint) and not (hint is int and isinstance(value, bool)):
            return value
        raise RecipeError(f"{_where(source, origins, key)}: `{key}` must be {hint.__name__}, got {value!r}")
    return value


def _parse_value(text: str) -> Any:
    """Parse an override value as a TOML value, falling back to a bare string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _set_path(raw: dict, keys: list[str], value: Any) -> None:
    node = raw
    for k in keys[:-1]:
        node = node.setdefault(k, {})
        if not isinstance(node, dict):
            raise RecipeError(f"override {'.'.join(keys)}: `{k}` is not a section")
    node[keys[-1]] = value


def _merge(dst: dict, src: dict) -> None:
    for k, v in src.items():
        if isinstance(v, dict) and isinstance(dst.get(k), dict):
            _merge(dst[k], v)
        else:
            dst[k] = v


def _deep_copy(d: dict) -> dict:
    return {k: _deep_copy(v) if isinstance(v, dict) else v for k, v in d.items()}
