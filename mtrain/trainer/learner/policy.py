"""The training ranks' learner: batch -> stale mask -> advantages (estimator) -> per-minibatch terms -> PPO updates.

Every part is given at construction (mtrain/trainer/roles.py builds them from the config); nothing here asks which
features are on. docs/design-trainer.md.
"""
from __future__ import annotations

import time
from pathlib import Path

import torch

from mtrain.algorithms import uniform_groups
from mtrain.config import ConfigError
from mtrain.rollout.trajectory import to_batch
from mtrain.trainer import checkpoint
from mtrain.trainer.batch import RolloutBatch, build_batch, dp_rows
from mtrain.trainer.learner.routing_replay import routing_metrics
from mtrain.trainer.learner.scoring import Recompute
from mtrain.trainer.train_samples import write_train_samples


def _synced_clock() -> float:
    """perf_counter after the GPU's queued work: a phase's time is then its kernels', not their launches'."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return time.perf_counter()


class NoReference:
    """algo.kl_coef unset: no reference model, no KL term."""

    def logprobs(self, mb):
        return None


class KeepAllGroups:
    """algo.filter_uniform_groups off: every row is trained."""

    def __call__(self, full, n: int):
        return full, full.size, {}


class DropUniformGroups:
    """DAPO dynamic sampling: leave out groups whose rewards are all equal (no learning signal).

    Kept groups come first; when their count does not split into data-parallel ranks x micro batches, rows of
    dropped groups fill the gap with an all-zero response mask, so they add nothing to loss, gradient,
    token counts or metrics. Returns (batch or None when every group is dropped, kept rows, metrics)."""

    def __init__(self, cfg):
        self.cfg = cfg

    def __call__(self, batch: RolloutBatch, n: int):
        uniform = uniform_groups(batch.rewards, n)
        keep = (~uniform).repeat_interleave(n)
        kept_rows = int(keep.sum())
        metrics = {"filter/dropped_groups": float(uniform.sum()), "filter/kept_groups": float((~uniform).sum())}
        if kept_rows == 0:
            return None, 0, metrics
        from megatron.core import parallel_state as ps
        packed = self.cfg.train.max_tokens_per_micro_batch is not None  # packed: any count per rank will do
        unit = ps.get_data_parallel_world_size() * (1 if packed else self.cfg.train.micro_batch_size)
        fill = -(-kept_rows // unit) * unit - kept_rows  # <= dropped rows: the full batch splits into units
        idx = torch.cat([keep.nonzero().flatten(), (~keep).nonzero().flatten()[:fill]])
        out = batch.select(idx)
        out.response_mask[kept_rows:] = 0.0
        out.engine_logprobs[kept_rows:] = 0.0
        return out, kept_rows, metrics


class PolicyLearner:
    def __init__(self, cfg, *, actor, reference, estimator, terms, side, offload, groups_filter, memory, tokenizer,
                 run_dir: Path, rank: int, scorer=None):
        self.cfg, self.actor, self.reference, self.estimator, self.terms = cfg, actor, reference, estimator, terms
        self.scorer = scorer if scorer is not None else Recompute(actor)  # the proximal logprobs (scoring.py)
        self.side, self.offload, self.groups_filter, self.memory = side, offload, groups_filter, memory
        self.tokenizer, self.run_dir, self.rank = tokenizer, run_dir, rank
        self._moves: dict[str, float] = {}

    def begin(self, step: int) -> None:
        self._moves = self.offload.offload()  # no-op unless engine.offload_train (and already done after a step)
        self._moves.update(self.side.offload())
        self.side.begin(step)

    def report(self, local: dict[str, float]) -> dict[str, float]:
        return local

    def reload(self) -> None:
        self.offload.reload()  # the optimizer state must be in place to be saved
        self.side.reload()

    def save(self, run_dir: Path, step: int, state: dict) -> None:
        checkpoint.save(run_dir, step, self.actor, state, extra=self.side.extra_models())

    def load(self, path: Path) -> dict:
        return checkpoint.load(path, self.actor, extra=self.side.extra_models())

    def build_batch(self, res) -> RolloutBatch:
        from megatron.core import parallel_state as ps
        # Sequence parallelism (TP with Transformer Engine) splits the sequence over TP ranks: pad to a multiple.
        pad = self.tokenizer.pad_token_id or 0
        tp = ps.get_tensor_model_parallel_world_size()
        if res.trajectories is None:
            return build_batch(res.completions, res.rewards, pad_id=pad, pad_to_multiple=tp, routing=self.actor.routing)
        return to_batch(res.trajectories, pad_id=pad, pad_to_multiple=tp, routing=self.actor.routing)

    def learn(self, res, step: int, source) -> tuple[dict[str, float], dict[str, float]]:
        cfg, n = self.cfg, self.cfg.rollout.samples_per_prompt
        from megatron.core import parallel_state as ps
        t1 = time.perf_counter()
        full = self.build_batch(res)
        write_train_samples(self.run_dir, step + 1, full, self.tokenizer, self.rank)  # RUN_DIR/train_samples.jsonl
        local = dict(source.mask_stale(full, step))
        batch, rows, filtered = self.groups_filter(full, n)
        local.update(filtered)
        moves, train_metrics, old_lp, mine = self._moves, {}, None, None
        t2 = t3 = t_train = time.perf_counter()
        if batch is not None:
            # The rollout is over: colocated engines hand their weights and KV cache back before the scoring pass,
            # which then has the training step's memory (with the engine resident, a Qwen3-4B shape on one H200 ran
            # out of memory in it at engine.mem_fraction_static=0.6, 2026-12-02)
            self.memory.release()
            # Advantages of the kept groups only (batch-level whitening must not see the dropped ones);
            # filler rows (past `rows`) belong to uniform groups, whose advantage is 0.
            adv, adv_metrics = self.estimator(batch, rows)
            adv = adv[:rows]
            adv = torch.cat([adv, adv.new_zeros((batch.size - rows, adv.shape[1]))])
            local.update({k: float(v) for k, v in adv_metrics.items()})
            local.update(self.scorer.begin(batch, step))
            # PPO minibatches: train.global_batch_size samples per optimizer step (default: the whole batch, one
            # step). Every minibatch is scored by the rollout policy before the first update.
            gbs = min(cfg.train.global_batch_size or batch.size, batch.size)
            if batch.size % gbs and cfg.algo.filter_uniform_groups:
                gbs = batch.size  # the filter left a batch that does not split: one update for this step
            if batch.size % gbs:
                raise ConfigError(f"train.global_batch_size: {gbs} does not divide the {batch.size} rows trained "
                                  f"this step")
            dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
            minibatches, slices = [], []
            # the logprob phase's parts (issue 44: the phase varied 1.7-10 s beyond its floor on a GPU): the batch's
            # making and the engine's release before this point, then the policy's and the reference's passes
            parts = {"time/logprobs_prepare": _synced_clock() - t1, "time/logprobs_policy": 0.0,
                     "time/logprobs_reference": 0.0}
            for start in range(0, batch.size, gbs):
                sl = dp_rows(batch.seq_lens[start:start + gbs], dp_rank, dp_size,
                             by_tokens=cfg.train.max_tokens_per_micro_batch is not None)
                sl = slice(start + sl.start, start + sl.stop) if isinstance(sl, slice) else start + sl
                mb = batch.select(sl)
                slices.append(sl)
                kept = min(max(rows - start, 0), gbs)  # rows past `rows` are zero-mask fillers (DAPO filter)
                t = _synced_clock()
                lp = self.scorer.logprobs(mb)
                a = adv[sl]
                for term in self.terms:  # e.g. distillation: adv - coef * (student - teacher logprobs)
                    a = term.advantages(mb, a, lp)
                t_ref = _synced_clock()
                ref = self.reference.logprobs(mb)
                t_end = _synced_clock()
                parts["time/logprobs_policy"] += t_ref - t
                parts["time/logprobs_reference"] += t_end - t_ref
                minibatches.append((mb, a, lp, ref, {"num_tokens": float(batch.response_mask[start:start + gbs].sum()),
                                                     "num_seqs": float(kept)}))
            local.update(parts)
            for term in self.terms:
                local.update(term.metrics())
            # engine vs trainer's own routing (from the scoring pass), and the routing bytes the engines sent
            local.update(routing_metrics(self.actor, res.completions if res.trajectories is None else res.trajectories))
            # the optimizer state's way back (engine.offload_train) is its own phase, time/reload: neither scoring
            # nor training (it was counted as scoring before)
            t2 = _synced_clock()
            moves.update(self.offload.reload())
            moves.update(self.side.reload())
            t_train = _synced_clock()
            per_update = [self.actor.train_step(mb, old, a, ref, norms) for mb, a, old, ref, norms in minibatches
                          ] if self.side.policy_trains else []  # the critic's warm-up: the policy waits
            train_metrics = {k: sum(m[k] for m in per_update) / len(per_update) for k in per_update[0]} \
                if per_update else {}
            train_metrics["ppo/updates"] = float(len(per_update))
            train_metrics.update(self.side.update(minibatches, slices))
            t3 = _synced_clock()
            mine = RolloutBatch.concat([m[0] for m in minibatches])
            old_lp = None if minibatches[0][2] is None else torch.cat([m[2] for m in minibatches])
            moves.update(self.offload.offload())
            moves.update(self.side.offload())
            self.memory.resume_weights()
        local.update(moves)
        if old_lp is not None:
            local.update({**train_metrics, **self.scorer.gap(old_lp, mine)})
        summary = {"reward/mean": float(full.rewards.mean()),
                   "response_len/mean": float(full.response_lens.float().mean()),
                   "prompt_len/mean": float((full.seq_lens - full.response_lens).float().mean()),
                   "time/logprobs": t2 - t1, "time/train": t3 - t_train}
        if batch is None:
            summary["update_skipped"] = 1.0  # every group was uniform: nothing to learn from this rollout
        return local, summary
