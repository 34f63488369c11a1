"""The per-step work of PPO with a critic, called from the loop (through side_models.SideModels).

    values = every rank's share scored by the critic, summed into the whole batch on every rank
    adv, returns = GAE over the whole batch (whitening needs batch statistics)     -> the policy's update
                   (with algo.distill the teacher's term is added per minibatch, as for any algorithm)
    per minibatch: the critic's clipped value-loss step on the same rows as the policy's
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from mtrain.algorithms.gae import explained_variance, final_token_rewards, gae_advantages_returns, whiten
from mtrain.algorithms.masked import masked_mean, masked_var
from mtrain.dist import train_group
from mtrain.trainer.batch import RolloutBatch, dp_rows


def _scorer_rank() -> bool:
    """One rank per data-parallel share contributes to a world sum: last pipeline stage, TP (and CP) rank 0."""
    return (ps.is_pipeline_last_stage(ignore_virtual=True) and ps.get_tensor_model_parallel_rank() == 0
            and ps.get_context_parallel_rank() == 0)


def world_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum of a float64 CPU tensor over the scoring ranks (the others contribute zeros), on every rank."""
    t = t if _scorer_rank() else torch.zeros_like(t)
    group = train_group()  # separate placement: the training ranks' gloo group (engine ranks score nothing)
    if group is not None:
        x = t.clone()
        dist.all_reduce(x, group=group)
        return x
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
        adv, ret = gae_advantages_returns(final_token_rewards(batch.rewards.double(), mask), values, mask,
                                          gamma=cfg.critic.gamma, lam=cfg.critic.lam)
        if cfg.algo.adv_norm == "batch_std":  # verl's and OpenRLHF's default; the returns stay as they are
            adv = whiten(adv, mask, eps=cfg.algo.adv_eps)
        a = adv.float()
        metrics = {"adv/mean": masked_mean(a, mask), "adv/std": masked_var(a, mask).sqrt(),
                   "adv/max": a.masked_fill(~mask, float("-inf")).max() if mask.any() else a.new_zeros(()),
                   "adv/min": a.masked_fill(~mask, float("inf")).min() if mask.any() else a.new_zeros(()),
                   "critic/explained_var": explained_variance(values, ret, mask),
                   "critic/values_mean": masked_mean(values, mask), "critic/returns_mean": masked_mean(ret, mask)}
        self.values, self.returns = values, ret
        return adv.float(), metrics

    def update(self, minibatches: list[tuple[RolloutBatch, object, dict]]) -> dict[str, float]:
        """One critic step per (rows, their index into the batch, global norms) minibatch; mean metrics."""
        per = [self.critic.train_step(mb, self.values[sl].float(), self.returns[sl].float(), norms)
               for mb, sl, norms in minibatches]
        return {k: sum(m[k] for m in per) / len(per) for k in per[0]}

