"""DeepSeek-V3 family checkpoints as DeepSeek and Moonshot release them: FP8 e4m3 linears with fp32
``weight_scale_inv`` per 128x128 block, the rest bf16 (the gate bias fp32), the MTP layer as
``model.layers.{num_hidden_layers}`` with its copies of the embedding and head, sharded with an index, a
config.json that serving engines read; written by save_pretrained / convert, read back, inspected.

The release's rules are written here from the reference (../shared/reference/deepseek_v3.md §3), in the
released names, independently of trex's tables."""

from __future__ import annotations

import glob
import json
import os
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from trex.checkpoint import load_pretrained, save_pretrained
from trex.checkpoint.errors import CheckpointError
from trex.checkpoint.inspect import inspect_checkpoint
from trex.checkpoint.save import convert
from trex.models import build_model, count_parameters
from trex.models.deepseek_v3.config import tiny_v3

# the released FP8 tensors (README_WEIGHTS.md): every attention projection and every MLP / expert projection,
# in the main layers and the MTP layer; everything else (embeddings, norms, router, eh_proj, heads) is not
RELEASED_FP8 = re.compile(r"^model\.layers\.\d+\.(self_attn\.(q_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|"
                          r"o_proj)|mlp\.(experts\.\d+\.|shared_experts\.)?(gate_proj|up_proj|down_proj))\.weight$")
QUANT_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
E4M3_MAX = 448.0


def _cfg(**kw):
    # hidden 256 and query latent 160: weights of several 128-blocks with partial edge blocks (160 = 128 + 32)
    return tiny_v3(hidden_size=256, q_lora_rank=160, **kw)


@pytest.fixture(scope="module")
def model():
    m = build_model(_cfg(), seed=0, dtype=torch.float32).eval()
    with torch.no_grad():  # routers' biases away from 0, so that the fp32 bias is checked
        for name, b in m.named_buffers():
            if name.endswith("gate.bias"):
                b.copy_(0.05 * torch.randn(b.shape, generator=torch.Generator().manual_seed(1)))
    return m


def _files(path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        out.update(load_file(f))
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _expand(scale: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    return scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:rows, :cols]


def _weight_dequant(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """DeepSeek's ``weight_dequant`` (fp8_cast_bf16.py): each (possibly partial) 128x128 block times its
    fp32 scale, in fp32."""
    return q.float() * _expand(scale, *q.shape)


def _release_quantize(w: torch.Tensor, headroom: float = 1.0, ue8m0: bool = False
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 + fp32 scale per 128x128 block, scale = amax / (448 / headroom): the released rule at headroom 1;
    with ``ue8m0`` (DeepSeek-V3.1's ``scale_fmt``) that scale rounded up to a power of two, 2^ceil(log2(s)),
    as DeepGEMM's per-block cast and the official act_quant with ue8m0 do."""
    rows, cols = w.shape
    pad = torch.nn.functional.pad(w.abs().float(), (0, -cols % 128, 0, -rows % 128))
    amax = pad.reshape(pad.shape[0] // 128, 128, pad.shape[1] // 128, 128).amax(dim=(1, 3))
    scale = amax.clamp(min=1e-4) / (E4M3_MAX / headroom)
    if ue8m0:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    return (w.float() / _expand(scale, rows, cols)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale


def _hand_released(src: str, dst: str, headroom: float, ue8m0: bool = False) -> None:
    """A released-style FP8 checkpoint made here from the bf16 one at ``src``: each tensor the release stores
    in FP8 quantised by this file's rule, two shards and an index, the config with its quantization_config
    (with ``ue8m0``: V3.1's, power-of-two scales and ``scale_fmt: "ue8m0"``)."""
    plain = _files(src)
    tensors = {}
    for name, t in plain.items():
        if RELEASED_FP8.match(name):
            tensors[name], tensors[name + "_scale_inv"] = _release_quantize(t, headroom, ue8m0)
        else:
            tensors[name] = t
    names = sorted(tensors)
    half = [n for n in names[: len(names) // 2] if not n.endswith("_scale_inv")]
    shards = {"model-00001-of-00002.safetensors": {n: tensors[n] for n in half}}
    shards["model-00001-of-00002.safetensors"].update({n + "_scale_inv": tensors[n + "_scale_inv"] for n in half
                                                        if n + "_scale_inv" in tensors})
    shards["model-00002-of-00002.safetensors"] = {n: t for n, t in tensors.items()
                                                  if n not in shards["model-00001-of-00002.safetensors"]}
    os.makedirs(dst)
    for file, part in shards.items():
        save_file(part, os.path.join(dst, file), metadata={"format": "pt"})
    weight_map = {n: f for f, part in shards.items() for n in part}
    with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    config = json.load(open(os.path.join(src, "config.json")))
    config["quantization_config"] = {**QUANT_CONFIG, "scale_fmt": "ue8m0"} if ue8m0 else QUANT_CONFIG
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)


# ---- writing the released layout -----------------------------------------------------------------------
def test_fp8_save_is_the_released_layout_and_loads_within_e4m3_error(model, tmp_path):
    save_pretrained(model, tmp_path / "q", quantize="fp8", dtype="bf16", max_shard_size="300KB")
    disk = _files(tmp_path / "q")
    n = model.cfg.num_hidden_layers
    index = json.loads((tmp_path / "q" / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) > 1 and set(index) == set(disk)
    for name, t in disk.items():
        if name.endswith("_scale_inv"):
            weight = disk[name[: -len("_scale_inv")]]
            assert t.dtype == torch.float32 and t.shape == (-(-weight.shape[0] // 128), -(-weight.shape[1] // 128))
            assert index[name] == index[name[: -len("_scale_inv")]], name  # a weight and its scale share a shard
        elif RELEASED_FP8.match(name):
            assert t.dtype == torch.float8_e4m3fn and name + "_scale_inv" in disk, name
        else:
            want = torch.float32 if name.endswith("e_score_correction_bias") else torch.bfloat16
            assert t.dtype == want and name + "_scale_inv" not in disk, name
    assert any(t.shape[0] % 128 and t.shape[0] > 128 for n_, t in disk.items() if RELEASED_FP8.match(n_))
    # the MTP layer as layer n, with the embedding and head duplicated, as released
    assert torch.equal(disk[f"model.layers.{n}.embed_tokens.weight"], disk["model.embed_tokens.weight"])
    assert torch.equal(disk[f"model.layers.{n}.shared_head.head.weight"], disk["lm_head.weight"])
    for leaf in ("enorm", "hnorm", "eh_proj", "shared_head.norm"):
        assert disk[f"model.layers.{n}.{leaf}.weight"].dtype == torch.bfloat16
    assert f"model.layers.{n}.mlp.experts.7.down_proj.weight_scale_inv" in disk
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    assert config["quantization_config"] == QUANT_CONFIG
    assert {k: config[k] for k in ("architectures", "model_type", "torch_dtype", "num_nextn_predict_layers",
                                   "topk_method", "scoring_func", "hidden_act")} == {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "torch_dtype": "bfloat16",
        "num_nextn_predict_layers": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid", "hidden_act": "silu"}
    assert config["rope_scaling"]["type"] == "yarn" and "index_topk" not in config

    loaded = load_pretrained(str(tmp_path / "q"), dtype=torch.float32, device="cpu")
    src, got = dict(model.state_dict()), dict(loaded.state_dict())
    assert src.keys() == got.keys()
    worst = 0.0
    for name, t in disk.items():
        if not RELEASED_FP8.match(name):
            continue
        dq = _weight_dequant(t, disk[name + "_scale_inv"])
        key, expert = _trex_key(name, n)
        w = src[key] if expert is None else src[key][expert]
        assert torch.equal((got[key] if expert is None else got[key][expert]), dq), name
        # e4m3: 3 mantissa bits, half an ulp of relative error; below 2^-6 (subnormal) half of 2^-9 absolute
        scale = _expand(disk[name + "_scale_inv"], *w.shape)
        bound = torch.maximum(w.abs() * 2.0**-4, scale * 2.0**-10)
        assert ((dq - w).abs() <= bound * (1 + 1e-6)).all(), name
        worst = max(worst, ((dq - w).norm() / w.norm()).item())
    assert 0 < worst < 0.05
    for key in ("embed.weight", "head.weight", "layers.1.ffn.gate.weight", "mtp.0.eh_proj.weight"):
        assert torch.equal(got[key], src[key].bfloat16().float()), key
    assert torch.equal(got["layers.1.ffn.gate.bias"], src["layers.1.ffn.gate.bias"])  # fp32 on disk


def _trex_key(name: str, n_layers: int) -> tuple[str, int | None]:
    from trex.checkpoint.naming import trex_targets

    (t,) = trex_targets(name, "hf", "deepseek_v3", n_layers)
    return t.key, t.expert


# ---- reading a release and converting it ---------------------------------------------------------------
@pytest.fixture(scope="module")
def released(model, tmp_path_factory):
    """(bf16 checkpoint written by trex, the FP8 release made from it by this file's rule with scales of
    amax / 400: a rule not trex's, which only keeping the source's scales reproduces)."""
    d = tmp_path_factory.mktemp("v3rel")
    save_pretrained(model, d / "bf16", dtype="bf16")
    _hand_released(str(d / "bf16"), str(d / "fp8"), headroom=448 / 400)
    return d / "bf16", d / "fp8"


def test_a_release_converts_to_fp8_byte_for_byte_and_unquantised_byte_for_byte(released, tmp_path):
    bf16, fp8 = released
    convert(str(fp8), str(tmp_path / "again"), quantize="fp8", max_shard_size="200KB")
    want, got = _files(fp8), _files(tmp_path / "again")
    assert want.keys() == got.keys()
    for name in want:
        assert want[name].dtype == got[name].dtype and torch.equal(_bits(want[name]), _bits(got[name])), name
    convert(str(bf16), str(tmp_path / "plain"), dtype="bf16")
    want, got = _files(bf16), _files(tmp_path / "plain")
    assert want.keys() == got.keys() and all(torch.equal(_bits(want[k]), _bits(got[k])) for k in want)
    # FP8 -> bf16 is DeepSeek's fp8_cast_bf16: weight_dequant rounded to bf16, the scales dropped
    convert(str(fp8), str(tmp_path / "cast"), dtype="bf16")
    quantized, cast = _files(fp8), _files(tmp_path / "cast")
    assert cast.keys() == {k for k in quantized if not k.endswith("_scale_inv")}
    for name, t in cast.items():
        want = _weight_dequant(t_q := quantized[name], quantized[name + "_scale_inv"]).bfloat16() if \
            RELEASED_FP8.match(name) else quantized[name]
        assert t.dtype == want.dtype and torch.equal(_bits(t), _bits(want)), (name, t_q.dtype)
    assert json.loads((tmp_path / "cast" / "config.json").read_text()).get("quantization_config") is None


def test_inspect_reports_the_release(released, model, capsys):
    from trex.cli import main

    _, fp8 = released
    report = inspect_checkpoint(str(fp8))
    count = count_parameters(model.cfg)
    assert report["parameters"] == {"total": count.total, "active": count.active, "mtp": count.mtp, "engram": 0}
    assert (report["architecture"], report["layout"], report["quantization"]) == ("deepseek_v3", "hf", ["fp8"])
    assert report["problems"] == [] and report["missing_optional"] == [] and report["unexpected"] == []
    n = model.cfg.num_hidden_layers
    assert report["mtp_copies"] == [f"model.layers.{n}.embed_tokens.weight", f"model.layers.{n}.shared_head.head.weight"]
    assert main(["ckpt", "inspect", str(fp8)]) == 0
    out = capsys.readouterr().out
    assert f"total {count.total:,}  active {count.active:,}" in out and "copies of the embedding and head" in out


def test_an_mtp_copy_that_is_not_the_main_tensor_is_refused(released, tmp_path):
    bf16, _ = released
    n = _cfg().num_hidden_layers
    tensors = _files(bf16)
    name = f"model.layers.{n}.shared_head.head.weight"
    tensors[name] = tensors[name].clone()
    tensors[name][3, 5] += 1
    os.makedirs(tmp_path / "bad")
    save_file(tensors, tmp_path / "bad" / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "bad" / "config.json").write_text((bf16 / "config.json").read_text())
    with pytest.raises(CheckpointError, match=rf"{re.escape(name)}: differs from .*lm_head\.weight"):
        load_pretrained(str(tmp_path / "bad"), dtype=torch.float32, device="cpu")
    tensors[name] = tensors[name][:-1]
    save_file(tensors, tmp_path / "bad" / "model.safetensors", metadata={"format": "pt"})
    assert any(name in p and "does not match" in p for p in inspect_checkpoint(str(tmp_path / "bad"))["problems"])


@pytest.fixture(scope="module")
def released_v31(released, tmp_path_factory):
    """A V3.1-style release of the same bf16 model: every scale a power of two, config ``scale_fmt: "ue8m0"``."""
    bf16, _ = released
    d = tmp_path_factory.mktemp("v31rel")
    _hand_released(str(bf16), str(d / "fp8"), headroom=1.0, ue8m0=True)
    return d / "fp8"


def _pow2(t: torch.Tensor) -> bool:
    return bool((torch.exp2(torch.round(torch.log2(t))) == t).all())


def test_a_v31_release_keeps_its_power_of_two_scales_through_convert_and_training(released_v31, tmp_path):
    """V3.1 (``scale_fmt: "ue8m0"``): converted unchanged it comes back byte for byte; a model loaded from it
    and changed (as training does) is written with scales that are again powers of two, each the release's
    rule (amax / 448 rounded up), so an engine that trusts the field reads the weights that were trained."""
    disk = _files(released_v31)
    scales = [k for k in disk if k.endswith("_scale_inv")]
    assert len(scales) > 20 and all(_pow2(disk[k]) for k in scales)
    convert(str(released_v31), str(tmp_path / "again"), quantize="fp8", max_shard_size="200KB")
    again = _files(tmp_path / "again")
    assert again.keys() == disk.keys()
    for name in disk:
        assert disk[name].dtype == again[name].dtype and torch.equal(_bits(disk[name]), _bits(again[name])), name
    assert json.loads((tmp_path / "again" / "config.json").read_text())["quantization_config"]["scale_fmt"] == "ue8m0"

    model = load_pretrained(str(released_v31), dtype=torch.float32)
    with torch.no_grad():  # a training step's change to every weight
        for p in model.parameters():
            p.mul_(1.37)
    save_pretrained(model, tmp_path / "trained", quantize="fp8")
    out = _files(tmp_path / "trained")
    assert json.loads((tmp_path / "trained" / "config.json").read_text())["quantization_config"] == {
        **QUANT_CONFIG, "scale_fmt": "ue8m0"}
    state = dict(model.state_dict())
    n = model.cfg.num_hidden_layers
    for name in [k for k in out if k.endswith("_scale_inv")]:
        weight = name[: -len("_scale_inv")]
        key, expert = _trex_key(weight, n)
        w = state[key] if expert is None else state[key][expert]
        q, s = _release_quantize(w, ue8m0=True)
        assert out[name].dtype == torch.float32 and torch.equal(out[name], s), name
        assert torch.equal(_bits(out[weight]), _bits(q)), weight


def test_a_missing_expert_is_named_as_the_file_names_it_by_inspect_convert_and_train(released, tmp_path, capsys):
    """An expert gone from a release: inspect counts it among the missing (where it said `missing: 0 []` above
    the problem), and inspect, convert and train name it by the file's name, convert and train in one line."""
    from trex.cli import main

    bf16, _ = released
    gone = "model.layers.1.mlp.experts.3.down_proj.weight"
    tensors = _files(bf16)
    del tensors[gone]
    os.makedirs(tmp_path / "bad")
    save_file(tensors, tmp_path / "bad" / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "bad" / "config.json").write_text((bf16 / "config.json").read_text())
    bad = tmp_path / "bad"
    capsys.readouterr()
    assert main(["ckpt", "inspect", str(bad)]) == 1
    out = capsys.readouterr().out
    assert f"missing:       1 ['{gone}']" in out and f"problem: {bad}: missing tensor(s): ['{gone}']" in out, out
    line = f"cannot load checkpoint: {bad}: missing tensor(s): ['{gone}']\n"
    assert main(["ckpt", "convert", str(bad), str(tmp_path / "out"), "--layout", "hf", "--no-progress"]) == 2
    assert capsys.readouterr().err == f"trex ckpt convert: {line}"
    (tmp_path / "recipe.toml").write_text(f'[model]\npath = "{bad}"\n[data]\ntokenizer = "compact"\n')
    assert main(["train", str(tmp_path / "recipe.toml"), "--out", str(tmp_path / "run")]) == 2
    assert capsys.readouterr().err == f"trex train: {line}"


def test_kimi_k2_keeps_its_config_and_remote_code_and_refuses_fp4_in_one_line(tmp_path, capsys):
    """Kimi-K2 as Moonshot releases it: model_type kimi_k2, FP8, no MTP, and the remote code its config.json
    and tokenizer_config.json name in auto_map (engines load it with trust_remote_code), kept by convert."""
    from trex.cli import main

    kimi = build_model(tiny_v3(model_type="kimi_k2", n_group=1, topk_group=1, num_nextn_predict_layers=0,
                               rope_theta=50000.0), seed=2)
    save_pretrained(kimi, tmp_path / "k2", quantize="fp8")
    config = json.loads((tmp_path / "k2" / "config.json").read_text())
    assert (config["model_type"], config["architectures"], config["quantization_config"]) == (
        "kimi_k2", ["DeepseekV3ForCausalLM"], QUANT_CONFIG)
    disk = _files(tmp_path / "k2")
    assert not any(k.startswith(f"model.layers.{kimi.cfg.num_hidden_layers}.") for k in disk)  # no MTP
    assert disk["model.layers.1.mlp.experts.3.up_proj.weight"].dtype == torch.float8_e4m3fn
    assert load_pretrained(str(tmp_path / "k2"), dtype=torch.float32).cfg == kimi.cfg

    auto_map = {"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"}
    config.update(auto_map=auto_map, quantization_config={**QUANT_CONFIG, "scale_fmt": "ue8m0"})
    (tmp_path / "k2" / "config.json").write_text(json.dumps(config))
    (tmp_path / "k2" / "tokenizer_config.json").write_text(
        json.dumps({"auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]}}))
    for name in ("configuration_deepseek.py", "modeling_deepseek.py", "tokenization_kimi.py", "tiktoken.model"):
        (tmp_path / "k2" / name).write_text(f"raise SystemExit('{name} is copied, never run')\n")
    convert(str(tmp_path / "k2"), str(tmp_path / "again"), quantize="fp8")
    again = json.loads((tmp_path / "again" / "config.json").read_text())
    assert again["auto_map"] == auto_map and again["quantization_config"]["scale_fmt"] == "ue8m0"
    for name in ("configuration_deepseek.py", "modeling_deepseek.py", "tokenization_kimi.py", "tiktoken.model",
                 "tokenizer_config.json"):
        assert (tmp_path / "again" / name).read_text() == (tmp_path / "k2" / name).read_text(), name
    convert(str(tmp_path / "k2"), str(tmp_path / "bf16"))
    assert "quantization_config" not in json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert main(["ckpt", "convert", str(tmp_path / "k2"), str(tmp_path / "fp4"), "--layout", "hf",
                 "--quantize", "fp8+fp4experts", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "released as FP8" in err and not os.path.exists(tmp_path / "fp4")


def test_a_scale_format_trex_cannot_write_is_left_out_of_the_written_config(tmp_path, caplog):
    """A source whose quantization_config names a scale format trex does not write scales in: the written
    config leaves the field out (with a warning) rather than claim it."""
    from trex.checkpoint.save import carried_config, written_scale_fmt

    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {**QUANT_CONFIG, "scale_fmt": "e5m2"}}))
    with caplog.at_level("WARNING"):
        assert carried_config(str(tmp_path), "fp8") == {} and written_scale_fmt(str(tmp_path), "fp8") is None
    assert "scale_fmt 'e5m2' is not a format trex writes" in caplog.text
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {**QUANT_CONFIG, "scale_fmt": "ue8m0"}}))
    assert written_scale_fmt(str(tmp_path), "fp8") == "ue8m0" and written_scale_fmt(str(tmp_path), None) is None
