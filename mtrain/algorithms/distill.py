"""On-policy distillation: a frozen teacher scores the student's own samples token by token.

On a sampled token y_t the single-sample estimate of the per-token reverse KL, KL(student || teacher), is
    k_t = log p_student(y_t) - log p_teacher(y_t)
and -k_t is the token's distillation reward: the student is pushed toward tokens the teacher finds likely
and away from those it does not (Agarwal et al. 2024, GKD; Lu & Thinking Machines 2025). Each token's
advantage is -coef * k_t on its own (no discount: the per-token KL already is the return of the one-step
game), alone or added to the task advantage.
"""
from __future__ import annotations

from torch import Tensor

from mtrain.algorithms.masked import AlgorithmInputError, check_same_shape, masked_fill_zero, masked_mean


def reverse_kl(student_logprobs: Tensor, teacher_logprobs: Tensor, mask: Tensor) -> Tensor:
    """[B, T] per-token estimate log p_s - log p_t on the sampled tokens, 0 where the mask is 0."""
    mask = check_same_shape(mask, student_logprobs=student_logprobs, teacher_logprobs=teacher_logprobs)
    return masked_fill_zero(masked_fill_zero(student_logprobs, mask) - masked_fill_zero(teacher_logprobs, mask),
                            mask)


def distill_advantages(student_logprobs: Tensor, teacher_logprobs: Tensor, mask: Tensor, *, coef: float,
                       task_advantages: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """[B, T] advantages: task_advantages (if given) - coef * (log p_s - log p_t), 0 where the mask is 0.
    Both logprobs are of the rollout's policy (detached): the term is a reward, not a differentiated loss."""
    if coef <= 0:
        raise AlgorithmInputError(f"distillation coef must be > 0, got {coef}")
    mask = check_same_shape(mask, task_advantages=task_advantages)
    k = reverse_kl(student_logprobs.detach(), teacher_logprobs.detach(), mask)
    adv = -coef * k
    if task_advantages is not None:
        adv = adv + masked_fill_zero(task_advantages.to(adv.dtype), mask)
    return masked_fill_zero(adv, mask), {"distill/reverse_kl": masked_mean(k.detach().float(), mask)}
