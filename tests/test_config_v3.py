"""The DeepSeek-V3 family's configuration: the released config.json, DeepSeek's inference names,
transformers' written config, the presets, detection by the registry and clear errors."""

from __future__ import annotations

import dataclasses
import json

import pytest

from trex.models.common.config import ConfigError, YarnScaling
from trex.models.deepseek_v3.config import V3_PRESETS, V3Config, YarnMScale, is_v3
from trex.models.registry import PRESETS, config_from_dict, config_from_file, get_preset

# DeepSeek-V3's released config.json (huggingface.co/deepseek-ai/DeepSeek-V3, reference §2.1), as shipped
RELEASED_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config"}, "aux_loss_alpha": 0.001,
    "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1, "first_k_dense_replace": 3, "hidden_act": "silu",
    "hidden_size": 7168, "initializer_range": 0.02, "intermediate_size": 18432, "kv_lora_rank": 512,
    "max_position_embeddings": 163840, "model_type": "deepseek_v3", "moe_intermediate_size": 2048,
    "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True,
    "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06, "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                                            "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                                            "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": True,
    "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
    "transformers_version": "4.33.1", "use_cache": True, "v_head_dim": 128, "vocab_size": 129280,
}
# DeepSeek's inference/configs/config_671B.json (no model_type; YaRN from ModelArgs' defaults)
OFFICIAL_V3 = {
    "vocab_size": 129280, "dim": 7168, "inter_dim": 18432, "moe_inter_dim": 2048, "n_layers": 61,
    "n_dense_layers": 3, "n_heads": 128, "n_routed_experts": 256, "n_shared_experts": 1, "n_activated_experts": 8,
    "n_expert_groups": 8, "n_limited_groups": 4, "route_scale": 2.5, "score_func": "sigmoid", "q_lora_rank": 1536,
    "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "dtype": "fp8",
    "rope_factor": 40, "original_seq_len": 4096, "mscale": 1.0,
}


def test_the_released_config_and_the_official_names_are_the_preset():
    assert config_from_dict(RELEASED_V3) == get_preset("deepseek-v3")
    official = config_from_dict(OFFICIAL_V3)
    assert dataclasses.replace(official, num_nextn_predict_layers=1) == get_preset("deepseek-v3")


def test_every_preset_round_trips_and_writes_what_engines_need():
    for name in V3_PRESETS:
        cfg = get_preset(name)
        written = cfg.to_hf_dict()
        assert config_from_dict(json.loads(json.dumps(written))) == cfg, name
        assert written["hidden_act"] == "silu" and written["topk_method"] == "noaux_tc", name
        assert written["scoring_func"] == "sigmoid" and "num_nextn_predict_layers" in written, name
        assert ("index_topk" in written) == name.endswith("v3.2"), name  # vLLM goes sparse on index_topk
        if cfg.rope_scaling is not None:
            assert {"mscale", "mscale_all_dim"} <= set(written["rope_scaling"]), name
    assert get_preset("deepseek-v3.2").to_hf_dict()["architectures"] == ["DeepseekV32ForCausalLM"]
    assert get_preset("kimi-k2").to_hf_dict()["model_type"] == "kimi_k2"
    assert get_preset("moonlight").to_hf_dict()["q_lora_rank"] is None


def test_released_family_shapes():
    k2, moon, v32 = get_preset("kimi-k2"), get_preset("moonlight"), get_preset("deepseek-v3.2")
    assert (k2.n_routed_experts, k2.num_experts_per_tok, k2.n_group, k2.num_attention_heads,
            k2.first_k_dense_replace, k2.vocab_size, k2.rope_theta) == (384, 8, 1, 64, 1, 163840, 50000.0)
    assert (k2.rope_scaling.factor, k2.rope_scaling.original_max_position_embeddings,
            k2.rope_scaling.beta_fast, k2.rope_scaling.beta_slow) == (32.0, 4096, 1.0, 1.0)
    assert (moon.q_lora_rank, moon.n_routed_experts, moon.num_experts_per_tok, moon.n_shared_experts,
            moon.num_hidden_layers, moon.rms_norm_eps, moon.rope_scaling) == (0, 64, 6, 2, 27, 1e-5, None)
    assert (v32.index_n_heads, v32.index_head_dim, v32.index_topk, v32.model_type) == (64, 128, 2048, "deepseek_v32")


def test_softmax_scale_with_yarn_mscale():
    """192^-0.5 x m^2, m = 0.1 ln(factor) + 1: V3 0.135234, Kimi-K2 (factor 32) 0.130861 (reference §2.2)."""
    for name, want in (("deepseek-v3", 0.135234), ("kimi-k2", 0.130861)):
        cfg = get_preset(name)
        assert abs(cfg.qk_head_dim ** -0.5 * cfg.rope_scaling.softmax_scale - want) < 1e-6
        assert cfg.rope_scaling.rope_scale == 1.0
    y = YarnMScale(factor=40.0, mscale=0.707, mscale_all_dim=1.0)
    assert y.rope_scale < 1.0


def test_v4_yarn_fields_unchanged():
    """V4.1 writes ``{"type": "yarn", **asdict(yarn)}``: the shared YarnScaling keeps its four fields."""
    assert [f.name for f in dataclasses.fields(YarnScaling)] == [
        "factor", "original_max_position_embeddings", "beta_fast", "beta_slow"]


def test_transformers_reads_what_trex_writes_and_trex_reads_what_transformers_writes(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = get_preset("tiny-v3")
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    hf = transformers.AutoConfig.from_pretrained(tmp_path)
    assert type(hf).__name__ == "DeepseekV3Config"
    rp = hf.rope_parameters
    assert (rp["rope_type"], rp["factor"], rp["mscale"], rp["mscale_all_dim"], rp["rope_theta"]) == (
        "yarn", 4.0, 1.0, 1.0, 10000.0)
    assert (hf.n_group, hf.topk_group, hf.first_k_dense_replace, hf.q_lora_rank) == (4, 2, 1, 32)
    hf.save_pretrained(tmp_path / "re")
    assert config_from_file(str(tmp_path / "re")) == cfg
    moon = get_preset("tiny-moonlight")
    hf = transformers.DeepseekV3Config(**{k: v for k, v in moon.to_hf_dict().items() if k != "architectures"})
    assert hf.q_lora_rank is None
    hf.save_pretrained(tmp_path / "moon")
    assert config_from_file(str(tmp_path / "moon")) == moon


def test_the_registry_tells_the_families_apart():
    assert isinstance(config_from_dict({**RELEASED_V3, "model_type": "kimi_k2"}), V3Config)
    assert config_from_dict({**RELEASED_V3, "model_type": "kimi_k2"}).to_hf_dict()["model_type"] == "kimi_k2"
    assert is_v3(OFFICIAL_V3) and not is_v3(get_preset("deepseek-v4-flash").to_hf_dict())
    for name in ("tiny", "deepseek-v4-flash", "tiny-v4.1"):
        assert not isinstance(config_from_dict(get_preset(name).to_hf_dict()), V3Config), name
    assert set(V3_PRESETS) <= set(PRESETS)


@pytest.mark.parametrize("change, field", [
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(rope_interleave=False), "rope_interleave"),
    (dict(topk_method="greedy"), "topk_method"),
    (dict(n_group=3), "n_group"),
    (dict(topk_group=9), "topk_group"),
    (dict(num_experts_per_tok=300), "num_experts_per_tok"),
    (dict(qk_rope_head_dim=63), "qk_rope_head_dim"),
    (dict(index_topk=2048), "index_topk"),
    (dict(index_topk=2048, index_n_heads=64, index_head_dim=128, model_type="deepseek_v3"), "model_type"),
    (dict(first_k_dense_replace=62), "first_k_dense_replace"),
    (dict(rope_scaling={"type": "linear", "factor": 2}), "rope_scaling"),
    (dict(some_new_field=1), "some_new_field"),
])
def test_errors_name_the_field(change, field):
    with pytest.raises(ConfigError, match=field):
        config_from_dict({**RELEASED_V3, **change}, source="x/config.json")


def test_q_lora_null_is_no_query_latent():
    cfg = config_from_dict({**RELEASED_V3, "q_lora_rank": None})
    assert cfg.q_lora_rank == 0 and cfg.to_hf_dict()["q_lora_rank"] is None
