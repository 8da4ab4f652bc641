"""Helpers that build random-weight transformers DeepSeek-V3 models (the test oracle for the V3 family)."""

from __future__ import annotations

import torch

transformers = __import__("pytest").importorskip("transformers")
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM  # noqa: E402

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
# q_lora, 8 experts in 4 groups (top 2 groups), a dense first layer, YaRN with mscale past its original 16
BASE = dict(
    vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
    v_head_dim=16, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=4, topk_group=2,
    first_k_dense_replace=1, routed_scaling_factor=2.5, rms_norm_eps=1e-6, rope_parameters=YARN,
    max_position_embeddings=64, num_nextn_predict_layers=0, tie_word_embeddings=False,
)


def hf_config(**overrides) -> DeepseekV3Config:
    """A tiny DeepseekV3Config; ``max_position_embeddings`` is YaRN's factor x original (transformers
    warns otherwise)."""
    kw = {**BASE, **overrides}
    kw["num_key_value_heads"] = kw["num_attention_heads"]  # MLA: every head its own K and V
    rp = kw["rope_parameters"]
    if rp.get("rope_type") == "yarn":
        kw["max_position_embeddings"] = int(rp["factor"] * rp["original_max_position_embeddings"])
    cfg = DeepseekV3Config(**kw)
    cfg._attn_implementation = "eager"
    return cfg


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int) -> None:
    """Every parameter random (norms near 1), every router's correction bias random."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=gen)
        p.copy_(1.0 + 0.1 * noise if name.endswith(("norm.weight", "layernorm.weight")) else 0.08 * noise)
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(0.05 * torch.randn(b.shape, generator=gen))


def random_hf_model(cfg: DeepseekV3Config, seed: int = 0) -> DeepseekV3ForCausalLM:
    model = DeepseekV3ForCausalLM(cfg).float().eval()
    randomize(model, seed)
    return model


def hf_config_v32(**overrides):
    """A tiny DeepseekV32Config: BASE plus the indexer (8 heads of 16, top 8: fewer than a test's
    sequence). transformers' V3.2 config has no MTP field."""
    from transformers import DeepseekV32Config

    kw = {**BASE, "index_n_heads": 8, "index_head_dim": 16, "index_topk": 8, **overrides}
    kw.pop("num_nextn_predict_layers")
    kw["num_key_value_heads"] = kw["num_attention_heads"]
    rp = kw["rope_parameters"]
    kw["max_position_embeddings"] = int(rp["factor"] * rp["original_max_position_embeddings"])
    cfg = DeepseekV32Config(**kw)
    cfg._attn_implementation = "eager"  # the indexer's picks as a mask over the dense scores
    return cfg


def random_hf_v32(cfg, seed: int = 0):
    from transformers import DeepseekV32ForCausalLM

    model = DeepseekV32ForCausalLM(cfg).float().eval()
    randomize(model, seed)
    return model
