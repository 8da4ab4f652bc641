"""Typed recipes: TOML + overrides into dataclasses, with errors that name the key."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

import pytest

from trex.recipe import RecipeError, load, save


@dataclass
class Optim:
    name: Literal["adamw", "muon"] = "adamw"
    lr: float = 1e-3
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])


@dataclass
class Train:
    steps: int = 10
    out: str | None = None
    mtp_weight: float = 0.1

    def __post_init__(self):
        if self.steps < 1:
            raise ValueError(f"train.steps must be >= 1, got {self.steps}")


@dataclass
class Recipe:
    optim: Optim = field(default_factory=Optim)
    train: Train = field(default_factory=Train)


def test_toml_then_overrides_then_round_trip(tmp_path):
    path = tmp_path / "r.toml"
    path.write_text('[optim]\nname = "muon"\nlr = 2\n[train]\nsteps = 5\n')
    r = load(Recipe, str(path), overrides=["train.steps=7", "optim.betas=[0.8, 0.9]", "train.out=runs/a"])
    assert r.optim == Optim(name="muon", lr=2.0, betas=[0.8, 0.9])
    assert r.train.steps == 7 and r.train.out == "runs/a" and isinstance(r.optim.lr, float)
    save(r, str(tmp_path / "resolved.toml"))
    assert load(Recipe, str(tmp_path / "resolved.toml")) == r


def test_unknown_key_suggests_the_closest(tmp_path):
    path = tmp_path / "r.toml"
    path.write_text("[optim]\nlearning_rate = 1\n")
    with pytest.raises(RecipeError, match=r"r.toml: unknown key `optim.learning_rate`"):
        load(Recipe, str(path))
    with pytest.raises(RecipeError,
                       match=r"^--set train.step=3: unknown key `train.step`; did you mean `train.steps`\?"):
        load(Recipe, str(path), overrides=["train.step=3"])  # blamed on the override, not the file
    with pytest.raises(RecipeError, match=r"unknown key `optimizer`; did you mean `optim`\?"):
        load(Recipe, overrides=["optimizer.lr=3"])


def test_wrong_types_and_bad_syntax_are_named(tmp_path):
    with pytest.raises(RecipeError, match=r"`train.steps` must be int, got 'ten'"):
        load(Recipe, overrides=["train.steps=ten"])
    with pytest.raises(RecipeError, match=r"`optim.name` must be one of \['adamw', 'muon'\]"):
        load(Recipe, overrides=["optim.name=sgd"])
    with pytest.raises(RecipeError, match="expected section.key=value"):
        load(Recipe, overrides=["train.steps"])
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\nsteps = 1\n")
    with pytest.raises(RecipeError, match="bad.toml: invalid TOML"):
        load(Recipe, str(bad))


def test_a_bad_override_is_blamed_on_the_override_not_the_recipe_file(tmp_path):
    recipe = tmp_path / "r.toml"
    recipe.write_text("[train]\nsteps = 5\n[optim]\nlr = 0.1\n")
    for override, said in [('train.steps="ten"', r"`train.steps` must be int"),
                           ("optim.name=sgd", r"`optim.name` must be one of"),
                           ("train.steps=0", r"train.steps must be >= 1")]:
        with pytest.raises(RecipeError) as caught:
            load(Recipe, str(recipe), overrides=[override])
        assert str(caught.value).startswith(f"--set {override}: "), caught.value
        assert re.search(said, str(caught.value)) and "r.toml" not in str(caught.value)
    recipe.write_text('[train]\nsteps = "five"\n')  # the file's own mistake still names the file
    with pytest.raises(RecipeError, match=r"r.toml: `train.steps` must be int"):
        load(Recipe, str(recipe), overrides=["optim.lr=0.2"])


@dataclass
class Task:
    digits: int = 2
    n: int = 10


@dataclass
class Job:
    task: Task = field(default_factory=lambda: Task(digits=3, n=50))


def test_overriding_one_field_keeps_the_sections_other_defaults():
    assert load(Job, overrides=["task.n=7"]).task == Task(digits=3, n=7)


def test_docs_training_names_every_recipe_section_and_where_it_is_defined():
    import dataclasses
    import os
    import re
    import typing

    from trex.train.config import TrainRecipe

    doc = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "training.md")).read()
    stated = dict(re.findall(r"^\| `\[(\w+)\]` \|[^|]*\| `([\w.]+)`", doc, re.M))
    hints = typing.get_type_hints(TrainRecipe)
    actual = {f.name: f"{hints[f.name].__module__}.{hints[f.name].__name__}" for f in dataclasses.fields(TrainRecipe)}
    assert stated == actual
    assert all(name.endswith("Section") for name in actual.values())  # one naming scheme
