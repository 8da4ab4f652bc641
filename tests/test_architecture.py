"""The interface each family fills (trex.models.common.architecture): every registered Architecture names
implementations that exist and answer for its own configs."""

from __future__ import annotations

import dataclasses

import pytest

from trex.models.common.architecture import Architecture
from trex.models.registry import ARCHITECTURES, PRESETS, architecture, get_preset

PARTS = [f.name for f in dataclasses.fields(Architecture) if f.type in ("str", "str | None") and f.name != "name"]
BY_ARCH = {}
for _name in PRESETS:
    if _name.startswith("tiny"):
        BY_ARCH.setdefault(get_preset(_name).architecture, _name)


def test_every_architecture_has_a_tiny_preset_and_its_own_name():
    assert set(BY_ARCH) == set(ARCHITECTURES)
    assert all(name == a.name for name, a in ARCHITECTURES.items())


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_every_named_part_loads_and_answers_for_the_familys_config(arch):
    spec, cfg = ARCHITECTURES[arch], get_preset(BY_ARCH[arch])
    assert architecture(cfg) is spec
    for part in PARTS:
        target = getattr(spec, part)
        assert target is None or spec.load(part) is not None, (arch, part, target)
    assert spec.load("flops")(cfg, 64, True, True).total > 0
    assert spec.drafter_kind(cfg) in (None, "mtp", "dspark")
    split = spec.load("split_rule")
    assert split.shardable_length(cfg, 64, 2) >= 64


def test_an_unset_optional_part_loads_as_none():
    spec = dataclasses.replace(ARCHITECTURES["deepseek_v3"], drafter=None)
    assert spec.load("drafter") is None
