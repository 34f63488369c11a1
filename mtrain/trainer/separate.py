"""engine.placement=separate in the trainer: training ranks train, engine ranks generate, weights go shard to shard.

The job's first ranks train (Megatron's groups over them only, `init_distributed(train_world=)`), the last
`engine.ranks` host the engines (`SeparateGroups`). Both kinds of rank run the same loop, so every collective of
the default group is entered by every rank in the same order:

    rollout   every rank calls the pool (the same prompts, seeds and ids); the engine ranks' engines serve the shared
              queue, every rank gets every group (one_step: the next step's rollout in the background, on its own
              gloo group, exactly as colocated, `OneStepRollout`; stream: `StreamRollout`'s generator thread)
    train     training ranks only (engine ranks: nothing; one_step: they wait for their background rollout)
    sync      `SeparateSync`: training ranks send the pieces each engine rank needs (`mtrain.reshard.remote`);
              stream: into the running generation (`StreamRollout.update`: the engine ranks pause in place once the
              training ranks are ready to send)
    metrics   one all_gather_object (engine ranks give none)

`EngineRankTrainer` is the engine ranks' side of that loop: no Megatron model, no optimizer. Checkpoints: the
training ranks write and load them; engine ranks join the collectives of megatron's dist_checkpointing, which run over
the default group (`checkpoint.save_without_model` / `load_without_model`), and read the step and the sampler
(stream and one_step: the state before the pending batches drew their prompts) from trainer_state.pt.
docs/design-async.md, "Separate placement".
"""
from __future__ import annotations

import os
from pathlib import Path

import torch.distributed as dist

from mtrain.rollout.partial import length_budget
from mtrain.rollout.pool import RolloutPool
from mtrain.trainer import checkpoint
from mtrain.trainer.engines import make_engine
from mtrain.trainer.loop import Trainer, _reduce_metrics
from mtrain.trainer.publishers.separate import SeparateSync


# default-group gathers in megatron-core 0.16.1's get_megatron_optimizer without overlapped parameter gathers
OPTIMIZER_GATHERS = 2


class EngineRankTrainer(Trainer):
    """An engine rank of separate placement: hosts its engine, serves the pool and receives the weights, step by
    step in lockstep with the training ranks' `Trainer` (`run`, `evaluate`, `finish` are the Trainer's own)."""

    def __init__(self, cfg):
        hf_dir = self._start(cfg)  # the same groups, config, data and sampler as the training ranks' Trainer
        d = self.decisions
        self.engine = make_engine(cfg, hf_dir, self.hf_config, d, self.rank) if d.groups.is_leader(self.rank) else None
        self.engine_part = None
        self.pool = RolloutPool(d.groups, self.rank, self.engine, max_groups_in_flight=cfg.rollout.max_groups_in_flight)
        # megatron-core's get_megatron_optimizer aligns parameter groups over the default group (an
        # all_gather_object of their keys per call of _get_param_groups_and_buffers: the dense chunks', then the
        # expert parameters'): the policy's optimizer is built on the training ranks at this point of their start,
        # so the engine ranks join those gathers with no keys.
        for _ in range(OPTIMIZER_GATHERS):
            dist.all_gather_object([None] * dist.get_world_size(), [])
        self.partial = self.agents = self.tools = self.rollout_fn = None
        if cfg.multi_turn.rollout_fn:
            from mtrain.rollout.agents.setup import build_tool_server, load_rollout_fn
            self.tools, self.rollout_fn = build_tool_server(cfg.multi_turn), load_rollout_fn(cfg.multi_turn.rollout_fn)
        self.async_rollout = None
        if cfg.rollout.async_mode == "one_step":
            from mtrain.trainer.sources.one_step import OneStepRollout
            self.async_rollout = OneStepRollout(self)  # the same new_group calls, in the same order, as training ranks
        elif cfg.rollout.async_mode == "stream":
            from mtrain.trainer.sources.stream import StreamRollout
            self.async_rollout = StreamRollout(self)
        self.sync = SeparateSync(cfg, d, self.layout, self.rank, engine=self.engine, dtype=d.engine_dtype)
        self.metrics, self.offload, self.side = None, _Nothing(), _Nothing()
        self.step = 0
        self._resume()
        self.sync.sync(version=self.step)

    def _resume(self) -> bool:
        """The step and the sampler of the checkpoint the training ranks resume from (their Trainer loads the
        weights); the engines receive those weights by the first sync."""
        r = self.cfg.train.resume
        path = None if r == "never" else (checkpoint.find_latest(self.run_dir, None) if r == "auto" else Path(r))
        if path is None:
            return False
        state = checkpoint.load_without_model(path)  # the training ranks' load runs collectives over the job
        self.step = state["step"]
        self.sampler.load_state_dict(state["sampler"])
        return True

    def _save_checkpoint(self, state: dict) -> None:
        """The training ranks write the checkpoint; this rank joins the collectives of their save."""
        checkpoint.save_without_model(self.run_dir, self.step)

    def train_step(self) -> dict[str, float]:
        cfg = self.cfg
        if cfg.rollout.async_mode == "stream":  # the generator thread runs on; the update goes in place
            self.async_rollout.step(self.step, cfg.train.steps)
            self.async_rollout.wait()
            self.step += 1
            self.async_rollout.update(self.sync, self.step)  # pause this rank's engine, receive, continue
            return _reduce_metrics({})
        if self.async_rollout is not None:
            self.async_rollout.step(self.step, cfg.train.steps)
            self.async_rollout.wait()  # the engines finish step N+1's groups before the weights change
        else:
            samples = [self.train_set[i] for i in self.sampler.next_batch()]
            self._rollout(samples, n=cfg.rollout.samples_per_prompt,
                          seed=cfg.train.seed * 1_000_003 + self.step * 10_007, prefix=f"s{self.step}",
                          max_new_tokens=length_budget(cfg.rollout, self.step))
        self.step += 1
        self.sync.sync(version=self.step)
        return _reduce_metrics({})


class _Nothing:
    """Offload and side models of an engine rank: there is no training state to move."""

    def reload(self) -> dict:
        return {}

    def offload(self) -> dict:
        return {}

    def extra_models(self) -> dict:
        return {}


def dist_world() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def is_engine_rank(cfg) -> bool:
    """Separate placement: this process (torchrun's RANK) is one of the last engine.ranks ranks."""
    return cfg.engine.placement == "separate" and int(os.environ.get("RANK", "0")) >= dist_world() - cfg.engine.ranks
