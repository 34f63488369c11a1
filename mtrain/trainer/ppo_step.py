"""The per-step work of PPO with a critic and of on-policy distillation, called from the loop.

    values = every rank's share scored by the critic, summed into the whole batch on every rank
    adv, returns = GAE over the whole batch (whitening needs batch statistics)     -> the policy's update
    per minibatch: the critic's clipped value-loss step on the same rows as the policy's
    distillation: per minibatch, the teacher scores the rows the policy scored; adv -= coef * (lp_s - lp_t)
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from mtrain.algorithms.distill import distill_advantages
from mtrain.algorithms.gae import gae_advantages
from mtrain.algorithms.masked import masked_mean
from mtrain.algorithms.value_loss import explained_variance
from mtrain.trainer.batch import RolloutBatch, dp_rows


def _scorer_rank() -> bool:
    """One rank per data-parallel share contributes to a world sum: last pipeline stage, TP (and CP) rank 0."""
    return (ps.is_pipeline_last_stage(ignore_virtual=True) and ps.get_tensor_model_parallel_rank() == 0
            and ps.get_context_parallel_rank() == 0)


def world_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum of a float64 CPU tensor over the scoring ranks (the others contribute zeros), on every rank."""
    t = t if _scorer_rank() else torch.zeros_like(t)
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    x = t.to(dev)
    dist.all_reduce(x)
    return x.cpu()


class CriticStep:
    def __init__(self, cfg, critic):
        self.cfg, self.critic = cfg, critic
        self.values = self.returns = None

    def advantages(self, batch: RolloutBatch, rows: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """[B, T-1] GAE advantages of the whole batch (the first `rows` rows; 0 for the filler after them) on
        every rank; keeps the batch's values and returns for the critic's update."""
        cfg = self.cfg
        sl = dp_rows(batch.seq_lens, ps.get_data_parallel_rank(), ps.get_data_parallel_world_size(),
                     by_tokens=cfg.train.max_tokens_per_micro_batch is not None)
        part = self.critic.values(batch.select(sl))
        full = torch.zeros(batch.response_mask.shape, dtype=torch.float64)
        if part is not None:
            full[sl] = part
        values = world_sum(full)
        mask = batch.response_mask.bool().clone()
        mask[rows:] = False
        adv, ret, metrics = gae_advantages(batch.rewards.double(), values, mask, gamma=cfg.critic.gamma,
                                           lam=cfg.critic.lam, eps=cfg.algo.adv_eps,
                                           whitening="batch" if cfg.algo.adv_norm == "batch_std" else "none")
        metrics["critic/explained_var"] = explained_variance(values, ret, mask)
        metrics["critic/values_mean"] = masked_mean(values, mask)
        self.values, self.returns = values, ret
        return adv.float(), metrics

    def update(self, minibatches: list[tuple[RolloutBatch, object, dict]]) -> dict[str, float]:
        """One critic step per (rows, their index into the batch, global norms) minibatch; mean metrics."""
        per = [self.critic.train_step(mb, self.values[sl].float(), self.returns[sl].float(), norms)
               for mb, sl, norms in minibatches]
        return {k: sum(m[k] for m in per) / len(per) for k in per[0]}


def distill_minibatch_advantages(cfg, adv: torch.Tensor, student_lp, teacher_lp, mask: torch.Tensor
                                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(advantages, sum of the reverse-KL estimate, token count) of one minibatch (this rank's rows); on ranks
    without logprobs (not the last pipeline stage) the advantages pass through unchanged, the sums are 0."""
    zero = torch.zeros((), dtype=torch.float64)
    if student_lp is None:
        return adv, zero, zero
    d = cfg.algo.distill
    m = mask.bool()
    out, _ = distill_advantages(student_lp, teacher_lp, m, coef=d.coef,
                                task_advantages=adv if d.with_task_advantage else None)
    k = (student_lp - teacher_lp).double()
    return out.to(adv.dtype), k[m].sum(), m.sum().double()
