"""load_pretrained on broken checkpoints: every problem is named before anything is returned."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from hf_oracle import hf_config, random_hf_model
from trex.checkpoint import CheckpointError, load_pretrained


@pytest.fixture()
def saved(tmp_path):
    random_hf_model(hf_config(), seed=0).save_pretrained(tmp_path)
    return tmp_path


def _rewrite(path, edit):
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def test_missing_tensor_is_named_as_the_file_names_it(saved):
    _rewrite(saved, lambda t: t.pop("model.layers.2.attn.wq_a.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor\(s\): \['model.layers.2.attn.wq_a.weight'\]$"):
        load_pretrained(str(saved), dtype=torch.float32, device="cpu")


def test_missing_experts_are_named_as_the_file_names_them(saved):
    """An expert of a stacked trex tensor by its own name in the file; a layer's experts all gone, each."""
    def edit(t):
        t.pop("model.layers.1.ffn.experts.5.w2.weight")
        for j in range(8):
            t.pop(f"model.layers.2.ffn.experts.{j}.w3.weight")

    _rewrite(saved, edit)
    with pytest.raises(CheckpointError) as err:
        load_pretrained(str(saved), dtype=torch.float32, device="cpu")
    want = ["model.layers.1.ffn.experts.5.w2.weight", *(f"model.layers.2.ffn.experts.{j}.w3.weight" for j in range(8))]
    assert f"missing tensor(s): {want}" in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_misshaped_tensor_names_file_key_and_shapes(saved):
    def edit(t):
        t["model.layers.0.attn.wkv.weight"] = torch.zeros(16, 64)

    _rewrite(saved, edit)
    with pytest.raises(CheckpointError) as err:
        load_pretrained(str(saved), dtype=torch.float32, device="cpu")
    msg = str(err.value)
    assert "model.safetensors: model.layers.0.attn.wkv.weight: shape (16, 64)" in msg
    assert "(32, 64)" in msg


def test_unexpected_tensor_is_named(saved):
    _rewrite(saved, lambda t: t.__setitem__("model.layers.0.attn.extra.weight", torch.zeros(2)))
    with pytest.raises(CheckpointError, match="model.layers.0.attn.extra.weight: unexpected tensor"):
        load_pretrained(str(saved), dtype=torch.float32, device="cpu")


def test_index_naming_a_missing_shard(saved):
    (saved / "model.safetensors").rename(saved / "model-00001-of-00002.safetensors")
    index = {"metadata": {}, "weight_map": {"a": "model-00001-of-00002.safetensors",
                                            "b": "model-00002-of-00002.safetensors"}}
    (saved / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"model-00002-of-00002.safetensors"):
        load_pretrained(str(saved), dtype=torch.float32, device="cpu")
