"""One rollout across the engine pool: prompts -> GRPO groups (n samples, distinct seeds) -> rewards.

Every rank calls `run_rollout` (a collective). The prompts are rendered and checked on every rank, before any
generation (deterministic and cheap), so a bad prompt stops all ranks with the same clear message; the pool then
spreads the groups over the engines, each engine's leader scores the groups it served, and every rank gets every
group back in prompt order.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field, replace

import torch.distributed as dist

from mtrain.data.chat import PromptError, context_problem, tokenize_prompts
from mtrain.data.rewards import finite_reward, score_responses
from mtrain.rollout.client import EngineClient
from mtrain.rollout.pool import RolloutPool
from mtrain.rollout.protocol import Completion, EngineError, Request, SamplingParams


@dataclass
class RolloutResult:
    completions: list[Completion]
    rewards: list[float]
    responses: list[str]
    metrics: dict[str, float] = field(default_factory=dict)
    trajectories: list | None = None  # multi-turn rollouts: the batch is built from these (to_batch)


def stop_ids(tokenizer, extra: list[int]) -> tuple[int, ...]:
    eos = tokenizer.eos_token_id
    ids = list(eos) if isinstance(eos, (list, tuple)) else ([eos] if eos is not None else [])
    return tuple(sorted(set(ids) | set(extra)))


def sample_params(params: SamplingParams, sample) -> SamplingParams:
    """A task may cap a sample's response length (`metadata["max_new_tokens"]`, e.g. the longtail task): the
    request's budget is the smaller of that and the step's."""
    cap = sample.metadata.get("max_new_tokens") if isinstance(sample.metadata, dict) else None
    return params if cap is None else replace(params, max_new_tokens=max(1, min(params.max_new_tokens, int(cap))))


def group_requests(prompt_ids: list[int], index: int, n: int, params: SamplingParams, base_seed: int,
                   rid_prefix: str, width: int, vision=None) -> list[Request]:
    """The n requests of group `index`: seeds base_seed + index*n + j (as `expand_samples`), so a group samples
    the same tokens whichever engine serves it; rids f"{prefix}-{index:0W}-{j:0W}-" (none a prefix of another)."""
    sw = len(str(n - 1))
    return [Request(rid=f"{rid_prefix}-{index:0{width}d}-{j:0{sw}d}-", prompt_ids=list(prompt_ids),
                    params=replace(params, seed=base_seed + index * n + j), vision=vision) for j in range(n)]


def run_rollout(pool: RolloutPool, tokenizer, samples, cfg, reward_fn, *, n: int, seed: int, rid_prefix: str,
                greedy: bool = False, max_positions: int | None = None, max_new_tokens: int | None = None
                ) -> RolloutResult:
    """max_new_tokens: this step's budget (default rollout.max_new_tokens; a growing schedule passes less).
    max_positions: the model's context (max_position_embeddings); a prompt that cannot take max_new_tokens
    more is refused here, before any generation, with the sample named (engines differ in what they do)."""
    r, d = cfg.rollout, cfg.data
    budget = max_new_tokens or r.max_new_tokens
    prompts = tokenize_prompts(samples, tokenizer, max_prompt_len=r.max_prompt_len,
                               apply_chat_template=d.apply_chat_template, system_prompt=d.system_prompt,
                               drop_overlong=d.drop_overlong_prompts)
    for p in prompts:
        problem = context_problem(p, budget, max_positions)
        if problem:
            raise PromptError(problem)
    params = SamplingParams(max_new_tokens=budget, temperature=0.0 if greedy else r.temperature,
                            top_p=1.0 if greedy else r.top_p, top_k=-1 if greedy else r.top_k,
                            stop_token_ids=stop_ids(tokenizer, r.stop_token_ids),
                            top_logprobs=0 if greedy else head_size(cfg))
    stops = set(params.stop_token_ids)
    width = len(str(max(len(prompts) - 1, 0)))

    async def one_group(i: int, client: EngineClient):
        reqs = group_requests(prompts[i].ids, i, n, sample_params(params, prompts[i].sample), seed, rid_prefix, width,
                              vision=prompts[i].vision)
        completions = await asyncio.gather(*(client.generate(q) for q in reqs))
        aborted = [c.rid for c in completions if c.finish_reason == "abort"]
        if aborted:  # partial outputs of a stopped engine must never be scored and trained on
            raise EngineError(f"{len(aborted)} of {n} requests of group {i} were aborted by the engine (e.g. "
                              f"{aborted[0]!r}); it was shut down or aborted mid-generation")
        responses = [tokenizer.decode([t for t in c.output_ids if t not in stops], skip_special_tokens=True)
                     for c in completions]
        rewards = await asyncio.to_thread(score_responses, reward_fn, [prompts[i].sample] * n, responses,
                                          timeout_s=cfg.reward.timeout_s)
        return completions, rewards, responses

    run = pool.run(len(prompts), one_group, rid_prefix=rid_prefix)
    out = RolloutResult([], [], [], run.metrics())
    for completions, rewards, responses in run.results:
        out.completions += completions
        out.rewards += rewards
        out.responses += responses
    tokens = sum(len(c.output_ids) for c in out.completions)
    out.metrics["perf/rollout_tokens_per_s"] = tokens / max(run.seconds, 1e-9)
    return out


def head_size(cfg) -> int:
    """Top-k logprobs per generated token the engines return: algo.score_centering_k with score centering, else 0."""
    return cfg.algo.score_centering_k if cfg.algo.score_centering else 0


def broadcast_result(value, src: int, group=None):
    """Every rank (of `group`) gets the value of rank `src`; an exception there is raised on every rank."""
    box = [value if dist.get_rank() == src else None]
    if dist.get_world_size(group) > 1:  # alone, skip the pickling and two collectives (part of every sync's time)
        dist.broadcast_object_list(box, src=src, group=group)
    if isinstance(box[0], BaseException):
        raise box[0]
    return box[0]


def run_multi_turn_rollout(pool: RolloutPool, tokenizer, samples, cfg, reward_fn, tools, rollout_fn, *, n: int,
                           seed: int, rid_prefix: str, greedy: bool = False, max_positions: int | None = None,
                           max_new_tokens: int | None = None) -> RolloutResult:
    """Multi-turn tool rollouts (multi_turn.rollout_fn) across the pool: one group function call per prompt on the
    engine that claims it; returns trajectories (token segments; mtrain.rollout.trajectory.to_batch builds the
    batch) with their rewards, in prompt order, plus the tool metrics of all trajectories (tool_metrics)."""
    from mtrain.rollout.agents.setup import make_context

    r = cfg.rollout
    with_images = [s.index for s in samples if getattr(s, "images", ())]
    if with_images and not hasattr(tokenizer, "render_messages"):  # before any generation, on every rank
        raise PromptError(f"sample {with_images[0]} has images but the model has no vision tower (its config.json "
                          f"has no vision_config/image_token_id)")
    params = SamplingParams(max_new_tokens=max_new_tokens or r.max_new_tokens, temperature=r.temperature,
                            top_p=r.top_p, top_k=r.top_k, stop_token_ids=stop_ids(tokenizer, r.stop_token_ids),
                            top_logprobs=0 if greedy else head_size(cfg))
    width = len(str(max(len(samples) - 1, 0)))

    async def one_group(i: int, client: EngineClient):
        ctx = make_context(cfg, tokenizer, tools, reward_fn, base_seed=seed + i * n * 1000,
                           rid_prefix=f"{rid_prefix}-g{i:0{width}d}", params=params, greedy=greedy,
                           max_positions=max_positions)
        trajectories = await rollout_fn(samples[i], n, client, ctx)
        aborted = [t.rid for t in trajectories if t.finish_reason == "abort"]
        if aborted:
            raise EngineError(f"{len(aborted)} of {n} trajectories of group {i} were aborted by the engine")
        return trajectories

    run = pool.run(len(samples), one_group, rid_prefix=rid_prefix)
    out = RolloutResult([], [], [], run.metrics())
    out.trajectories = [t for trajs in run.results for t in trajs]
    # A user rollout_fn sets rewards itself: checked here, where they enter the batch.
    out.rewards = [finite_reward(t.reward, f"rollout_fn for trajectory {t.rid}") for t in out.trajectories]
    out.responses = [t.final_text for t in out.trajectories]
    # Over all trajectories, not a mean of per-group values: the valid-call rate is valid / attempted calls of
    # the whole rollout (a group without calls must not count as a valid rate of 0).
    out.metrics.update({f"tools/{k}": v for k, v in tool_metrics(out.trajectories).items()})
    tokens = sum(t.num_model_tokens for t in out.trajectories)
    out.metrics["perf/rollout_tokens_per_s"] = tokens / max(run.seconds, 1e-9)
    return out


def tool_metrics(trajectories) -> dict[str, float]:
    """The multi-turn metrics (group_metrics: tool-call rate, valid-call rate, turns, drift, finish reasons) of
    any set of trajectories: a step's rollout, or a whole evaluation made of several rollouts."""
    from mtrain.rollout.agents.multi_turn import group_metrics
    return group_metrics(trajectories) if trajectories else {}
