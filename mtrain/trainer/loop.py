"""`mtrain train`: the RL loop, top to bottom.

    build the roles (mtrain/trainer/roles.py) -> for each step: source.next_batch -> rewards checked ->
    learner.learn (batch, advantages, update) -> source.before_publish -> source.publish(publisher) -> metrics ->
    checkpoint

One class on every rank, whatever the placement: an engine rank of separate placement holds a learner with no model
(learner/engine_rank.py) and runs the same calls in the same order. This file only orders the roles; which features
are on is decided once, in roles.py. docs/design-trainer.md.
"""
from __future__ import annotations

import gc
import json
import logging
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from mtrain.config import ConfigError
from mtrain.data import load_datasets
from mtrain.rollout.judge_engine import make_reward_fn
from mtrain.data.sampler import PromptSampler
from mtrain.dist import destroy as destroy_distributed, init_distributed
from mtrain.layouts import model_layout
from mtrain.models.hf_config import context_length
from mtrain.metrics import MetricsWriter
from mtrain.wandb_log import wandb_sink
from mtrain.run_files import CONFIG_FILE, EVAL_SAMPLES_FILE
from mtrain.trainer.run_dir import set_aside
from mtrain.run_output import summary as run_summary
from mtrain.trainer import checkpoint
from mtrain.trainer.decisions import decide
from mtrain.trainer.evaluation import evaluate_in_chunks
from mtrain.trainer.engines import load_tokenizer
from mtrain.trainer.generation.rollouts import tool_metrics
from mtrain.trainer.placement import Placement
from mtrain.trainer.roles import build_roles
from mtrain.trainer.reward_check import checked_rewards
from mtrain.trainer.train_samples import keep_rows_through

log = logging.getLogger("mtrain")


def _reduce_metrics(local: dict[str, float]) -> dict[str, float]:
    """Merge every rank's metrics on all ranks: max for '*max*' keys, mean otherwise."""
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    keys = sorted({k for g in gathered for k in g})
    out = {}
    for k in keys:
        vals = [g[k] for g in gathered if k in g]
        out[k] = max(vals) if "max" in k else sum(vals) / len(vals)
    return out


class Trainer:
    def __init__(self, cfg):
        hf_dir = self._start(cfg)
        build_roles(self, hf_dir)  # learner, engine, pool, generate, source, sync (the publisher), memory
        self.step = 0
        resumed = self._resume()
        if self.rank == 0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            cfg.dump_yaml(self.run_dir / CONFIG_FILE)
            from mtrain.job_split import train_world
            print(run_summary(cfg, self.hf_config, dist.get_world_size(), train_world(cfg, dist.get_world_size())),
                  flush=True)  # full: config.yaml
            print(self.decisions.summary(), flush=True)
            print(f"{self.placement.split.describe()} rollout.async={cfg.rollout.async_mode}", flush=True)
        # resume_step=None on a fresh start: a previous run's metrics in this run_dir are replaced, not kept.
        if self.rank == 0:
            keep_rows_through(self.run_dir, self.step if resumed else None)  # train/eval_samples.jsonl alike
        self.metrics = MetricsWriter(self.run_dir, resume_step=self.step if resumed else None,
                                     total_steps=cfg.train.steps, tensorboard=cfg.train.log_tensorboard,
                                     sinks=tuple(s for s in [wandb_sink(cfg, self.run_dir)] if s)
                                     ) if self.rank == 0 else None
        self.sync.publish(self.step)

    def _start(self, cfg) -> Path:
        """What every rank of the job sets up first, training and (separate placement) engine ranks alike: the
        process groups, the run's decisions, the model's config and layout, tokenizer, data, reward and sampler.
        Returns the HF directory."""
        p = cfg.parallel
        separate = cfg.engine.placement == "separate"  # Megatron over the training ranks only (trainer/placement.py)
        init_distributed(tp=p.tp, pp=p.pp, vpp=p.vpp, ep=p.ep, etp=p.etp, cp=p.cp, seed=cfg.train.seed,
                         timeout_s=cfg.train.collective_timeout_s,
                         train_world=int(os.environ.get("WORLD_SIZE", 1)) - cfg.engine.ranks if separate else None)
        self.cfg, self.rank = cfg, dist.get_rank()
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
        hf_dir = Path(cfg.model.hf_path)
        self.hf_config = json.loads((hf_dir / "config.json").read_text())
        self.decisions = decide(cfg, world_size=dist.get_world_size(), local_world_size=local_world,
                                hf_config=self.hf_config)  # the model's shapes decide engine.fp8_scaling=auto
        self.placement = Placement(cfg, dist.get_world_size(), self.rank)
        self.run_dir = Path(cfg.train.run_dir)
        # RL updates the main model only: MTP layers (DeepSeek-V3) are carried by the converters.
        self.train_config = dict(self.hf_config, num_nextn_predict_layers=0)
        self.layout = model_layout(self.train_config, mtp=False)
        self.max_positions = context_length(self.hf_config)
        if self.max_positions is not None and cfg.rollout.max_new_tokens >= self.max_positions:
            raise ConfigError(f"rollout.max_new_tokens: {cfg.rollout.max_new_tokens} leaves no room for a prompt in "
                              f"the model's context (max_position_embeddings={self.max_positions})")
        self.tokenizer = load_tokenizer(hf_dir, self.hf_config, max_pixels=cfg.data.max_pixels)
        self.train_set, self.eval_set = load_datasets(cfg)
        # reward.fn, or the judge of reward.judge on an engine of its own (never in the pool, never synced)
        self.reward_fn = make_reward_fn(cfg, engine_kind=self.decisions.engine_kind,
                                        engine_dtype=self.decisions.engine_dtype)
        self.sampler = PromptSampler(len(self.train_set), cfg.rollout.prompts_per_step, seed=cfg.data.seed,
                                     shuffle=cfg.data.shuffle)
        return hf_dir

    def _resume(self) -> bool:
        r = self.cfg.train.resume
        report = print if self.rank == 0 else None  # why a newer checkpoint is skipped, said once
        path = checkpoint.resume_path(r, self.run_dir, report)
        if path is not None:
            state = self.learner.load(path)  # engine ranks: the step and the sources' state only
            self.step = state["step"]
            self.source.load_state_dict(state, path)
        # What is not this run's history (an earlier run, or the steps after the resumed one) is moved aside, not
        # overwritten or mixed; after the load, so that a checkpoint that does not load moves nothing.
        line = set_aside(self.run_dir, r, path, self.step) if self.rank == 0 else None
        if line:
            print(line, flush=True)
        dist.barrier()  # no rank goes on (and none writes into run_dir) before the move is done
        if path is not None and self.rank == 0:
            print(f"resumed from {path} at step {self.step}", flush=True)
        return path is not None

    def _rollout(self, samples, *, n, seed, prefix, greedy=False, max_new_tokens=None):
        return self.generate(self.pool, samples, n=n, seed=seed, prefix=prefix, greedy=greedy,
                             max_new_tokens=max_new_tokens)

    def evaluate(self) -> dict[str, float]:
        if not self.eval_set:
            return {}
        n = self.cfg.train.eval_samples
        trajectories = []  # multi-turn rollouts: every chunk's, for the eval's tool metrics

        def rollout(part, prefix):
            res = self._rollout(part, n=n, seed=10**9, prefix=prefix, greedy=True)
            if self.generate.reports_tool_metrics:  # (agents' trajectories carry their own metrics, not these)
                trajectories.extend(res.trajectories)
            return res

        mean, rows = evaluate_in_chunks(rollout, self.eval_set, n, step=self.step, show=self.rank == 0)
        if self.rank == 0:  # a few answers per eval, so that a score can be checked by reading what was said
            self.run_dir.mkdir(parents=True, exist_ok=True)
            shown = [{"step": self.step, "index": sample.index, "answer": str(sample.answer), "response": text,
                      "reward": r} for sample, text, r in rows[:8 * n]]
            with open(self.run_dir / EVAL_SAMPLES_FILE, "a", encoding="utf-8") as f:
                f.writelines(json.dumps(row) + "\n" for row in shown)
            if self.metrics is not None:
                self.metrics.log_table(self.step, "eval/samples", shown)
        out = {"eval/reward_mean": mean}
        # tool-call rate, valid-call rate, drift... of the greedy eval (named as in training: eval/tools/...)
        out.update({f"eval/tools/{k}": v for k, v in tool_metrics(trajectories).items()})
        return out

    def train_step(self) -> dict[str, float]:
        self.learner.begin(self.step)
        t0 = time.perf_counter()
        res = checked_rewards(self.source.next_batch(self.step))
        t1 = time.perf_counter()
        local, summary = self.learner.learn(res, self.step, self.source)
        local.update(self.source.before_publish())
        self.step += 1
        published = self.source.publish(self.sync, self.step)
        self.memory.resume_kv_cache()
        out = _reduce_metrics(self.learner.report(local))
        out.update({"weight_version": self.step, "time/rollout": t1 - t0, **summary, **published, **res.metrics,
                    **getattr(self.reward_fn, "pop_metrics", dict)()})  # a judge's judge/* counters
        return out

    def run(self) -> None:
        cfg = self.cfg
        if cfg.train.val_only or (cfg.train.val_before_train and self.step == 0):
            ev = self.evaluate()
            if self.metrics:
                self.metrics.log(self.step, ev)
            if cfg.train.val_only:
                return
        while self.step < cfg.train.steps:
            t = time.perf_counter()
            m = self.train_step()
            # the leader's own; eval not counted
            m.update({"time/step": time.perf_counter() - t, **self.memory.take_seconds()})
            if cfg.train.eval_interval and (self.step % cfg.train.eval_interval == 0 or self.step == cfg.train.steps):
                m.update(self.evaluate())
            if self.metrics:
                self.metrics.log(self.step, m)
            every = cfg.train.save_interval
            if every >= 0 and ((every and self.step % every == 0) or self.step == cfg.train.steps):
                self.learner.reload()
                self.learner.save(self.run_dir, self.step, self.source.state_dict())

    def close(self) -> None:
        if self.metrics:
            self.metrics.close()
        self.generate.close()
        getattr(self.reward_fn, "shutdown", lambda: None)()  # a judge's own engine
        for engine in (self.engine, self.engine_part):
            if engine is not None:
                engine.shutdown()

    def finish(self) -> None:
        """close() after a run that every rank completed, then wait for every rank's engines to stop and tear down
        this rank's tensors and process groups while CUDA is still up.

        The barrier: an engine maps the trainer ranks' weight buckets through CUDA IPC (pull sync; the loader keeps
        the last bucket mapped on purpose) and only its leader's shutdown stops it, so no rank may free its memory
        while some leader has not shut down yet. Not on an error path: a rank that raised must exit at once (torchrun
        then stops the others), not wait at a barrier the others never reach."""
        self.close()
        dist.barrier()
        vars(self).clear()  # every model, optimizer, sync buffer and engine handle of this rank
        gc.collect()
        if torch.cuda.is_initialized():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        destroy_distributed()
