"""One partial-rollout step across the pool (rollout.partial): the buffer, the quota, the metrics.

Every rank holds the same `PartialRollout` (same buffer, same sampler position): the pool hands every rank every
group's state back, so the buffer never diverges. See mtrain/rollout/partial.py for the model (single-turn groups),
mtrain/rollout/partial_multi_turn.py for multi-turn tool trajectories (`use_multi_turn`), and
docs/design-partial-rollout.md for versions, the buffer and the off-policy corrections.
"""
from __future__ import annotations

import logging
import math
import time
from collections import Counter

from mtrain.config_error import ConfigError
from mtrain.config_sections import PARTIAL_OVER_SAMPLE

from mtrain.data.chat import tokenize_prompts
from mtrain.data.rewards import score_responses
from mtrain.rollout import partial
from mtrain.rollout import partial_multi_turn as pmt
from mtrain.rollout.protocol import SamplingParams
from mtrain.trainer.generation.rollouts import RolloutResult, head_size, sample_params, stop_ids

log = logging.getLogger(__name__)


class PartialRollout:
    def __init__(self, cfg, pool, tokenizer, train_set, sampler, reward_fn):
        self.cfg, self.pool, self.tokenizer = cfg, pool, tokenizer
        self.train_set, self.sampler, self.reward_fn = train_set, sampler, reward_fn
        self.buffer: list[partial.GroupState] = []
        self.next_uid = 0
        self._warned_slots = False
        self.multi_turn = None  # (tools, rollout_fn, resume_fn, max_positions) once use_multi_turn is called

    def use_multi_turn(self, tools, rollout_fn, max_positions) -> None:
        """Groups are multi-turn tool trajectories (multi_turn.rollout_fn), resumed by its module's resume_group."""
        try:
            resume_fn = pmt.resume_fn_of(rollout_fn)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        self.multi_turn = (tools, rollout_fn, resume_fn, max_positions)

    def state_dict(self) -> dict:
        if self.multi_turn is not None:
            return {"kind": "multi_turn", "buffer": pmt.to_state(self.buffer), "next_uid": self.next_uid}
        return {"buffer": partial.to_state(self.buffer), "next_uid": self.next_uid}

    def load_state_dict(self, state: dict) -> None:
        kind = state.get("kind", "single_turn")
        if kind != ("multi_turn" if self.multi_turn is not None else "single_turn"):
            raise ConfigError(f"rollout.partial: the checkpoint's buffer holds {kind} groups; this run is "
                             f"{'multi_turn' if self.multi_turn is not None else 'single_turn'} "
                             "(multi_turn.rollout_fn changed): resume with the same setting or start a new run_dir")
        if kind == "multi_turn":
            self.buffer = pmt.from_state(state["buffer"], self.train_set)
        else:
            self.buffer = partial.from_state(state["buffer"])
        self.next_uid = int(state["next_uid"])

    def _fresh(self, base_seed: int) -> list:
        r, d, n = self.cfg.rollout, self.cfg.data, self.cfg.rollout.samples_per_prompt
        samples = [self.train_set[i] for i in self.sampler.next_batch()]
        if self.multi_turn is not None:  # the rollout function renders and checks its own prompts
            out = [pmt.TrajectoryGroup(self.next_uid + k, s.index) for k, s in enumerate(samples)]
            self.next_uid += len(out)
            return out
        prompts = tokenize_prompts(samples, self.tokenizer, max_prompt_len=r.max_prompt_len,
                                   apply_chat_template=d.apply_chat_template, system_prompt=d.system_prompt,
                                   drop_overlong=d.drop_overlong_prompts)
        out = []
        for p in prompts:  # a group keeps its prompt's images (pixel values computed once) in the buffer
            out.append(partial.new_group(self.next_uid, p.sample.index, p.ids, n, base_seed, vision=p.vision))
            self.next_uid += 1
        return out

    def _score(self, group: partial.GroupState) -> tuple[list[float], list[str]]:
        stops = set(stop_ids(self.tokenizer, self.cfg.rollout.stop_token_ids))
        responses = [self.tokenizer.decode([t for t in s.output_ids if t not in stops], skip_special_tokens=True)
                     for s in group.samples]
        sample = self.train_set[group.sample_index]  # PromptSample.index is its position in the dataset
        return score_responses(self.reward_fn, [sample] * len(responses), responses,
                               timeout_s=self.cfg.reward.timeout_s), responses

    def step(self, step: int, version: int, base_seed: int) -> RolloutResult:
        """version: the weights the engines hold now (and the update of this step starts from)."""
        r, a = self.cfg.rollout, self.cfg.algo
        quota = r.prompts_per_step
        metrics: Counter = Counter()
        if r.max_staleness is not None:  # too old to learn from: dropped, and counted
            keep = []
            for g in self.buffer:
                oldest = g.oldest_version()
                if oldest is not None and version - oldest > r.max_staleness:
                    metrics["rollout/dropped_stale_groups"] += 1
                else:
                    keep.append(g)
            self.buffer = keep
        t0 = time.perf_counter()
        groups = list(self.buffer)
        # `target` groups stay in flight until the quota is met: a group that finishes hands its slot to the next
        # one at once (the reserve, up to `quota` more), so the engines do not run emptier as the step goes on.
        # Groups never started go back to the buffer untouched and start first next step.
        target = math.ceil(quota * (r.over_sample if r.over_sample is not None else PARTIAL_OVER_SAMPLE))
        while len(groups) < target + quota:
            groups += self._fresh(base_seed)
        if self.multi_turn is None:
            resumed = [(len(g.prompt_ids) + len(x.output_ids)) for g in self.buffer for x in g.samples
                       if x.output_ids and x.finish_reason is None]
        else:
            resumed = [len(t.tokens) for g in self.buffer for t in g.trajectories or [] if t.finish_reason == "abort"]
        metrics["rollout/resumed"] = len(resumed)
        metrics["rollout/resume_prefill_tokens"] = sum(resumed)  # what resuming them prefills again
        budget = partial.length_budget(r, step)
        params = SamplingParams(max_new_tokens=budget, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                                stop_token_ids=stop_ids(self.tokenizer, r.stop_token_ids),
                                top_logprobs=head_size(self.cfg))
        prefix = f"s{step}"

        n = r.samples_per_prompt

        async def run_group(i, client):
            g, sample = groups[i], self.train_set[groups[i].sample_index]
            if self.multi_turn is not None:
                from mtrain.rollout.agents.setup import make_context
                tools, rollout_fn, resume_fn, max_positions = self.multi_turn
                # the group's seeds are its own (uid), its request ids this step's (the quota's abort reaches them)
                ctx = make_context(self.cfg, self.tokenizer, tools, self.reward_fn,
                                   base_seed=base_seed + g.uid * n * 1000, rid_prefix=f"{prefix}-g{g.uid}",
                                   params=params, max_positions=max_positions)
                return await pmt.advance(g, sample, n, client, ctx, rollout_fn, resume_fn,
                                         bool(a.filter_uniform_groups))
            own = sample_params(params, sample)  # a task's per-sample length cap
            return await partial.advance(g, client, own, prefix, self._score, bool(a.filter_uniform_groups),
                                         getattr(self.tokenizer, "image_token_id", None))

        t1 = time.perf_counter()
        run = self.pool.run(len(groups), run_group, rid_prefix=prefix, quota=quota, in_flight=target)
        t2 = time.perf_counter()
        slots = run.metrics().get("rollout/slots", float(target))
        if slots < target and not self._warned_slots and self.pool.rank == 0:
            self._warned_slots = True  # the over-sampled groups queue instead of running: most of the gain is lost
            log.warning("partial rollout: %d groups should be in flight (rollout.prompts_per_step x over_sample) but "
                        "the engines run %d at once (rollout.max_groups_in_flight=%d per engine); raise "
                        "rollout.max_groups_in_flight", target, int(slots), self.pool.max_in_flight)
        states = [g if got is None else got for g, got in zip(groups, run.results)]
        counted = sorted(run.tickets.items(), key=lambda kv: kv[1])
        trained_idx = [i for i, t in counted if t <= quota]
        if len(trained_idx) < quota:
            raise RuntimeError(f"partial rollout: only {len(trained_idx)} of {quota} groups finished with a learning "
                               f"signal from {len(groups)} in flight; raise rollout.over_sample")
        trained_idx.sort()  # index order: groups from the buffer first, then fresh prompts in sampler order
        trained = [states[i] for i in trained_idx]
        taken = set(trained_idx)
        rest = [s for i, s in enumerate(states) if i not in taken]
        uniform = [bool(a.filter_uniform_groups and s.finished and s.rewards is not None and len(set(s.rewards)) == 1)
                   for s in rest]
        metrics["filter/dropped_groups"] = sum(uniform)
        self.buffer = [s for s, u in zip(rest, uniform) if not u]  # unfinished, and finished past the quota
        out = RolloutResult([], [], [], run.metrics())
        lag: Counter = Counter()
        if self.multi_turn is None:
            for g in trained:
                out.completions += g.completions()
                out.rewards += g.rewards
                out.responses += g.responses
                for x in g.samples:
                    lag.update(version - v for v in x.versions)
            tokens = sum(len(c.output_ids) for c in out.completions)
        else:
            from mtrain.rollout.agents.multi_turn import group_metrics
            out.trajectories = [t for g in trained for t in g.trajectories]
            out.rewards = [float(t.reward) for t in out.trajectories]
            out.responses = [t.final_text for t in out.trajectories]
            per_group = [group_metrics(g.trajectories) for g in trained]
            for k in sorted({k for m in per_group for k in m}):
                vals = [m[k] for m in per_group if k in m]
                out.metrics[f"tools/{k}"] = sum(vals) / len(vals)
            for g in trained:
                lag.update(version - v for v in g.versions())
            tokens = sum(t.num_model_tokens for t in out.trajectories)
        total = sum(lag.values())
        out.metrics.update({k: float(v) for k, v in metrics.items()})
        out.metrics.update({
            "rollout/groups_in_flight": out.metrics.get("rollout/slots", float(target)),
            "rollout/groups_issued": float(len(groups)), "rollout/buffered_groups": float(len(self.buffer)),
            "rollout/groups_started": float(sum(1 for v in run.results if v is not None)),
            "time/rollout_pool": t2 - t1, "time/rollout_bookkeeping": (t1 - t0) + (time.perf_counter() - t2),
            "rollout/offpolicy_token_frac": (total - lag[0]) / max(total, 1),
            "perf/trained_tokens_per_s": tokens / max(run.seconds, 1e-9), "rollout/max_new_tokens": float(budget),
            **{f"rollout/tokens_lag_{k}": float(v) for k, v in sorted(lag.items())}})
        return out
