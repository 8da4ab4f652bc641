"""On-policy distillation math: the weighted reverse KL over the full vocabulary.

At every position the student sampled, with student distribution p = softmax(z) and teacher
distributions q_i = softmax(u_i) (logits over the same vocabulary V):

    L = sum_i w_i KL(p || q_i) = sum_i w_i sum_v p_v (log p_v - log q_i,v)

and its gradient with respect to the student logits (the teachers are frozen) is

    dL/dz_v = p_v * (sum_i w_i (log p_v - log q_i,v) - L)

(differentiate KL(p||q) = sum p log p - sum p log q through the softmax: d p_v / d z_j =
p_v (delta_vj - p_j); the sum_v p_v d log p_v / d z_j term vanishes). The autograd function below
evaluates L and this gradient in fp32, ``chunk`` positions at a time, so the extra memory is a few
[chunk, V] fp32 buffers instead of several [N, V] ones whatever the number of positions.
"""

from __future__ import annotations

import torch


def _chunk_terms(z: torch.Tensor, teachers: list[torch.Tensor], weights: torch.Tensor):
    """fp32 log p [n, V], the weighted log-ratio sum_i w_i (log p - log q_i) [n, V] and the
    per-teacher KL [n_teachers, n] for one chunk of positions."""
    logp = torch.log_softmax(z.float(), dim=-1)
    p = logp.exp()
    mixed = torch.zeros_like(logp)
    per_teacher = []
    for w, u in zip(weights.tolist(), teachers):
        diff = logp - torch.log_softmax(u.float(), dim=-1)
        per_teacher.append((p * diff).sum(dim=-1))
        mixed.add_(diff, alpha=w)
    return logp, mixed, torch.stack(per_teacher)


class _ReverseKL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, student, weights, chunk, *teachers):
        n = student.shape[0]
        total = torch.empty(n, dtype=torch.float32, device=student.device)
        per_teacher = torch.empty(len(teachers), n, dtype=torch.float32, device=student.device)
        for i in range(0, n, chunk):
            _, _, kl = _chunk_terms(student[i:i + chunk], [u[i:i + chunk] for u in teachers], weights)
            per_teacher[:, i:i + chunk] = kl
            total[i:i + chunk] = (weights[:, None] * kl).sum(dim=0)
        ctx.save_for_backward(student, weights, total, *teachers)
        ctx.chunk = chunk
        ctx.mark_non_differentiable(per_teacher)
        return total, per_teacher

    @staticmethod
    def backward(ctx, grad_total, _grad_per_teacher):
        student, weights, total, *teachers = ctx.saved_tensors
        grad = torch.empty_like(student)
        for i in range(0, student.shape[0], ctx.chunk):
            s = slice(i, i + ctx.chunk)
            logp, mixed, _ = _chunk_terms(student[s], [u[s] for u in teachers], weights)
            g = logp.exp() * (mixed - total[s, None])
            grad[s] = (g * grad_total[s, None].float()).to(grad.dtype)
        return grad, None, None, *([None] * len(teachers))


def reverse_kl(student_logits: torch.Tensor, teacher_logits: list[torch.Tensor], weights: list[float],
               chunk: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted reverse KL per position and each teacher's KL.

    student_logits [N, V] (differentiable), teacher_logits: one [N, V] per teacher (no grad),
    weights: one w_i per teacher. Returns (sum_i w_i KL(p || q_i) [N] fp32, differentiable with
    respect to the student logits; KL(p || q_i) [n_teachers, N] fp32, detached).
    """
    if not teacher_logits or len(teacher_logits) != len(weights):
        raise ValueError(f"distill: {len(teacher_logits)} teacher logit tensors for {len(weights)} weights; "
                         "expected one weight per teacher and at least one teacher")
    for i, u in enumerate(teacher_logits):
        if u.shape != student_logits.shape:
            raise ValueError(f"distill: teacher {i} logits have shape {tuple(u.shape)}, the student's "
                             f"{tuple(student_logits.shape)}; teachers and student must share the vocabulary")
    if chunk < 1:
        raise ValueError(f"distill: chunk must be >= 1, got {chunk}")
    w = torch.tensor(weights, dtype=torch.float32, device=student_logits.device)
    return _ReverseKL.apply(student_logits, w, chunk, *[u.detach() for u in teacher_logits])
