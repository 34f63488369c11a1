"""Partial rollout: over-sample, train on the first groups that finish, resume the rest on the next weights.

A step issues `ceil(prompts_per_step x rollout.over_sample)` GRPO groups across the pool: first the groups left in
the buffer by earlier steps (their unfinished samples resume with `prompt + tokens so far` as input and the rest of
their token budget), then fresh prompts. A group counts once all its samples finished and were scored (and, with
DAPO's filter, its rewards are not all equal); when `prompts_per_step` groups counted, the pool aborts every running
request (`RolloutPool.run(quota=...)`) and the aborted samples keep what they generated: tokens, logprobs and, per
token, the weight version that produced it. Those groups wait in the buffer for the next step. The buffer is plain
data (lists of ints and floats) and is saved in every checkpoint.

Staleness: a group whose oldest token is more than `rollout.max_staleness` versions older than the weights the next
update starts from is dropped (counted). Off-policy tokens are either masked out of the loss (`rollout.offpolicy:
mask`) or kept with truncated importance weights (`tis`, `algo.tis_cap`): see the loop.
"""
from __future__ import annotations

import asyncio
import copy
from dataclasses import asdict, dataclass, field
from typing import Any

from mtrain.rollout.client import EngineClient
from mtrain.rollout.protocol import Completion, Request, SamplingParams
from mtrain.rollout.routing import merge_resumed


@dataclass
class SampleState:
    seed: int
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" once finished
    resumes: int = 0  # how many times it was continued after an abort
    # routing replay: [prompt + outputs - 1, layers, top_k] routed experts from the latest request that produced
    # tokens (a resume re-feeds every earlier token under its weights); None when the engine records none
    routing: Any = None
    routing_rows_received: int = 0  # rows the engine sent over all its requests (the traffic metric)
    top_logprobs: list | None = None  # score centering: per output token the engine's top-k (id, logprob) pairs


@dataclass
class GroupState:
    uid: int  # unique over the run: names its requests
    sample_index: int  # index into the training set (the prompt and its answer)
    prompt_ids: list[int]
    samples: list[SampleState]
    rewards: list[float] | None = None
    responses: list[str] | None = None
    # the prompt's images (mtrain.data.vision.VisionInputs; prompt_ids hold their tokens): every resumed request
    # carries them and the trained completions keep them; checkpointed as plain tensors (VisionInputs.to_state)
    vision: Any = None

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)

    def oldest_version(self) -> int | None:
        vs = [v for s in self.samples for v in s.versions[:1]]
        return min(vs) if vs else None

    def completions(self) -> list[Completion]:
        return [Completion(rid=f"g{self.uid}-{j}", prompt_ids=list(self.prompt_ids), output_ids=list(s.output_ids),
                           logprobs=list(s.logprobs), finish_reason=s.finish_reason or "abort",
                           weight_version=max(s.versions, default=0), token_versions=list(s.versions),
                           routed_experts=s.routing if s.output_ids else None,
                           routed_rows_received=s.routing_rows_received, vision=self.vision,
                           top_logprobs=s.top_logprobs)
                for j, s in enumerate(self.samples)]


def new_group(uid: int, sample_index: int, prompt_ids: list[int], n: int, base_seed: int,
              vision: Any = None) -> GroupState:
    return GroupState(uid, sample_index, list(prompt_ids), [SampleState(seed=base_seed + uid * n + j) for j in range(n)],
                      vision=vision)


def resume_request(group: GroupState, j: int, params: SamplingParams, rid_prefix: str,
                   image_token_id: int | None = None) -> Request | None:
    """Sample j's next request: its prompt plus everything it generated so far, for the rest of its budget.
    image_token_id (a vision model's): a sample that sampled it before its abort ends there ("length"): fed back as
    input, the engines would take it for an image slot (SGLang finds images as runs of that token)."""
    s = group.samples[j]
    if s.finish_reason is not None:
        return None
    left = params.max_new_tokens - len(s.output_ids)
    if left <= 0:  # a budget that shrank (growing-length schedules only grow; a config change could) ends it
        s.finish_reason = "length"
        return None
    if image_token_id is not None and image_token_id in s.output_ids:
        s.finish_reason = "length"
        return None
    # A resumed sample draws from a fresh stream (seed advanced by its resume count): its sampler state was lost
    # with the abort; greedy samples continue exactly.
    # Routing replay: the resumed request re-feeds the prompt and the kept tokens under the new weights, and the
    # tokens it generates are sampled from that forward, so its routing replaces every row the sample held
    # (start 0): the trainer then replays the forward the engine ran for this version's tokens.
    return Request(rid=f"{rid_prefix}-g{group.uid}-{j}-", prompt_ids=list(group.prompt_ids) + list(s.output_ids),
                   params=SamplingParams(max_new_tokens=left, temperature=params.temperature, top_p=params.top_p,
                                         top_k=params.top_k, stop_token_ids=params.stop_token_ids,
                                         seed=s.seed + 7919 * s.resumes, top_logprobs=params.top_logprobs),
                   routed_experts_start=0, vision=group.vision)


def apply(group: GroupState, j: int, c: Completion) -> None:
    """Append what a (possibly aborted) request generated to sample j, with the version of every new token."""
    s = group.samples[j]
    if c.routed_experts is not None:
        s.routing_rows_received += int(c.routed_experts.shape[0])
    if c.output_ids:  # a request aborted before it produced anything brings no routing and changes none
        rows = len(group.prompt_ids) + len(s.output_ids) + len(c.output_ids) - 1
        s.routing = merge_resumed(None, c.routed_experts, rows, c.routed_experts_start)  # every row: resume_request
    s.output_ids += list(c.output_ids)
    s.logprobs += list(c.logprobs)
    s.versions += c.versions
    if c.top_logprobs is not None:
        s.top_logprobs = (s.top_logprobs or []) + [list(map(list, row)) for row in c.top_logprobs]
    if c.finish_reason == "abort":
        s.resumes += 1  # its next request continues it
    else:
        s.finish_reason = c.finish_reason


async def advance(group: GroupState, client: EngineClient, params: SamplingParams, rid_prefix: str, score,
                  filter_uniform: bool, image_token_id: int | None = None) -> tuple[bool, GroupState]:
    """Run a group's unfinished samples until they finish or are aborted; score it once finished.
    Returns (counts toward the step's quota, the group). score(group) -> (rewards, responses), run in a thread."""
    todo = [(j, r) for j in range(len(group.samples))
            if (r := resume_request(group, j, params, rid_prefix, image_token_id))]
    if todo:
        outs = await asyncio.gather(*(client.generate(r) for _, r in todo))
        for (j, _), c in zip(todo, outs):
            apply(group, j, c)
    if not group.finished:
        return False, group
    if group.rewards is None:
        group.rewards, group.responses = await asyncio.to_thread(score, group)
    uniform = len(set(group.rewards)) == 1
    return not (filter_uniform and uniform), group


def to_state(groups: list[GroupState]) -> list[dict[str, Any]]:
    """The buffer as plain data (checkpoints); a group's images as their tensors (VisionInputs.to_state)."""
    return [{**asdict(g), "vision": None if g.vision is None else g.vision.to_state()} for g in groups]


def from_state(state: list[dict[str, Any]]) -> list[GroupState]:
    from mtrain.data.vision import VisionInputs
    state = copy.deepcopy(state)  # the samples grow in place as they resume: never into the caller's state
    return [GroupState(**{**g, "samples": [SampleState(**s) for s in g["samples"]],
                          "vision": VisionInputs.from_state(g.get("vision"))}) for g in state]


def length_budget(rollout_cfg, step: int) -> int:
    """max_new_tokens at `step`: rollout.max_new_tokens, or a linear ramp from rollout.max_new_tokens_start to it over
    rollout.max_new_tokens_ramp_steps steps (short answers early, the full budget once the policy can use it)."""
    start, ramp, end = rollout_cfg.max_new_tokens_start, rollout_cfg.max_new_tokens_ramp_steps, rollout_cfg.max_new_tokens
    if start is None or ramp <= 0 or step >= ramp:
        return end
    return int(round(start + (end - start) * step / ramp))
