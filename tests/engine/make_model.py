"""A tiny DeepSeek-V3 that vLLM's CPU backend serves unmodified, written by trex in the released (HF) layout.

    python tests/engine/make_model.py DIR [--layers N] [--hidden H] [--seed S] [--head-scale X]

vLLM-CPU's MLA backend (``CPU_MLA``) takes only the real latent geometry: kv_lora_rank 512 + rope head 64
(head size 576); every other width can be a toy. Group-limited routing is exercised (8 experts in 4
groups, the top 2 groups kept, 2 experts per token), the first layer is dense, no MTP (vLLM's V3 class
does not serve it). The vocabulary is trex's compact tokenizer's (the arithmetic prompts). The head is
scaled by ``--head-scale`` so the distribution is peaked: a near-uniform random model's log-probs hide
a sync that did not arrive. fp32: the engine runs in fp32 too, so a served sync equals the trainer. The compact tokenizer is
written beside it (vLLM returns log-probs only with a tokenizer).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch


def tiny_engine_config(layers: int = 3, hidden: int = 64, vocab: int = 128):
    from trex.models.deepseek_v3.config import tiny_v3

    return tiny_v3(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=2,
                   q_lora_rank=32, kv_lora_rank=512, qk_nope_head_dim=16, qk_rope_head_dim=64, v_head_dim=16,
                   n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=2,
                   num_nextn_predict_layers=0, max_position_embeddings=256, bos_token_id=0, eos_token_id=1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--head-scale", type=float, default=8.0)
    args = ap.parse_args(argv)

    from trex.checkpoint.save import save_pretrained
    from trex.models import build_model

    model = build_model(tiny_engine_config(args.layers, args.hidden), dtype=torch.float32, seed=args.seed)
    with torch.no_grad():
        model.head.weight.mul_(args.head_scale)
    save_pretrained(model, args.out, layout="hf", dtype="fp32", overwrite=True)
    write_tokenizer(args.out)
    return 0


def write_tokenizer(out: str) -> None:
    """trex's compact tokenizer as a fast tokenizer vLLM loads (it needs one to return log-probs)."""
    from trex.data.tokenizer import BOS, EOS, compact_tokenizer

    compact_tokenizer().backend.save(os.path.join(out, "tokenizer.json"))
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS,
                   "model_max_length": 256}, f)


if __name__ == "__main__":
    sys.exit(main())
