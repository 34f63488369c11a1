"""`mtrain train`: the RL loop, top to bottom.

    build (distributed, data, policy, engine) -> for each step: rollout -> rewards -> advantages ->
    logprobs -> train step -> weight sync -> metrics -> checkpoint

Each arrow is one call into its own module; this file only orders them.
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

from mtrain.algorithms import uniform_groups
from mtrain.algorithms.objective import compute_advantages
from mtrain.config import ConfigError
from mtrain.data import load_datasets
from mtrain.data.rewards import load_reward_fn
from mtrain.data.sampler import PromptSampler
from mtrain.dist import destroy as destroy_distributed, init_distributed
from mtrain.layouts import model_layout
from mtrain.layouts.vlm import flat_config
from mtrain.metrics import MetricsWriter
from mtrain.wandb_log import wandb_sink
from mtrain.run_output import summary as run_summary
from mtrain.trainer import checkpoint
from mtrain.trainer.learner.actor import Actor
from mtrain.trainer.batch import RolloutBatch, build_batch, dp_rows
from mtrain.rollout.partial import length_budget
from mtrain.rollout.pool import RolloutPool
from mtrain.trainer.decisions import decide
from mtrain.trainer.evaluation import evaluate_in_chunks
from mtrain.trainer.engines import load_tokenizer, make_engine, weight_loader
from mtrain.trainer.learner.routing_replay import routing_metrics
from mtrain.trainer.learner.offload import TrainOffload
from mtrain.trainer.learner.side_models import SideModels
from mtrain.trainer.sources.partial import PartialRollout
from mtrain.trainer.generation.rollouts import run_multi_turn_rollout, run_rollout, tool_metrics
from mtrain.rollout.trajectory import to_batch
from mtrain.trainer.publishers.colocated import WeightSync
from mtrain.trainer.learner.teacher import Distiller, build_teacher
from mtrain.trainer.publishers.lora import AdapterSync
from mtrain.models.lora import spec_of as lora_spec_of

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


def _logprob_diff(old_lp, batch) -> dict[str, float]:
    if old_lp is None:
        return {}
    m = batch.response_mask.bool()
    d = (old_lp - batch.engine_logprobs).abs()[m]
    if d.numel() == 0:
        return {}
    return {"logprob_diff/mean_abs": float(d.mean()), "logprob_diff/max_abs": float(d.max())}


class Trainer:
    def __init__(self, cfg):
        hf_dir = self._start(cfg)
        d, p, separate = self.decisions, cfg.parallel, cfg.engine.placement == "separate"
        load = weight_loader(cfg, self.layout, self.rank)
        arch = {"sequence_parallel": d.sequence_parallel}
        self.actor = Actor(cfg, self.train_config, load_weights=load, overrides=arch)
        self.ref = Actor(cfg, self.train_config, load_weights=load, trainable=False,
                         overrides=arch) if cfg.algo.kl_coef else None
        teacher = build_teacher(cfg, self.rank, arch)  # algo.distill: on-policy distillation (trainer/learner/teacher.py)
        self.distill = Distiller(cfg, teacher, d.offload_train) if teacher is not None else None
        self.offload = TrainOffload(self.actor, d.offload_train)
        if cfg.rollout.async_mode != "off" and cfg.engine.placement == "colocated":  # engine + trainer resident
            from mtrain.trainer.memory_fit import check_colocated_fit
            fit = check_colocated_fit(cfg, self.actor, d.device)  # ConfigError when it cannot fit
            if self.rank == 0:
                print(fit, flush=True)
        # PPO's critic (docs/design-critic-distill.md)
        self.side = SideModels(cfg, self.rank, self.train_config, load, arch, d.offload_train)
        self.engine = make_engine(cfg, hf_dir, self.hf_config, d, self.rank) if d.groups.is_leader(self.rank) else None
        # An engine spanning nodes: the first group rank on each further node starts that node's part (docs/design-pool.md)
        self.engine_part = make_engine(cfg, hf_dir, self.hf_config, d, self.rank) if (
            self.engine is None and d.groups.starts_engine_part(self.rank)) else None
        self.pool = RolloutPool(d.groups, self.rank, self.engine, max_groups_in_flight=cfg.rollout.max_groups_in_flight)
        self.partial = PartialRollout(cfg, self.pool, self.tokenizer, self.train_set, self.sampler,
                                      self.reward_fn) if cfg.rollout.partial else None
        self.agents = None
        if cfg.serve.agent:  # server-based RL: openai-client agents through each leader's front (agent_step.py)
            from mtrain.trainer.generation.agents import AgentRollout
            self.agents = AgentRollout(cfg, self.pool, self.tokenizer, max_positions=self.max_positions or 4096,
                                       model_name=cfg.serve.model_name or hf_dir.name)
        self.tools = self.rollout_fn = None
        if cfg.multi_turn.rollout_fn:  # multi-turn tool rollouts (docs/design-tools.md)
            from mtrain.rollout.agents.setup import build_tool_server, load_rollout_fn
            self.tools, self.rollout_fn = build_tool_server(cfg.multi_turn), load_rollout_fn(cfg.multi_turn.rollout_fn)
            if self.partial is not None:  # aborted trajectories wait in the buffer and resume at the same turn
                self.partial.use_multi_turn(self.tools, self.rollout_fn, self.max_positions)
        self.async_rollout = None
        if cfg.rollout.async_mode == "one_step":  # step N+1 generated with weights N while step N trains
            from mtrain.trainer.sources.one_step import OneStepRollout
            self.async_rollout = OneStepRollout(self)
        elif cfg.rollout.async_mode == "stream":  # engines generate on; updates go in place (trainer/sources/stream.py)
            from mtrain.trainer.sources.stream import StreamRollout
            self.async_rollout = StreamRollout(self)
        def make_sync(table, **over):  # over: engine / engine_kind / mode for the adapter plan (lora_sync.py)
            kw = {"engine": self.engine, "engine_kind": d.engine_layout, "mode": d.sync_mode, **over}
            return WeightSync(table, self.actor.chunks, kw.pop("engine"), groups=d.groups, engine_ep=cfg.engine.ep,
                              first_stage_layers=p.first_stage_layers, last_stage_layers=p.last_stage_layers,
                              dtype=d.engine_dtype, bucket_bytes=cfg.sync.bucket_mb << 20, backend=cfg.sync.backend,
                              device=d.device, engine_fp8=d.engine_fp8, **kw)
        lora = lora_spec_of(cfg)  # LoRA: the base once, then a named adapter per step (mtrain/trainer/publishers/lora.py)
        if separate:  # to engines on other ranks, shard to shard (mtrain/reshard/remote.py)
            from mtrain.trainer.publishers.separate import SeparateSync
            self.sync = SeparateSync(cfg, d, self.layout, self.rank, chunks=self.actor.chunks, dtype=d.engine_dtype)
        else:
            self.sync = make_sync(self.layout) if lora is None else AdapterSync(make_sync, self.layout, lora,
                                                                                 self.engine)
        # a LoRA engine keeps its (frozen) base weights while training runs: only the KV cache is given back
        self.weight_tags = () if lora is not None else ("weights",)
        self.step = 0
        self._memory_s: dict[str, float] = {}  # time/release_memory, time/resume_memory of the step running
        resumed = self._resume()
        if self.rank == 0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            cfg.dump_yaml(self.run_dir / "config.yaml")
            from mtrain.job_split import train_world
            print(run_summary(cfg, self.hf_config, dist.get_world_size(), train_world(cfg, dist.get_world_size())),
                  flush=True)  # full: config.yaml
            print(d.summary(), flush=True)
            from mtrain.job_split import split_ranks
            print(f"{split_ranks(cfg, dist.get_world_size()).describe()} rollout.async={cfg.rollout.async_mode}",
                  flush=True)
        # resume_step=None on a fresh start: a previous run's metrics in this run_dir are replaced, not kept.
        self.metrics = MetricsWriter(self.run_dir, resume_step=self.step if resumed else None,
                                     total_steps=cfg.train.steps, tensorboard=cfg.train.log_tensorboard,
                                     sinks=tuple(s for s in [wandb_sink(cfg, self.run_dir)] if s)
                                     ) if self.rank == 0 else None
        self.sync.sync(version=self.step)

    def _start(self, cfg) -> Path:
        """What every rank of the job sets up first, training and (separate placement) engine ranks alike: the
        process groups, the run's decisions, the model's config and layout, tokenizer, data, reward and sampler.
        Returns the HF directory."""
        p = cfg.parallel
        separate = cfg.engine.placement == "separate"  # Megatron over the training ranks only (trainer/separate.py)
        init_distributed(tp=p.tp, pp=p.pp, vpp=p.vpp, ep=p.ep, etp=p.etp, cp=p.cp, seed=cfg.train.seed,
                         timeout_s=cfg.train.collective_timeout_s,
                         train_world=int(os.environ.get("WORLD_SIZE", 1)) - cfg.engine.ranks if separate else None)
        self.cfg, self.rank = cfg, dist.get_rank()
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
        self.decisions = decide(cfg, world_size=dist.get_world_size(), local_world_size=local_world)
        self.run_dir = Path(cfg.train.run_dir)
        hf_dir = Path(cfg.model.hf_path)
        self.hf_config = json.loads((hf_dir / "config.json").read_text())
        # RL updates the main model only: MTP layers (DeepSeek-V3) are carried by the converters.
        self.train_config = dict(self.hf_config, num_nextn_predict_layers=0)
        self.layout = model_layout(self.train_config, mtp=False)
        self.max_positions = flat_config(self.hf_config).get("max_position_embeddings")  # VLMs: in text_config
        if self.max_positions is not None and cfg.rollout.max_new_tokens >= self.max_positions:
            raise ConfigError(f"rollout.max_new_tokens: {cfg.rollout.max_new_tokens} leaves no room for a prompt in "
                              f"the model's context (max_position_embeddings={self.max_positions})")
        self.tokenizer = load_tokenizer(hf_dir, self.hf_config, max_pixels=cfg.data.max_pixels)
        self.train_set, self.eval_set = load_datasets(cfg)
        self.reward_fn = load_reward_fn(cfg.reward.fn)
        self.sampler = PromptSampler(len(self.train_set), cfg.rollout.prompts_per_step, seed=cfg.data.seed,
                                     shuffle=cfg.data.shuffle)
        return hf_dir

    def _resume(self) -> bool:
        r = self.cfg.train.resume
        report = print if self.rank == 0 else None  # why a newer checkpoint is skipped, said once
        path = None if r == "never" else (checkpoint.find_latest(self.run_dir, report) if r == "auto" else Path(r))
        if path is None:
            return False
        state = checkpoint.load(path, self.actor, extra=self.side.extra_models())
        self.step = state["step"]
        self.sampler.load_state_dict(state["sampler"])
        if self.partial is not None:
            if "partial" not in state:
                raise ConfigError(f"rollout.partial: the checkpoint {path} was written without partial rollout (no "
                                  "buffer in it); resume with rollout.partial=false or start a new run_dir")
            self.partial.load_state_dict(state["partial"])
        if self.rank == 0:
            print(f"resumed from {path} at step {self.step}", flush=True)
        return True

    def _rollout(self, samples, *, n, seed, prefix, greedy=False, max_new_tokens=None):
        if self.agents is not None:  # the agents choose their own sampling (greedy evaluation is theirs to do)
            return self.agents.run(samples, n, prefix)
        if self.rollout_fn is not None:
            return run_multi_turn_rollout(self.pool, self.tokenizer, samples, self.cfg, self.reward_fn, self.tools,
                                          self.rollout_fn, n=n, seed=seed, rid_prefix=prefix, greedy=greedy,
                                          max_positions=self.max_positions, max_new_tokens=max_new_tokens)
        return run_rollout(self.pool, self.tokenizer, samples, self.cfg, self.reward_fn, n=n, seed=seed,
                           rid_prefix=prefix, greedy=greedy, max_positions=self.max_positions,
                           max_new_tokens=max_new_tokens)

    def _engine_memory(self, op: str, tags: tuple[str, ...]) -> None:
        """Colocated engines give their memory to training and take it back (engine.colocate); the seconds it takes
        are summed per step into the metrics time/release_memory and time/resume_memory."""
        if self.engine is not None and self.decisions.colocate and tags:
            t = time.perf_counter()
            if op == "resume_memory" and torch.cuda.is_initialized():
                # The caching allocator keeps the training step's activation blocks reserved: handed back first, or
                # the engine's weights and KV cache cannot come back (a Qwen3-4B shape on one H200 died here in
                # torch_memory_saver's resume, 2026-12-02)
                torch.cuda.empty_cache()
            getattr(self.engine, op)(tags)
            key = f"time/{op}"
            self._memory_s[key] = self._memory_s.get(key, 0.0) + time.perf_counter() - t

    def evaluate(self) -> dict[str, float]:
        if not self.eval_set:
            return {}
        n = self.cfg.train.eval_samples
        trajectories = []  # multi-turn rollouts: every chunk's, for the eval's tool metrics

        def rollout(part, prefix):
            res = self._rollout(part, n=n, seed=10**9, prefix=prefix, greedy=True)
            if self.rollout_fn is not None:  # (agents' trajectories carry their own metrics, not these)
                trajectories.extend(res.trajectories)
            return res

        mean, rows = evaluate_in_chunks(rollout, self.eval_set, n, step=self.step, show=self.rank == 0)
        if self.rank == 0:  # a few answers per eval, so that a score can be checked by reading what was said
            self.run_dir.mkdir(parents=True, exist_ok=True)
            shown = [{"step": self.step, "index": sample.index, "answer": str(sample.answer), "response": text,
                      "reward": r} for sample, text, r in rows[:8 * n]]
            with open(self.run_dir / "eval_samples.jsonl", "a", encoding="utf-8") as f:
                f.writelines(json.dumps(row) + "\n" for row in shown)
            if self.metrics is not None:
                self.metrics.log_table(self.step, "eval/samples", shown)
        out = {"eval/reward_mean": mean}
        # tool-call rate, valid-call rate, drift... of the greedy eval (named as in training: eval/tools/...)
        out.update({f"eval/tools/{k}": v for k, v in tool_metrics(trajectories).items()})
        return out

    def _drop_uniform_groups(self, batch: RolloutBatch, n: int) -> tuple[RolloutBatch | None, int, dict]:
        """DAPO dynamic sampling: leave out groups whose rewards are all equal (no learning signal).

        Kept groups come first; when their count does not split into data-parallel ranks x micro batches, rows of
        dropped groups fill the gap with an all-zero response mask, so they add nothing to loss, gradient,
        token counts or metrics. Returns (batch or None when every group is dropped, kept rows, metrics)."""
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

    def train_step(self) -> dict[str, float]:
        cfg, n = self.cfg, self.cfg.rollout.samples_per_prompt
        from megatron.core import parallel_state as ps
        offload_metrics = self.offload.offload()  # no-op unless engine.offload_train (and already done after a step)
        offload_metrics.update(self.side.offload())
        self.side.begin(self.step)
        t0 = time.perf_counter()
        if self.partial is not None:
            res = self.partial.step(self.step, version=self.step, base_seed=cfg.train.seed * 1_000_003)
        elif self.async_rollout is not None:
            res = self.async_rollout.step(self.step, cfg.train.steps)
        else:
            samples = [self.train_set[i] for i in self.sampler.next_batch()]
            res = self._rollout(samples, n=n, seed=cfg.train.seed * 1_000_003 + self.step * 10_007,
                                prefix=f"s{self.step}", max_new_tokens=length_budget(cfg.rollout, self.step))
        t1 = time.perf_counter()
        # Sequence parallelism (TP with Transformer Engine) splits the sequence over TP ranks: pad to a multiple.
        pad = self.tokenizer.pad_token_id or 0
        tp = ps.get_tensor_model_parallel_world_size()
        full = build_batch(res.completions, res.rewards, pad_id=pad, pad_to_multiple=tp, routing=self.actor.routing) \
            if res.trajectories is None \
            else to_batch(res.trajectories, pad_id=pad, pad_to_multiple=tp, routing=self.actor.routing)
        if self.partial is not None and cfg.rollout.offpolicy == "mask":
            # Tokens generated by older weights than this update starts from leave the loss (and the gradient);
            # with "tis" they stay, weighted by the capped trainer/rollout probability ratio (algo.tis_cap).
            full.response_mask[(full.versions >= 0) & (full.versions < self.step)] = 0.0
        stale = {}
        if self.async_rollout is not None:
            if cfg.rollout.async_mode == "stream":  # whole groups with a too-old token leave the loss (counted)
                from mtrain.trainer.sources.stream import drop_stale_groups
                stale = drop_stale_groups(full, self.step, cfg.rollout, n)
            else:
                from mtrain.trainer.sources.one_step import offpolicy_mask
                stale = offpolicy_mask(full, self.step, cfg.rollout)
        batch, rows, local = full, full.size, dict(stale)
        if cfg.algo.filter_uniform_groups:
            batch, rows, local = self._drop_uniform_groups(full, n)
        train_metrics, old_lp, mine = {}, None, None
        t2 = t3 = time.perf_counter()
        if batch is not None:
            # The rollout is over: colocated engines hand their weights and KV cache back before the scoring pass,
            # which then has the training step's memory (with the engine resident, a Qwen3-4B shape on one H200 ran
            # out of memory in it at engine.mem_fraction_static=0.6, 2026-12-02)
            self._engine_memory("release_memory", ("kv_cache",) + self.weight_tags)
            # Advantages of the kept groups only (batch-level whitening must not see the dropped ones);
            # filler rows (past `rows`) belong to uniform groups, whose advantage is 0.
            adv, adv_metrics = self.side.advantages(batch, rows, lambda: compute_advantages(
                cfg.algo, batch.rewards[:rows], n, batch.response_mask[:rows]))
            adv = adv[:rows]
            adv = torch.cat([adv, adv.new_zeros((batch.size - rows, adv.shape[1]))])
            local.update({k: float(v) for k, v in adv_metrics.items()})
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
            for start in range(0, batch.size, gbs):
                sl = dp_rows(batch.seq_lens[start:start + gbs], dp_rank, dp_size,
                             by_tokens=cfg.train.max_tokens_per_micro_batch is not None)
                sl = slice(start + sl.start, start + sl.stop) if isinstance(sl, slice) else start + sl
                mb = batch.select(sl)
                slices.append(sl)
                kept = min(max(rows - start, 0), gbs)  # rows past `rows` are zero-mask fillers (DAPO filter)
                lp = self.actor.logprobs(mb)
                a = self.distill.advantages(mb, adv[sl], lp) if self.distill else adv[sl]
                minibatches.append((mb, a, lp, self.ref.logprobs(mb) if self.ref else None,
                                    {"num_tokens": float(batch.response_mask[start:start + gbs].sum()),
                                     "num_seqs": float(kept)}))
            if self.distill:
                local.update(self.distill.metrics())
            # engine vs trainer's own routing (from the scoring pass), and the routing bytes the engines sent
            local.update(routing_metrics(self.actor, res.completions if res.trajectories is None else res.trajectories))
            offload_metrics.update(self.offload.reload())
            offload_metrics.update(self.side.reload())
            t2 = time.perf_counter()
            per_update = [self.actor.train_step(mb, old, a, ref, norms) for mb, a, old, ref, norms in minibatches
                          ] if self.side.policy_trains else []  # the critic's warm-up: the policy waits
            train_metrics = {k: sum(m[k] for m in per_update) / len(per_update) for k in per_update[0]} \
                if per_update else {}
            train_metrics["ppo/updates"] = float(len(per_update))
            train_metrics.update(self.side.update(minibatches, slices))
            t3 = time.perf_counter()
            mine = RolloutBatch.concat([m[0] for m in minibatches])
            old_lp = None if minibatches[0][2] is None else torch.cat([m[2] for m in minibatches])
            offload_metrics.update(self.offload.offload())
            offload_metrics.update(self.side.offload())
            self._engine_memory("resume_memory", self.weight_tags)
        if self.async_rollout is not None:  # the engines keep weights N until the next step's rollout is done
            local.update(self.async_rollout.wait())
        self.step += 1
        sync_metrics = self.async_rollout.update(self.sync, self.step) if cfg.rollout.async_mode == "stream" \
            else self.sync.sync(version=self.step)
        if batch is not None:
            self._engine_memory("resume_memory", ("kv_cache",))
        local.update(offload_metrics)
        if old_lp is not None:
            local.update({**train_metrics, **_logprob_diff(old_lp, mine)})
        out = _reduce_metrics(local)
        if batch is None:
            out["update_skipped"] = 1.0  # every group was uniform: nothing to learn from this rollout
        out.update({"reward/mean": float(full.rewards.mean()), "response_len/mean": float(full.response_lens
                    .float().mean()), "prompt_len/mean": float((full.seq_lens - full.response_lens).float().mean()), "weight_version": self.step, "time/rollout": t1 - t0,
                    "time/logprobs": t2 - t1, "time/train": t3 - t2, **sync_metrics, **res.metrics})
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
            t, self._memory_s = time.perf_counter(), {}
            m = self.train_step()
            m.update({"time/step": time.perf_counter() - t, **self._memory_s})  # the leader's own; eval not counted
            if cfg.train.eval_interval and (self.step % cfg.train.eval_interval == 0 or self.step == cfg.train.steps):
                m.update(self.evaluate())
            if self.metrics:
                self.metrics.log(self.step, m)
            every = cfg.train.save_interval
            if every >= 0 and ((every and self.step % every == 0) or self.step == cfg.train.steps):
                self.offload.reload()  # the optimizer state must be in place to be saved
                self.side.reload()
                state = {"sampler": self.sampler.state_dict() if self.async_rollout is None
                         else self.async_rollout.sampler_state()}  # a pending rollout's prompts are drawn again
                if self.partial is not None:  # unfinished samples survive a stop: they resume after a restart
                    state["partial"] = self.partial.state_dict()
                self._save_checkpoint(state)

    def _save_checkpoint(self, state: dict) -> None:
        checkpoint.save(self.run_dir, self.step, self.actor, state, extra=self.side.extra_models())

    def close(self) -> None:
        if self.metrics:
            self.metrics.close()
        if self.agents is not None:
            self.agents.close()
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
