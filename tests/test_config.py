"""Model configuration: HF and official names, legacy fields, presets, and clear errors."""

from __future__ import annotations

import json

import pytest

from trex.models.common.config import ConfigError
from trex.models.deepseek_v4.config import CSA, HCA, SLIDING, ModelConfig, get_preset

FLASH_RATIOS = [0, 0] + [4 if i % 2 == 0 else 128 for i in range(41)] + [0]  # 43 layers + MTP


def test_official_inference_config_names():
    raw = {"vocab_size": 129280, "dim": 4096, "moe_inter_dim": 2048, "n_layers": 43, "n_hash_layers": 3,
           "n_heads": 64, "n_routed_experts": 256, "n_shared_experts": 1, "n_activated_experts": 6,
           "score_func": "sqrtsoftplus", "route_scale": 1.5, "swiglu_limit": 10.0, "q_lora_rank": 1024,
           "head_dim": 512, "rope_head_dim": 64, "norm_eps": 1e-6, "o_groups": 8, "o_lora_rank": 1024,
           "window_size": 128, "compress_ratios": FLASH_RATIOS, "compress_rope_theta": 160000.0,
           "original_seq_len": 65536, "rope_theta": 10000, "rope_factor": 16, "beta_fast": 32, "beta_slow": 1,
           "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512, "hc_mult": 4, "hc_sinkhorn_iters": 20,
           "hc_eps": 1e-6, "dtype": "fp8", "scale_fmt": "ue8m0", "expert_dtype": "fp4"}
    cfg = ModelConfig.from_dict(raw)
    assert cfg == get_preset("deepseek-v4-flash")
    assert cfg.layer_types[:3] == [SLIDING, SLIDING, CSA] and cfg.layer_types[-1] == CSA
    assert cfg.mtp_layer_type == SLIDING
    assert cfg.mlp_layer_types[:4] == ["hash_moe"] * 3 + ["moe"]


def test_hf_legacy_fields_and_flat_rope_scaling():
    raw = {"hidden_size": 4096, "num_hidden_layers": 43, "compress_ratios": FLASH_RATIOS, "num_hash_layers": 3,
           "qk_rope_head_dim": 64, "rope_scaling": {"type": "yarn", "factor": 16,
                                                    "original_max_position_embeddings": 65536,
                                                    "beta_fast": 32, "beta_slow": 1},
           "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "torch_dtype": "bfloat16",
           "quantization_config": {"quant_method": "fp8"}}
    assert ModelConfig.from_dict(raw) == get_preset("deepseek-v4-flash")


def test_round_trip_through_transformers_config(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = get_preset("deepseek-v4-pro")
    hf = transformers.DeepseekV4Config(**cfg.to_hf_dict())
    assert hf.layer_types == cfg.layer_types and hf.qk_rope_head_dim == cfg.qk_rope_head_dim
    hf.save_pretrained(tmp_path)
    back = ModelConfig.from_file(str(tmp_path))
    assert back == cfg


@pytest.mark.parametrize("left_out", [("layer_types",), ("rope_parameters",), ("layer_types", "rope_parameters")])
def test_a_field_a_transformers_config_leaves_out_takes_transformers_default(left_out, tmp_path):
    """A transformers config.json without a field means what transformers reads it as (its DeepseekV4Config
    default), never a trex preset's value: the attention schedule and the compressed layers' RoPE."""
    transformers = pytest.importorskip("transformers")
    raw = {k: v for k, v in transformers.DeepseekV4Config(num_hidden_layers=6).to_dict().items() if k not in left_out}
    raw.pop("rope_scaling", None)
    hf = transformers.DeepseekV4Config(**raw)
    ours = ModelConfig.from_dict(raw)
    assert ours.layer_types == hf.layer_types
    assert ours.to_hf_dict()["rope_parameters"]["compress"]["rope_type"] == hf.rope_parameters["compress"]["rope_type"]
    assert ours.to_hf_dict()["rope_parameters"]["compress"]["rope_type"] == "default" and ours.rope_scaling is None


@pytest.mark.parametrize(
    "change, field",
    [
        (dict(layer_types=[SLIDING, "full_attention", HCA, CSA]), "layer_types"),
        (dict(layer_types=[SLIDING, CSA]), "layer_types"),
        (dict(mlp_layer_types=["moe"] * 3), "mlp_layer_types"),
        (dict(o_groups=3), "o_groups"),
        (dict(qk_rope_head_dim=7), "qk_rope_head_dim"),
        (dict(num_experts_per_tok=9), "num_experts_per_tok"),
        (dict(hidden_size=0), "hidden_size"),
    ],
)
def test_invalid_config_names_the_field(change, field):
    base = get_preset("tiny")
    raw = {k: v for k, v in base.to_hf_dict().items()}
    raw.update(change)
    with pytest.raises(ConfigError, match=f"`{field}`"):
        ModelConfig.from_dict(raw)


def test_unknown_field_and_bad_json_are_reported_with_the_file(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"hidden_size": 64, "hiden_layers": 2}))
    with pytest.raises(ConfigError, match=r"config.json: unknown config field\(s\) \['hiden_layers'\]"):
        ModelConfig.from_file(str(path))
    path.write_text('{"hidden_size": 64,\n "x": }')
    with pytest.raises(ConfigError, match="config.json: line 2: invalid JSON"):
        ModelConfig.from_file(str(path))
    with pytest.raises(ConfigError, match="unknown model preset"):
        get_preset("v5")
