"""GRPO math against numbers worked out by hand (see the comments), plus properties that must hold."""

import math

import pytest
import torch

from trex.posttrain.grpo_loss import group_advantages, k3_kl, policy_loss, token_entropy, token_weights


def test_group_advantages_hand_computed():
    # group 1: rewards 1,0,0,0 -> mean 0.25; deviations .75,-.25,-.25,-.25;
    #   unbiased var = (.5625 + 3 * .0625) / 3 = .25 -> std .5 -> A = 1.5, -.5, -.5, -.5
    # group 2: all equal -> A = 0 (no learning signal, no division by zero)
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 2.0, 2.0, 2.0])
    adv = group_advantages(rewards, group_size=4, eps=0.0)
    assert adv.tolist() == pytest.approx([1.5, -0.5, -0.5, -0.5, 0.0, 0.0, 0.0, 0.0])
    assert group_advantages(rewards, 4, scale_by_std=False).tolist() == pytest.approx(
        [0.75, -0.25, -0.25, -0.25, 0, 0, 0, 0])
    # the eps keeps a zero-variance group finite with the division on
    assert torch.isfinite(group_advantages(torch.ones(4), 4)).all()


def test_group_advantages_bad_shapes():
    with pytest.raises(ValueError, match="groups of 3"):
        group_advantages(torch.zeros(4), 3)
    with pytest.raises(ValueError, match=">= 2"):
        group_advantages(torch.zeros(4), 1)


def _example():
    # two completions, two token slots; the second completion has one real token
    mask = torch.tensor([[1, 1], [1, 0]])
    ratio = torch.tensor([[1.5, 0.9], [0.5, 7.0]])  # 7.0 sits on padding and must not count
    old = torch.log(torch.tensor([[0.2, 0.3], [0.4, 0.1]]))
    logp = (old + ratio.log()).requires_grad_()
    adv = torch.tensor([2.0, -1.0])
    return mask, old, logp, adv


def test_clipped_loss_hand_computed():
    mask, old, logp, adv = _example()
    # eps 0.2 -> clip range [0.8, 1.2]; pg = -min(r A, clip(r) A):
    #   (0,0) r 1.5, A 2:  min(3.0, 2.4) = 2.4 -> -2.4   clipped (r > 1.2, A > 0)
    #   (0,1) r 0.9, A 2:  min(1.8, 1.8) = 1.8 -> -1.8   not clipped
    #   (1,0) r 0.5, A -1: min(-0.5, -0.8) = -0.8 -> 0.8 clipped (r < 0.8, A < 0)
    expected = {"token": (-2.4 - 1.8 + 0.8) / 3,           # 3 tokens
                "sequence": ((-2.4 - 1.8) / 2 + 0.8) / 2,  # mean per completion, then over completions
                "constant": (-2.4 - 1.8 + 0.8) / (2 * 2)}  # max_len 2 x 2 completions
    for agg, value in expected.items():
        w = token_weights(mask, agg, n_sequences=2, n_tokens=3, max_len=2)
        out = policy_loss(logp, old, adv, w, mask, eps_low=0.2, eps_high=0.2)
        assert out.loss.item() == pytest.approx(value, abs=1e-6), agg
        assert out.clipped.item() == 2
    # gradient (token aggregation): clipped tokens give none; the free one d(-r A)/dlogp / 3 = -2 * 0.9 / 3
    w = token_weights(mask, "token", 2, 3, 2)
    policy_loss(logp, old, adv, w, mask).loss.backward()
    assert logp.grad.flatten().tolist() == pytest.approx([0.0, -0.6, 0.0, 0.0], abs=1e-6)


def test_asymmetric_clip():
    mask, old, logp, adv = _example()
    w = token_weights(mask, "token", 2, 3, 2)
    # eps_high 0.6: r = 1.5 is inside [0.8, 1.6] -> -3.0 instead of -2.4; eps_low unchanged
    out = policy_loss(logp, old, adv, w, mask, eps_low=0.2, eps_high=0.6)
    assert out.loss.item() == pytest.approx((-3.0 - 1.8 + 0.8) / 3, abs=1e-6)
    assert out.clipped.item() == 1


def test_on_policy_ratio_is_one_and_loss_is_minus_mean_advantage():
    logp = torch.log(torch.rand(4, 3)).requires_grad_()
    mask = torch.ones(4, 3)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    w = token_weights(mask, "sequence", 4, 12, 3)
    out = policy_loss(logp, logp.detach(), adv, w, mask)
    assert out.loss.item() == pytest.approx(-adv.mean().item(), abs=1e-6)
    assert out.clipped.item() == 0 and out.ratio_sum.item() == pytest.approx(12)


def test_k3_hand_computed_and_unbiased():
    # p = .5, ref = .25: e^d - d - 1 with d = ln(.5): .5 - ln .5 - 1 = 0.193147...
    assert k3_kl(torch.tensor(math.log(0.5)), torch.tensor(math.log(0.25))).item() == pytest.approx(
        0.5 + math.log(2) - 1, rel=1e-6)
    # its mean over samples of pi estimates KL(pi || ref)
    g = torch.Generator().manual_seed(0)
    pi = torch.tensor([0.6, 0.3, 0.1])
    ref = torch.tensor([0.2, 0.5, 0.3])
    x = torch.multinomial(pi, 200_000, replacement=True, generator=g)
    estimate = k3_kl(pi.log()[x], ref.log()[x]).mean().item()
    exact = (pi * (pi.log() - ref.log())).sum().item()
    assert estimate == pytest.approx(exact, rel=0.02)


def test_kl_term_adds_with_its_coefficient():
    mask, old, logp, adv = _example()
    ref = old - 0.3
    w = token_weights(mask, "token", 2, 3, 2)
    base = policy_loss(logp, old, adv, w, mask).loss
    with_kl = policy_loss(logp, old, adv, w, mask, ref_logp=ref, kl_coef=0.1)
    kl = k3_kl(logp, ref)
    expected_kl = (kl[0, 0] + kl[0, 1] + kl[1, 0]) / 3
    assert (with_kl.loss - base).item() == pytest.approx(0.1 * expected_kl.item(), abs=1e-6)
    assert with_kl.kl_sum.item() == pytest.approx(3 * expected_kl.item(), rel=1e-5)


@pytest.mark.parametrize("agg", ["token", "sequence", "constant"])
def test_micro_batch_split_gives_the_same_gradient(agg):
    torch.manual_seed(0)
    B, T = 6, 5
    mask = (torch.rand(B, T) < 0.7).float()
    mask[:, 0] = 1
    logp = torch.randn(B, T).requires_grad_()
    old = logp.detach() + 0.3 * torch.randn(B, T)
    adv = torch.randn(B)
    n_tok = int(mask.sum())
    whole = policy_loss(logp, old, adv, token_weights(mask, agg, B, n_tok, T), mask).loss
    (g_whole,) = torch.autograd.grad(whole, logp)
    parts = sum(policy_loss(logp[s], old[s], adv[s], token_weights(mask[s], agg, B, n_tok, T), mask[s]).loss
                for s in (slice(0, 2), slice(2, 6)))
    (g_parts,) = torch.autograd.grad(parts, logp)
    assert parts.item() == pytest.approx(whole.item(), abs=1e-6)
    torch.testing.assert_close(g_parts, g_whole)


def test_bad_aggregation():
    with pytest.raises(ValueError, match="token, sequence, constant"):
        token_weights(torch.ones(1, 1), "mean", 1, 1, 1)


def test_token_entropy():
    V = 16
    uniform = torch.zeros(3, 2, V)
    assert token_entropy(uniform, chunk=4).flatten().tolist() == pytest.approx([math.log(V)] * 6)
    logits = torch.randn(5, V)
    p = logits.softmax(-1)
    torch.testing.assert_close(token_entropy(logits, chunk=2), -(p * p.log()).sum(-1))
