"""One partial-rollout step across the pool (rollout.partial): the buffer, the quota, the metrics.

Every rank holds the same `PartialRollout` (same buffer, same sampler position): the pool hands every rank every
group's state back, so the buffer never diverges. See mtrain/rollout/partial.py for the model and
docs/design-partial-rollout.md for versions, the buffer and the off-policy corrections.
"""
from __future__ import annotations

import math
from collections import Counter

from mtrain.data.chat import tokenize_prompts
from mtrain.data.rewards import score_responses
from mtrain.rollout import partial
from mtrain.rollout.protocol import SamplingParams
from mtrain.trainer.rollout_step import RolloutResult, sample_params, stop_ids


class PartialRollout:
    def __init__(self, cfg, pool, tokenizer, train_set, sampler, reward_fn):
        self.cfg, self.pool, self.tokenizer = cfg, pool, tokenizer
        self.train_set, self.sampler, self.reward_fn = train_set, sampler, reward_fn
        self.buffer: list[partial.GroupState] = []
        self.next_uid = 0

    def state_dict(self) -> dict:
        return {"buffer": partial.to_state(self.buffer), "next_uid": self.next_uid}

    def load_state_dict(self, state: dict) -> None:
        self.buffer = partial.from_state(state["buffer"])
        self.next_uid = int(state["next_uid"])

    def _fresh(self, base_seed: int) -> list[partial.GroupState]:
        r, d, n = self.cfg.rollout, self.cfg.data, self.cfg.rollout.samples_per_prompt
        samples = [self.train_set[i] for i in self.sampler.next_batch()]
        prompts = tokenize_prompts(samples, self.tokenizer, max_prompt_len=r.max_prompt_len,
                                   apply_chat_template=d.apply_chat_template, system_prompt=d.system_prompt,
                                   drop_overlong=d.drop_overlong_prompts)
        out = []
        for p in prompts:
            if p.vision is not None:  # the buffer (and its checkpoint) would have to keep the pixel values
                raise ValueError(f"sample {p.sample.index} has images: rollout.partial does not support image prompts "
                                 f"yet; set rollout.partial=false")
            out.append(partial.new_group(self.next_uid, p.sample.index, p.ids, n, base_seed))
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
        groups = list(self.buffer)
        target = math.ceil(quota * r.over_sample)
        while len(groups) < target:
            groups += self._fresh(base_seed)
        metrics["rollout/resumed"] = sum(1 for g in self.buffer for s in g.samples
                                         if s.output_ids and s.finish_reason is None)
        budget = partial.length_budget(r, step)
        params = SamplingParams(max_new_tokens=budget, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                                stop_token_ids=stop_ids(self.tokenizer, r.stop_token_ids))
        prefix = f"s{step}"

        async def run_group(i, client):
            own = sample_params(params, self.train_set[groups[i].sample_index])  # a task's per-sample length cap
            return await partial.advance(groups[i], client, own, prefix, self._score, bool(a.filter_uniform_groups))

        run = self.pool.run(len(groups), run_group, rid_prefix=prefix, quota=quota)
        states = [g if got is None else got for g, got in zip(groups, run.results)]
        counted = sorted(run.tickets.items(), key=lambda kv: kv[1])
        trained_idx = [i for i, t in counted if t <= quota]
        if len(trained_idx) < quota:
            raise RuntimeError(f"partial rollout: only {len(trained_idx)} of {quota} groups finished with a learning "
                               f"signal from {len(groups)} in flight; raise rollout.over_sample")
        trained_idx.sort()  # index order: groups from the buffer first, then fresh prompts in sampler order
        trained = [states[i] for i in trained_idx]
        rest = [s for i, s in enumerate(states) if i not in set(trained_idx)]
        filtered = [s for s in rest if s.finished and s.rewards is not None and len(set(s.rewards)) == 1
                    and a.filter_uniform_groups]
        metrics["filter/dropped_groups"] = len(filtered)
        self.buffer = [s for s in rest if s not in filtered]  # unfinished, and finished past the quota
        out = RolloutResult([], [], [], run.metrics())
        lag: Counter = Counter()
        for g in trained:
            out.completions += g.completions()
            out.rewards += g.rewards
            out.responses += g.responses
            for s in g.samples:
                lag.update(version - v for v in s.versions)
        total = sum(lag.values())
        tokens = sum(len(c.output_ids) for c in out.completions)
        out.metrics.update({k: float(v) for k, v in metrics.items()})
        out.metrics.update({
            "rollout/groups_in_flight": float(len(groups)), "rollout/buffered_groups": float(len(self.buffer)),
            "rollout/offpolicy_token_frac": (total - lag[0]) / max(total, 1),
            "perf/trained_tokens_per_s": tokens / max(run.seconds, 1e-9), "rollout/max_new_tokens": float(budget),
            **{f"rollout/tokens_lag_{k}": float(v) for k, v in sorted(lag.items())}})
        return out
