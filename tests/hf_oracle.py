"""Helpers that build random-weight transformers DeepSeek-V4 models (the test oracle)."""

from __future__ import annotations

import torch

transformers = __import__("pytest").importorskip("transformers")
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM  # noqa: E402

BASE = dict(
    vocab_size=128, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, head_dim=32,
    partial_rotary_factor=0.25, q_lora_rank=32, o_groups=2, o_lora_rank=16, sliding_window=8,
    layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                 "compressed_sparse_attention"],
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
    mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
    index_n_heads=4, index_head_dim=16, index_topk=3, n_routed_experts=8, num_experts_per_tok=2,
    moe_intermediate_size=32, hc_mult=4, routed_scaling_factor=1.5, max_position_embeddings=4096,
    rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                  "beta_fast": 32, "beta_slow": 1},
    num_nextn_predict_layers=0,
)


def hf_config(**overrides) -> DeepseekV4Config:
    kw = {**BASE, **overrides}
    rope_scaling = kw.pop("rope_scaling")
    cfg = DeepseekV4Config(**kw, rope_parameters=dict(rope_scaling))
    return cfg


@torch.no_grad()
def random_hf_model(cfg: DeepseekV4Config, seed: int = 0) -> DeepseekV4ForCausalLM:
    """Every parameter and buffer random (sinks, biases, mHC scales, position biases included),
    and a hash table with distinct experts per token, so parity covers all of them."""
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(cfg).float().eval()
    for name, p in model.named_parameters():
        if name.endswith(("norm.weight", "layernorm.weight")):
            p.copy_(1.0 + 0.1 * torch.randn_like(p))
        elif name.endswith(("hc_base", ".base", "sinks", "position_bias")):
            p.copy_(0.5 * torch.randn_like(p))
        elif name.endswith(("scale", "hc_scale")):
            p.copy_(1.0 + 0.2 * torch.randn_like(p))
        else:
            p.copy_(0.08 * torch.randn_like(p))
    for name, b in model.named_buffers():
        if name.endswith("tid2eid"):
            b.copy_(torch.rand(b.shape[0], cfg.n_routed_experts).argsort(-1)[:, : b.shape[1]])
        elif name.endswith("e_score_correction_bias"):
            b.copy_(0.05 * torch.randn_like(b))
    return model
