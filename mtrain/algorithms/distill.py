"""On-policy distillation: a frozen teacher scores the student's own samples token by token.

The signal per sampled token y_t is the one-sample estimate of the reverse KL(student || teacher):
    d_t = log pi_student(y_t) - log pi_teacher(y_t)      (0 on mask-0 tokens: environment turns, padding)
It enters the policy gradient as a per-token penalty on the advantage: A_t - coef * d_t, or alone as
-coef * d_t (the student is pushed toward tokens the teacher finds likelier than it does).
"""
from __future__ import annotations

import torch
from torch import Tensor

from mtrain.algorithms.masked import AlgorithmInputError, check_same_shape, masked_mean


def reverse_kl_per_token(student_logprobs: Tensor, teacher_logprobs: Tensor, mask: Tensor) -> Tensor:
    mask = check_same_shape(mask, student_logprobs=student_logprobs, teacher_logprobs=teacher_logprobs)
    zero = student_logprobs.new_zeros(())
    # select before subtracting: padding may hold -inf, and -inf - -inf is NaN
    s = torch.where(mask, student_logprobs.detach(), zero)
    t = torch.where(mask, teacher_logprobs.detach(), zero)
    return s - t


def distill_advantages(advantages: Tensor | None, student_logprobs: Tensor, teacher_logprobs: Tensor,
                       mask: Tensor, *, coef: float, only: bool = False) -> tuple[Tensor, dict[str, Tensor]]:
    """[n, T] advantages with the distillation term: adv - coef * d (only=False) or -coef * d (only=True;
    advantages may then be None). Returns (advantages, {"distill/reverse_kl": masked mean of d})."""
    if not coef > 0:
        raise AlgorithmInputError(f"distillation coef must be > 0, got {coef}")
    d = reverse_kl_per_token(student_logprobs, teacher_logprobs, mask)
    mask = mask.bool()
    if only:
        out = -coef * d
    else:
        if advantages is None or advantages.shape != mask.shape:
            raise AlgorithmInputError(f"advantages must be [n, T] like the mask {tuple(mask.shape)} "
                                      f"unless only=True")
        out = torch.where(mask, advantages - coef * d, advantages.new_zeros(()))
    return out, {"distill/reverse_kl": masked_mean(d, mask).detach()}
