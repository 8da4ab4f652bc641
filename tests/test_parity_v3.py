"""Parity of the DeepSeek-V3 family with the reference no one here wrote: transformers 5.23
DeepseekV3ForCausalLM (and its MtpModel for the MTP layer).

Random-weight tiny models are saved with ``save_pretrained`` and loaded with
``trex.checkpoint.load_pretrained``; logits, loss and every parameter's gradient must match, in fp32.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from hf_oracle_v3 import YARN, hf_config, random_hf_model, randomize
from trex.checkpoint import load_pretrained
from trex.checkpoint.naming import to_trex

CONFIGS = {
    # query latent, 4 groups of 2 experts (top 2 groups), a dense first layer, YaRN + mscale past 16 tokens
    "qlora-groups-yarn": dict(overrides={}, batch=2, seq=37),
    # Moonlight's path: no query latent, no YaRN, eps 1e-5, two shared experts, one group, 3 of 8 experts
    "moonlight-path": dict(overrides=dict(q_lora_rank=None, rope_parameters={"rope_type": "default",
                                                                            "rope_theta": 50000.0},
                                          rms_norm_eps=1e-5, n_shared_experts=2, n_group=1, topk_group=1,
                                          num_experts_per_tok=3), batch=2, seq=29),
    # Kimi-K2's path: one group (no group limit), theta 5e4 with YaRN beta 1/1, two dense layers
    "kimi-path": dict(overrides=dict(n_group=1, topk_group=1, first_k_dense_replace=2, num_hidden_layers=4,
                                     rope_parameters={**YARN, "rope_theta": 50000.0, "factor": 8.0,
                                                      "beta_fast": 1, "beta_slow": 1}), batch=3, seq=23),
    # mscale != mscale_all_dim: transformers' split (cos/sin by their ratio, the softmax by mscale_all_dim)
    "unequal-mscale": dict(overrides=dict(rope_parameters={**YARN, "mscale": 0.8, "mscale_all_dim": 1.2}),
                           batch=1, seq=33),
}


def _pair(tmp_path, overrides, seed=0):
    ref = random_hf_model(hf_config(**overrides), seed=seed)
    ref.save_pretrained(tmp_path)
    ours = load_pretrained(str(tmp_path), dtype=torch.float32, device="cpu")
    return ref, ours


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp(min=1e-12)).item()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_loss_and_gradients_match_transformers(tmp_path, name):
    spec = CONFIGS[name]
    ref, ours = _pair(tmp_path, spec["overrides"])
    n_layers = ref.config.num_hidden_layers
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, ref.config.vocab_size, (spec["batch"], spec["seq"]), generator=gen)
    labels = ids.clone()
    labels[0, :5] = -100  # unlabelled prompt tokens

    r = ref(ids, labels=labels)
    o = ours(ids, labels=labels)
    assert (r.logits - o.logits).abs().max().item() <= 1e-4
    assert _rel(o.logits, r.logits) <= 1e-5  # measured ~5e-7; 1e-5 also sees the latent norms' eps
    assert abs(r.loss.item() - o.loss.item()) <= 1e-5 * abs(r.loss.item())

    r.loss.backward()
    o.loss.backward()
    ours_params = dict(ours.named_parameters())
    compared = 0
    for hf_name, p in ref.named_parameters():
        for key, _expert, ref_grad in to_trex(hf_name, p.grad, arch="deepseek_v3", n_layers=n_layers):
            err = _rel(ours_params[key].grad, ref_grad)
            assert err <= 1e-3, f"{key}: relative gradient error {err:.2e}"
            compared += 1
    trained = [k for k, p in ours_params.items() if p.grad is not None]
    assert compared == len(trained) == len(ours_params)  # every parameter of both, each once


def test_packed_documents_give_each_document_alone(tmp_path):
    """Two documents packed in one row: each one's logits (and its MTP head's) as if it were alone."""
    ref, ours = _pair(tmp_path, {})
    gen = torch.Generator().manual_seed(2)
    a, b = (torch.randint(0, 128, (1, n), generator=gen) for n in (13, 19))
    packed = torch.cat((a, b), dim=1)
    docs = torch.tensor([[0] * 13 + [1] * 19])
    together = ours(packed, doc_ids=docs).logits
    assert torch.allclose(together[:, :13], ours(a).logits, atol=1e-5, rtol=0)
    assert torch.allclose(together[:, 13:], ours(b).logits, atol=1e-5, rtol=0)
    assert torch.allclose(ref(b).logits, together[:, 13:], atol=1e-4, rtol=0)


def _released_mtp_tensors(mtp, n: int) -> dict[str, torch.Tensor]:
    """transformers' MtpModel's layer as the release stores it: ``model.layers.{n}.*``, per-expert names,
    ``shared_head.norm``, and the layer's copies of the embedding and the head (which trex compares with its own)."""
    out = {}
    for name, t in mtp.state_dict().items():
        if not name.startswith("layers.0."):
            continue
        name = name[len("layers.0."):].replace("mtp_block.", "").replace("post_norm.", "shared_head.norm.")
        if name.endswith("experts.gate_up_proj"):
            inter = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"model.layers.{n}.{name[:-len('gate_up_proj')]}{e}.gate_proj.weight"] = t[e, :inter]
                out[f"model.layers.{n}.{name[:-len('gate_up_proj')]}{e}.up_proj.weight"] = t[e, inter:]
        elif name.endswith("experts.down_proj"):
            for e in range(t.shape[0]):
                out[f"model.layers.{n}.{name[:-len('down_proj')]}{e}.down_proj.weight"] = t[e]
        else:
            out[f"model.layers.{n}.{name}"] = t
    out[f"model.layers.{n}.embed_tokens.weight"] = mtp.embed_tokens.weight.detach()  # tied to the main model's:
    out[f"model.layers.{n}.shared_head.head.weight"] = mtp.shared_head.weight.detach()  # trex checks the copies
    return {k: v.contiguous() for k, v in out.items()}


def test_mtp_matches_transformers_mtp_model(tmp_path):
    """The MTP layer, stored as the release stores it (``model.layers.{n}``), against transformers'
    MtpModel fed the main model's normed last hidden state: logits, loss and every gradient (the main
    model's through the hidden state and the shared embedding and head)."""
    from transformers.modeling_layers import MtpModel

    ref = random_hf_model(hf_config(num_nextn_predict_layers=1))
    mtp = MtpModel(ref, 1).float().eval()
    randomize(mtp.layers, seed=3)
    ref.save_pretrained(tmp_path)
    n = ref.config.num_hidden_layers
    tensors = load_file(tmp_path / "model.safetensors")
    save_file({**tensors, **_released_mtp_tensors(mtp, n)}, tmp_path / "model.safetensors", metadata={"format": "pt"})
    ours = load_pretrained(str(tmp_path), dtype=torch.float32, device="cpu")
    ids = torch.randint(0, 128, (2, 21), generator=torch.Generator().manual_seed(4))
    S = ids.shape[1]

    hidden = ref.model(ids).last_hidden_state  # after the final norm
    h = mtp.forward_layer(0, hidden[:, :-1], torch.arange(S - 1)[None], None, input_ids=ids[:, 1:])
    r_logits = mtp._project_to_logits(h)  # row t: token t + 2
    r_loss = F.cross_entropy(r_logits[:, :-1].flatten(0, 1), ids[:, 2:].flatten())
    o = ours(ids, labels=ids)
    assert (o.mtp_logits[0][:, :-1] - r_logits).abs().max().item() <= 1e-4
    assert _rel(o.mtp_logits[0][:, :-1], r_logits) <= 1e-5
    assert abs(o.mtp_loss.item() - r_loss.item()) <= 1e-5 * r_loss.item()

    r_loss.backward()
    o.mtp_loss.backward()
    ours_params = dict(ours.named_parameters())
    grads = {}
    for name, p in [*ref.named_parameters(), *(("model." + k, v) for k, v in mtp.named_parameters())]:
        if name.startswith("model.layers.0.") and name[len("model."):] in dict(mtp.named_parameters()):
            name = f"model.layers.{n}." + name[len("model.layers.0."):].replace("mtp_block.", "")
        for key, _expert, g in to_trex(name, p.grad if p.grad is not None else torch.zeros_like(p),
                                       arch="deepseek_v3", n_layers=n):
            grads[key] = g
    for key, p in ours_params.items():
        err = _rel(p.grad, grads[key])
        assert err <= 1e-3, f"{key}: relative gradient error {err:.2e}"
