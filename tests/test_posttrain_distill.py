"""Reverse-KL distillation math against a straightforward full-vocabulary autograd implementation."""

import pytest
import torch

from trex.posttrain.distill_loss import reverse_kl


def _reference(z, teachers, weights):
    logp = torch.log_softmax(z, -1)
    per = [(logp.exp() * (logp - torch.log_softmax(u, -1))).sum(-1) for u in teachers]
    return sum(w * k for w, k in zip(weights, per)), torch.stack(per)


@pytest.mark.parametrize("chunk", [1, 3, 64])
def test_value_and_gradient_match_autograd(chunk):
    torch.manual_seed(0)
    N, V = 7, 11
    teachers = [torch.randn(N, V) * 2, torch.randn(N, V)]
    weights = [0.7, 0.3]
    z = (torch.randn(N, V) * 1.5).requires_grad_()
    upstream = torch.rand(N)

    total, per = reverse_kl(z, teachers, weights, chunk=chunk)
    (grad,) = torch.autograd.grad((total * upstream).sum(), z)

    z_ref = z.detach().clone().requires_grad_()
    ref_total, ref_per = _reference(z_ref, teachers, weights)
    (ref_grad,) = torch.autograd.grad((ref_total * upstream).sum(), z_ref)

    torch.testing.assert_close(total, ref_total)
    torch.testing.assert_close(per, ref_per)
    torch.testing.assert_close(grad, ref_grad)
    assert not per.requires_grad


def test_zero_at_the_teacher_and_gradient_descent_reaches_it():
    torch.manual_seed(1)
    u = torch.randn(4, 9)
    total, _ = reverse_kl(u.clone(), [u], [1.0])
    assert total.abs().max().item() < 1e-6
    z = torch.zeros(4, 9, requires_grad=True)
    opt = torch.optim.SGD([z], lr=4.0)
    first = None
    for _ in range(60):
        loss = reverse_kl(z, [u], [1.0])[0].mean()
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.01 * first


def test_bf16_student_gets_a_bf16_gradient():
    z = torch.randn(3, 5, dtype=torch.bfloat16, requires_grad=True)
    total, _ = reverse_kl(z, [torch.randn(3, 5, dtype=torch.bfloat16)], [1.0])
    assert total.dtype == torch.float32
    total.sum().backward()
    assert z.grad.dtype == torch.bfloat16


def test_bad_inputs():
    z = torch.randn(3, 5)
    with pytest.raises(ValueError, match="vocabulary"):
        reverse_kl(z, [torch.randn(3, 6)], [1.0])
    with pytest.raises(ValueError, match="one weight per teacher"):
        reverse_kl(z, [torch.randn(3, 5)], [0.5, 0.5])
