"""One rollout on the engine's leader: prompts -> samples (n per prompt, distinct seeds) -> rewards.

Runs only where the engine lives; `broadcast_result` ships the outcome (or the error) to every rank, so an
engine or reward failure stops all ranks with the same clear message instead of leaving them waiting.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from mtrain.data.chat import PromptError, tokenize_prompts
from mtrain.data.rewards import score_responses
from mtrain.rollout.protocol import Completion, EngineError, SamplingParams, expand_samples


@dataclass
class RolloutResult:
    completions: list[Completion]
    rewards: list[float]
    responses: list[str]


def stop_ids(tokenizer, extra: list[int]) -> tuple[int, ...]:
    eos = tokenizer.eos_token_id
    ids = list(eos) if isinstance(eos, (list, tuple)) else ([eos] if eos is not None else [])
    return tuple(sorted(set(ids) | set(extra)))


def run_rollout(engine, tokenizer, samples, cfg, reward_fn, *, n: int, seed: int, rid_prefix: str,
                greedy: bool = False, max_positions: int | None = None) -> RolloutResult:
    """max_positions: the model's context (max_position_embeddings); a prompt that cannot take max_new_tokens
    more is refused here, before any generation, with the sample named (engines differ in what they do)."""
    r, d = cfg.rollout, cfg.data
    prompts = tokenize_prompts(samples, tokenizer, max_prompt_len=r.max_prompt_len,
                               apply_chat_template=d.apply_chat_template, system_prompt=d.system_prompt,
                               drop_overlong=d.drop_overlong_prompts)
    if max_positions is not None:
        for p in prompts:
            if len(p.ids) + r.max_new_tokens > max_positions:
                raise PromptError(f"sample {p.sample.index}: prompt of {len(p.ids)} tokens + rollout.max_new_tokens="
                                  f"{r.max_new_tokens} exceeds the model's context (max_position_embeddings="
                                  f"{max_positions}); shorten the prompt or lower rollout.max_new_tokens")
    params = SamplingParams(max_new_tokens=r.max_new_tokens, temperature=0.0 if greedy else r.temperature,
                            top_p=1.0 if greedy else r.top_p, top_k=-1 if greedy else r.top_k,
                            stop_token_ids=stop_ids(tokenizer, r.stop_token_ids))
    requests = expand_samples([p.ids for p in prompts], n, params, base_seed=seed, rid_prefix=rid_prefix)
    completions = engine.generate(requests)
    aborted = [c.rid for c in completions if c.finish_reason == "abort"]
    if aborted:  # partial outputs of a stopped engine must never be scored and trained on
        raise EngineError(f"rollout {rid_prefix}: {len(aborted)} of {len(completions)} requests were aborted by "
                          f"the engine (e.g. {aborted[0]!r}); it was shut down or aborted mid-generation")
    stops = set(params.stop_token_ids)
    responses = [tokenizer.decode([t for t in c.output_ids if t not in stops], skip_special_tokens=True)
                 for c in completions]
    grouped = [p.sample for p in prompts for _ in range(n)]
    rewards = score_responses(reward_fn, grouped, responses, timeout_s=cfg.reward.timeout_s)
    return RolloutResult(completions, rewards, responses)


def broadcast_result(value, src: int):
    """Every rank gets the leader's value; an exception raised on the leader is raised on every rank."""
    box = [value if dist.get_rank() == src else None]
    if dist.get_world_size() > 1:  # alone, skip the pickling and two collectives (part of every sync's time)
        dist.broadcast_object_list(box, src=src)
    if isinstance(box[0], BaseException):
        raise box[0]
    return box[0]
