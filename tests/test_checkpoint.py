"""Checkpoint save / load / convert: round trips, quantised exports, bad input, sharded loading."""

from __future__ import annotations

import glob
import json
import os
import re

import pytest
import torch

from trex.checkpoint import writer
from trex.checkpoint import load_pretrained, save_pretrained
from trex.checkpoint.errors import CheckpointError
from trex.checkpoint.naming import Target, hf_name, official_name, trex_targets
from trex.checkpoint.reader import CheckpointReader
from trex.checkpoint.safetensors_io import SafetensorsFile
from trex.checkpoint.save import convert
from trex.kernels import quantize as quant
from trex.models import build_model
from trex.models.deepseek_v4.config import tiny


@pytest.fixture(scope="module")
def model():
    return build_model(tiny(), seed=0, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))


def _state(m):
    return {**dict(m.named_parameters()), **dict(m.named_buffers())}


def _tensors(path):
    out = {}
    for f in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        file = SafetensorsFile(f)
        out.update({k: file.read(k) for k in file.keys()})
    return out


def _logits(m, ids):
    with torch.no_grad():
        return m(ids).logits


def _bits(t):
    return t.contiguous().view(torch.uint8) if t.dtype.is_floating_point else t


# ---- naming ---------------------------------------------------------------------------------
def test_every_trex_name_round_trips_through_both_layouts(model):
    for key in _state(model):
        m = re.match(r"^(.*\.experts)\.(w[123])$", key)
        if m:
            assert trex_targets(official_name(key, 5), "official") == [Target(key, expert=5)]
            half = {"w1": 0, "w3": 1}.get(m.group(2))
            want = [Target(key)] if half is None else [t for t in trex_targets(hf_name(key), "hf") if t.half == half]
            assert trex_targets(hf_name(key), "hf") == [Target(key)] if half is None else want == [Target(key, half=half)]
        else:
            assert trex_targets(official_name(key), "official") == [Target(key)], key
            assert trex_targets(hf_name(key), "hf") == [Target(key)], key


def test_hf_names_are_transformers_module_names(model):
    from hf_oracle import hf_config, random_hf_model

    hf = random_hf_model(hf_config(vocab_size=256))
    hf_keys = {k for k in hf.state_dict() if "rotary_emb" not in k}
    ours = {hf_name(k) for k in _state(model) if not k.startswith("mtp.")}
    assert ours == hf_keys


# ---- lossless round trips -----------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["hf", "official"])
def test_fp32_save_load_is_bit_identical(model, ids, tmp_path, layout):
    save_pretrained(model, tmp_path / "ck", layout=layout, dtype="fp32", max_shard_size="200KB")
    assert len(glob.glob(str(tmp_path / "ck" / "model-*.safetensors"))) > 1
    index = json.loads((tmp_path / "ck" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(_tensors(tmp_path / "ck"))
    loaded = load_pretrained(str(tmp_path / "ck"), dtype=torch.float32, device="cpu")
    a, b = _state(model), _state(loaded)
    assert a.keys() == b.keys() and all(torch.equal(_bits(a[k]), _bits(b[k])) for k in a)
    assert torch.equal(_logits(model, ids), _logits(loaded, ids))
    assert CheckpointReader(str(tmp_path / "ck")).layout == layout


def test_bf16_save_load_is_bit_identical(model, ids, tmp_path):
    m16 = build_model(tiny(), seed=0, dtype=torch.bfloat16).eval()
    save_pretrained(m16, tmp_path / "ck", layout="official", dtype="bf16")
    on_disk = _tensors(tmp_path / "ck")
    assert on_disk["layers.1.attn.wq_a.weight"].dtype == torch.bfloat16
    assert on_disk["layers.1.hc_attn_fn"].dtype == torch.float32  # mHC stays fp32 on disk
    loaded = load_pretrained(str(tmp_path / "ck"), dtype=torch.bfloat16, device="cpu")
    a, b = _state(m16), _state(loaded)
    assert all(torch.equal(_bits(a[k]), _bits(b[k])) for k in a)
    assert torch.equal(_logits(m16, ids), _logits(loaded, ids))


def test_hf_official_hf_conversion_is_bit_identical(model, tmp_path):
    save_pretrained(model, tmp_path / "hf", layout="hf", dtype="fp32")
    convert(str(tmp_path / "hf"), str(tmp_path / "off"), layout="official", dtype="fp32", max_shard_size="300KB")
    convert(str(tmp_path / "off"), str(tmp_path / "hf2"), layout="hf", dtype="fp32")
    first, second, off = _tensors(tmp_path / "hf"), _tensors(tmp_path / "hf2"), _tensors(tmp_path / "off")
    assert first.keys() == second.keys()
    assert all(torch.equal(_bits(first[k]), _bits(second[k])) for k in first)
    assert "layers.1.ffn.experts.7.w3.weight" in off and "mtp.0.hc_head_fn" in off  # per expert, MTP kept
    assert not any(k.startswith("model.") for k in off)


# ---- quantised export ---------------------------------------------------------------------------
def test_official_fp8_fp4_export(model, ids, tmp_path):
    save_pretrained(model, tmp_path / "q", layout="official", dtype="fp32", quantize="fp8+fp4experts")
    disk = _tensors(tmp_path / "q")
    cfg = json.loads((tmp_path / "q" / "config.json").read_text())
    assert cfg["quantization_config"]["weight_block_size"] == [128, 128] and cfg["expert_dtype"] == "fp4"
    assert disk["layers.1.attn.wq_a.weight"].dtype == torch.float8_e4m3fn
    assert disk["layers.1.attn.wq_a.scale"].dtype == torch.float8_e8m0fnu
    assert disk["layers.1.ffn.experts.3.w2.weight"].dtype == torch.int8
    assert disk["layers.1.ffn.experts.3.w2.weight"].shape == (64, 16)  # [d, I/2]
    assert disk["mtp.0.e_proj.weight"].dtype == torch.float8_e4m3fn
    for plain in ("layers.1.ffn.gate.weight", "layers.1.attn.compressor.wkv.weight", "embed.weight", "head.weight",
                  "layers.1.attn.indexer.weights_proj.weight", "layers.1.attn.indexer.compressor.wgate.weight",
                  "layers.1.attn.kv_norm.weight", "layers.1.attn.compressor.ape", "layers.1.hc_ffn_fn"):
        assert disk[plain].dtype == torch.float32, plain
    assert not any(k.endswith(".scale") and k[:-6] + ".weight" not in disk for k in disk)

    loaded = load_pretrained(str(tmp_path / "q"), dtype=torch.float32, device="cpu")
    # Exactly the quantise -> dequantise of each weight (checked by test_quant against a reference).
    src, got = _state(model), _state(loaded)
    w = src["layers.2.attn.wo_b.weight"]
    assert torch.equal(got["layers.2.attn.wo_b.weight"], quant.dequantize_fp8(*quant.quantize_fp8(w)))
    e = src["mtp.0.ffn.experts.w1"]
    assert torch.equal(got["mtp.0.ffn.experts.w1"], quant.dequantize_fp4(*quant.quantize_fp4(e), cols=e.shape[-1]))
    assert torch.equal(got["layers.1.ffn.gate.weight"], src["layers.1.ffn.gate.weight"])
    # Logits: weights carry ~2.7% (FP8) / ~12% (FP4) relative RMS error; through 4 mHC layers with
    # top-k routing (a few tokens switch experts) this gives ~9% relative logit error on this
    # random tiny model. 0.2 bounds it with margin, while an unrelated model is at ~140%.
    ref, q = _logits(model, ids), _logits(loaded, ids)
    rel = ((q - ref).norm() / ref.norm()).item()
    other = _logits(build_model(tiny(), seed=1, dtype=torch.float32).eval(), ids)
    assert rel < 0.2 < ((other - ref).norm() / ref.norm()).item()
    assert (q.argmax(-1) == ref.argmax(-1)).float().mean() > 0.7


def test_hf_fp8_scales_use_v3_names(model, tmp_path):
    save_pretrained(model, tmp_path / "q", layout="hf", dtype="bf16", quantize="fp8")
    disk = _tensors(tmp_path / "q")
    assert disk["model.layers.1.self_attn.q_a_proj.weight_scale_inv"].dtype == torch.float8_e8m0fnu
    assert disk["model.layers.1.mlp.experts.gate_up_proj"].dtype == torch.float8_e4m3fn
    assert disk["model.layers.1.mlp.experts.gate_up_proj_scale_inv"].shape == (8, 1, 1)
    loaded = load_pretrained(str(tmp_path / "q"), dtype=torch.float32, device="cpu")
    # quantised from the fp32 master, not from a bf16 copy
    w1, w3 = _state(model)["layers.1.ffn.experts.w1"], _state(model)["layers.1.ffn.experts.w3"]
    fused = quant.dequantize_fp8(*quant.quantize_fp8(torch.cat((w1, w3), dim=1)))
    assert torch.equal(_state(loaded)["layers.1.ffn.experts.w3"], fused[:, 32:])


# ---- cross-check with transformers ------------------------------------------------------------
def test_official_layout_matches_transformers(tmp_path):
    from hf_oracle import hf_config, random_hf_model
    from transformers import DeepseekV4ForCausalLM

    hf = random_hf_model(hf_config())
    hf.save_pretrained(tmp_path / "hf")
    convert(str(tmp_path / "hf"), str(tmp_path / "off"), layout="official", dtype="fp32")
    ours = load_pretrained(str(tmp_path / "off"), dtype=torch.float32, device="cpu").eval()
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(ids).logits
    torch.testing.assert_close(_logits(ours, ids), want, rtol=1e-4, atol=1e-4)
    # And what trex writes in the HF layout is read by transformers unchanged.
    save_pretrained(ours, tmp_path / "back", layout="hf", dtype="fp32")
    back = DeepseekV4ForCausalLM.from_pretrained(str(tmp_path / "back"), dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, want, rtol=1e-4, atol=1e-4)


# ---- bad input ----------------------------------------------------------------------------------
@pytest.fixture()
def official(model, tmp_path):
    path = tmp_path / "off"
    save_pretrained(model, path, layout="official", dtype="fp32", quantize="fp8", max_shard_size="300KB")
    return path


def _shard_of(path, name):
    return path / json.loads((path / "model.safetensors.index.json").read_text())["weight_map"][name]


def test_missing_shard_named_in_index(official):
    shard = _shard_of(official, "layers.2.attn.wq_a.weight")
    shard.unlink()
    with pytest.raises(CheckpointError, match=rf"index\.json: names shard\(s\) that do not exist: {shard.name} \(holds "):
        load_pretrained(str(official), dtype=torch.float32, device="cpu")


def test_truncated_file(official):
    shard = _shard_of(official, "layers.2.attn.wq_a.weight")
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 100])
    with pytest.raises(CheckpointError, match=rf"{shard.name}: tensor .*truncated file"):
        load_pretrained(str(official), dtype=torch.float32, device="cpu")


def _rewrite(path, name, value):
    """Replace tensor ``name`` in its shard (the rest kept as is)."""
    from safetensors.torch import save_file

    shard = _shard_of(path, name)
    file = SafetensorsFile(str(shard))
    tensors = {k: file.read(k) for k in file.keys()}
    tensors[name] = value
    save_file(tensors, str(shard))


def test_shape_disagrees_with_config(official):
    _rewrite(official, "layers.3.attn_norm.weight", torch.ones(65))
    with pytest.raises(CheckpointError, match=r"off/model-\d+-of-\d+\.safetensors: layers\.3\.attn_norm\.weight: "
                                              r"shape \(65,\) does not match the config's \(64,\)"):
        load_pretrained(str(official), dtype=torch.float32, device="cpu")


def test_scale_shape_does_not_match_weight(official):
    _rewrite(official, "layers.1.attn.wq_b.scale", torch.zeros(2, 1, dtype=torch.uint8).view(torch.float8_e8m0fnu))
    with pytest.raises(CheckpointError, match=r"layers\.1\.attn\.wq_b\.weight: scale shape \(2, 1\) does not match "
                                              r"FP8 weight \(128, 32\).*scale tensor layers\.1\.attn\.wq_b\.scale"):
        load_pretrained(str(official), dtype=torch.float32, device="cpu")


def test_problems_are_found_before_any_data_is_read(official, monkeypatch):
    _rewrite(official, "layers.3.attn_norm.weight", torch.ones(65))
    reads = []
    monkeypatch.setattr(SafetensorsFile, "read", lambda self, name, rows=None: reads.append(name))
    with pytest.raises(CheckpointError):
        load_pretrained(str(official), dtype=torch.float32, device="cpu")
    assert reads == []


# ---- atomic writes ------------------------------------------------------------------------------
def test_crash_mid_save_leaves_no_checkpoint(model, tmp_path, monkeypatch):
    calls = []

    def failing(path, tensors, metadata=None, on_written=None):
        calls.append(path)
        if len(calls) == 2:
            raise OSError("disk full")
        return real(path, tensors, metadata, on_written)

    real = writer.write_safetensors
    monkeypatch.setattr(writer, "write_safetensors", failing)
    with pytest.raises(OSError, match="disk full"):
        save_pretrained(model, tmp_path / "ck", max_shard_size="200KB")
    assert os.listdir(tmp_path) == []  # neither the destination nor a temporary is left


def test_existing_destination_is_kept_unless_overwrite(model, tmp_path):
    save_pretrained(model, tmp_path / "ck", dtype="fp32")
    with pytest.raises(CheckpointError, match="already exists"):
        save_pretrained(model, tmp_path / "ck", dtype="fp32")
    save_pretrained(model, tmp_path / "ck", dtype="bf16", overwrite=True)
    assert _tensors(tmp_path / "ck")["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert os.listdir(tmp_path) == ["ck"]


def test_nothing_is_destroyed_by_a_destination_typo(model, tmp_path, capsys):
    from trex.cli import main

    src = tmp_path / "src"
    save_pretrained(model, src, dtype="fp32")
    before = {f: os.path.getsize(src / f) for f in os.listdir(src)}
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine")
    os.symlink(src, tmp_path / "alias")
    cases = {  # destination -> what the one line says
        src: "the destination is the source", tmp_path / "alias": "the destination is the source",
        src / "bf16": "lies inside the source", tmp_path: "holds the source",
        tmp_path / "notes": "replaces only a checkpoint directory",
    }
    for dst, said in cases.items():
        capsys.readouterr()
        assert main(["ckpt", "convert", str(src), str(dst), "--layout", "hf", "--overwrite", "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert said in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert {f: os.path.getsize(src / f) for f in os.listdir(src)} == before  # still the fp32 source
    assert (tmp_path / "notes" / "todo.txt").read_text() == "mine"
    # a model saved over the checkpoint it was loaded from, or into it, is refused the same way
    loaded = load_pretrained(str(src), dtype=torch.float32, device="cpu")
    for dst in (src, src / "sub"):
        with pytest.raises(CheckpointError, match="source"):
            save_pretrained(loaded, dst, overwrite=True)
    save_pretrained(loaded, tmp_path / "trained", overwrite=True)  # beside it is fine
    # --help says what a conversion is written in when --dtype is not given
    with pytest.raises(SystemExit):
        main(["ckpt", "convert", "--help"])
    assert "default: bf16" in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize("preset", ["deepseek-v4-flash", "deepseek-v4-pro"])
def test_official_config_carries_every_field_of_deepseeks_own(preset):
    """The released config.json (tests/fixtures/official_config, DeepSeek's files) against what
    trex writes for the same shape: every key and value, so that serving engines load the export."""
    from trex.checkpoint.save import checkpoint_config, official_config_fields
    from trex.models.deepseek_v4.config import ModelConfig, get_preset

    released = json.loads(open(os.path.join(os.path.dirname(__file__), "fixtures", "official_config",
                                            f"{preset}.json")).read())
    fields = official_config_fields()
    assert sorted(released) == fields["keys"]  # the data file is the released list
    ours = checkpoint_config(get_preset(preset), "official", "bf16", "fp8+fp4experts")
    assert set(ours) == set(released) - set(fields["not_written"])
    for key, value in released.items():
        if key == "quantization_config":
            assert value.items() <= ours[key].items()  # trex adds the FP4 expert format
        elif key not in fields["not_written"]:
            assert ours[key] == value, key
    assert ours["hidden_act"] == "silu" and ours["topk_method"] == "noaux_tc"
    plain = checkpoint_config(get_preset(preset), "official", "bf16", None)
    assert set(plain) == set(ours) - set(fields["when_quantized"])
    assert ModelConfig.from_dict(ours) == ModelConfig.from_dict(plain) == get_preset(preset)


# ---- sharded loading ----------------------------------------------------------------------------
def test_rank_reads_only_its_rows_and_experts(model, tmp_path, monkeypatch):
    save_pretrained(model, tmp_path / "off", layout="official", dtype="fp32")
    full = _state(model)
    read = []
    original = SafetensorsFile.read
    monkeypatch.setattr(SafetensorsFile, "read",
                        lambda self, name, rows=None: read.append((name, rows)) or original(self, name, rows))

    def second_half(key, shape):  # "rank 1 of 2": Shard(0)
        n = shape[0]
        return ((n - n // 2, n), *((0, d) for d in shape[1:]))

    local = load_pretrained(str(tmp_path / "off"), dtype=torch.float32, device="cpu", shard_fn=second_half)
    for key, value in _state(local).items():
        n = full[key].shape[0]
        assert torch.equal(value, full[key][n - n // 2:]), key
    experts_read = {int(m.group(1)) for name, _ in read if (m := re.search(r"experts\.(\d+)\.", name))}
    assert experts_read == {4, 5, 6, 7}
    assert ("embed.weight", (128, 256)) in read  # only its half of the rows


def test_one_rank_mesh_gives_dtensors(model, tmp_path):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    save_pretrained(model, tmp_path / "hf", layout="hf", dtype="fp32")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        loaded = load_pretrained(str(tmp_path / "hf"), dtype=torch.float32, device="cpu", mesh=mesh)
        state = _state(loaded)
        assert all(isinstance(v, DTensor) for v in state.values())
        assert all(torch.equal(state[k].full_tensor(), v) for k, v in _state(model).items())
    finally:
        dist.destroy_process_group()


# ---- CLI ----------------------------------------------------------------------------------------
def test_cli_convert_and_inspect(model, tmp_path, capsys):
    from trex.cli import main

    save_pretrained(model, tmp_path / "hf", layout="hf", dtype="fp32")
    assert main(["ckpt", "convert", str(tmp_path / "hf"), str(tmp_path / "q"), "--layout", "official",
                 "--quantize", "fp8+fp4experts", "--no-progress"]) == 0
    capsys.readouterr()
    assert main(["ckpt", "inspect", str(tmp_path / "q"), "--format", "json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["layout"] == "official" and report["quantization"] == ["fp4", "fp8"]
    assert report["missing"] == [] and report["unexpected"] == [] and report["missing_optional"] == []
    assert report["tensors"] == len(_tensors(tmp_path / "q"))
    assert report["dtypes"]["I8"] == 5 * 3 * 8  # 4 layers + MTP, w1/w2/w3, 8 experts
    assert report["parameters"]["total"] > report["parameters"]["active"] > 0
    assert sum(report["shards"].values()) == sum(os.path.getsize(f) for f in glob.glob(str(tmp_path / "q" / "*.safetensors")))


def test_cli_convert_refuses_an_existing_destination_before_reading_anything(model, tmp_path, capsys, monkeypatch):
    from trex.checkpoint import reader
    from trex.cli import main

    save_pretrained(model, tmp_path / "hf", layout="hf", dtype="fp32")
    (tmp_path / "dst").mkdir()
    (tmp_path / "dst" / "keep.txt").write_text("mine")
    monkeypatch.setattr(reader.CheckpointReader, "__init__", lambda *a, **k: pytest.fail("read the source"))
    assert main(["ckpt", "convert", str(tmp_path / "hf"), str(tmp_path / "dst"), "--layout", "hf"]) == 2
    out, err = capsys.readouterr()
    assert err.strip().count("\n") == 0 and "already exists" in err and "--overwrite" in err
    assert "writing" not in out + err and (tmp_path / "dst" / "keep.txt").read_text() == "mine"


def test_cli_inspect_reports_missing_and_unexpected(model, tmp_path, capsys):
    from safetensors.torch import save_file

    from trex.cli import main

    save_pretrained(model, tmp_path / "ck", layout="official", dtype="fp32", max_shard_size="10GB")
    shard = next(iter(glob.glob(str(tmp_path / "ck" / "model-*.safetensors"))))
    file = SafetensorsFile(shard)
    tensors = {k: file.read(k) for k in file.keys() if k != "norm.weight"}
    tensors["layers.9.attn_norm.weight"] = torch.ones(64)
    save_file(tensors, shard)
    (tmp_path / "ck" / "model.safetensors.index.json").unlink()
    assert main(["ckpt", "inspect", str(tmp_path / "ck")]) == 1
    out = capsys.readouterr().out
    assert "missing:       1 ['norm.weight']" in out and "layers.9.attn_norm.weight" in out
