"""The multi-turn tool rollout: generate, parse tool calls, run them, append the results, until the model answers.

Per GRPO group (what the trainer calls):

    trajectories = await rollout_group(sample, n, client, ctx)      # n Trajectory objects, rewards filled in
    batch = mtrain.rollout.trajectory.to_batch(all_trajectories, pad_id)

One trajectory, turn by turn:
1. generate from the trajectory's tokens so far (token-in-token-out: the prompt ids, then every model turn's ids
   exactly as the engine returned them, then the environment's ids);
2. the turn's text goes through the tool-call parser; no call attempted -> the trajectory is done ("stop");
3. every call of the turn runs concurrently in the trajectory's own tool session (at most
   max_tool_calls_per_turn; malformed calls and calls over the limit are answered with an error message);
4. the tool messages are rendered by the chat template as a suffix (mtrain.rollout.agents.tito) and appended
   as an environment segment (loss mask 0); back to 1 until max_turns or the token budget ends it.
The session is released on every exit path (normal end, tool or engine error, cancellation, abort). Rewards:
the reward function (which receives the whole trajectory as `trajectory=`, and the final turn's text as the
response) plus `tool_reward_weight` x the tools' calc_reward.

An aborted turn (the engine's finish_reason "abort", e.g. a weight sync interrupting a partial rollout) ends the
call with finish_reason "abort" and the partial tokens kept (tagged with the weight version they were sampled
under); `resume_trajectory` continues it at the same turn: a fresh tool session replays the logged calls, then
generation continues from the partial turn.

Images (a vision model, a sample with `<image>` markers): the prompt segment holds the expanded image tokens, the
trajectory its VisionInputs (computed once), and every turn's request carries them; an image token after the prompt
(sampled, or in a tool's text) ends the trajectory with finish_reason "image_token" (docs/design-vlm-data.md).
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from mtrain.data.chat import PromptError
from mtrain.data.datasets import PromptSample
from mtrain.data.rewards import finite_reward, safe_reward
from mtrain.rollout.agents import tito
from mtrain.rollout.client import EngineClient
from mtrain.rollout.protocol import Request, SamplingParams
from mtrain.rollout.trajectory import Segment, Trajectory
from mtrain.tools.parsers import ToolCallParser
from mtrain.tools.server import ToolResult, ToolServer

log = logging.getLogger(__name__)

DEFAULT_SYSTEM_PROMPT = (
    "You are a helpful assistant with tools. To call a tool, write exactly\n"
    "<tool_call>\n{\"name\": TOOL_NAME, \"arguments\": {ARGUMENTS AS JSON}}\n</tool_call>\n"
    "and stop; the result comes back in the next message. When you know the answer, reply without a tool call.\n"
    "Tools:\n{tools}"
)
_SEED_STRIDE = 1_000  # seeds per trajectory: one per turn (and resumption)


@dataclass
class RolloutContext:
    """What a rollout function needs besides the sample and the client."""

    tokenizer: Any
    tools: ToolServer
    parser: ToolCallParser
    params: SamplingParams  # per turn; stop_token_ids must hold the end-of-turn token(s)
    reward_fn: Callable[..., float] | None
    base_seed: int = 0
    rid_prefix: str = "mt"
    max_turns: int = 4
    max_total_tokens: int = 1024
    max_tool_calls_per_turn: int = 4
    tool_reward_weight: float = 0.0
    system_prompt: str | None = DEFAULT_SYSTEM_PROMPT  # "{tools}" -> one line per tool (other braces stay); None: none
    reward_timeout_s: float | None = None
    template_tools: bool = True  # pass the schemas to apply_chat_template(tools=...) (templates that use them)
    max_positions: int | None = None  # the model's context: the token budget never exceeds it
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.params.stop_token_ids:
            raise ValueError("RolloutContext.params.stop_token_ids is empty: a model turn must end on the "
                             "tokenizer's end-of-turn token, or every turn runs to max_new_tokens")
        for k in ("max_turns", "max_total_tokens", "max_tool_calls_per_turn"):
            if getattr(self, k) < 1:
                raise ValueError(f"RolloutContext.{k} must be >= 1, got {getattr(self, k)}")

    @property
    def token_budget(self) -> int:
        return min(self.max_total_tokens, self.max_positions or self.max_total_tokens)

    @property
    def template_schemas(self) -> list[dict] | None:
        return self.tools.schemas if self.template_tools else None


def initial_messages(sample: PromptSample, ctx: RolloutContext) -> list[dict[str, Any]]:
    messages = [{"role": "user", "content": sample.prompt}] if isinstance(sample.prompt, str) else list(sample.prompt)
    if ctx.system_prompt and not (messages and messages[0]["role"] == "system"):
        listing = "\n".join(f"- {s['function']['name']}: {s['function'].get('description', '')} arguments: "
                            f"{list(s['function'].get('parameters', {}).get('properties', {}))}"
                            for s in ctx.tools.schemas)
        messages = [{"role": "system", "content": ctx.system_prompt.replace("{tools}", listing)}] + messages
    return messages


def new_trajectory(sample: PromptSample, ctx: RolloutContext, rid: str) -> Trajectory:
    """The prompt segment. A sample with images (a vision model): the chat template renders their markers, the
    processor computes pixel values and grids once, each image token is expanded to its image's token count; the
    trajectory keeps the VisionInputs and every turn's request carries them (the engine prefills the whole
    trajectory each turn), as `to_batch` hands them to the trainer."""
    messages = initial_messages(sample, ctx)
    vision = None
    if getattr(sample, "images", ()):
        if not hasattr(ctx.tokenizer, "render_messages"):
            raise PromptError(f"sample {sample.index}: the sample has {len(sample.images)} image(s) but the model has "
                             f"no vision tower (its config.json has no vision_config/image_token_id)")
        messages, text, ids, vision = ctx.tokenizer.render_messages(messages, sample.images, ctx.template_schemas,
                                                                    sample_id=sample.index)
    else:
        text, ids = tito.prompt_ids(ctx.tokenizer, messages, ctx.template_schemas)
    if len(ids) >= ctx.token_budget:
        # the prompt as the chat template renders it with the tools' system prompt, so known only here: one line
        # (PromptError) for what the user changes, not a traceback per rank
        raise PromptError(f"sample {sample.index}: the prompt has {len(ids)} tokens (with the tools' system prompt), "
                          f"not below the token budget {ctx.token_budget} (multi_turn.max_total_tokens="
                          f"{ctx.max_total_tokens}, model context {ctx.max_positions}); shorten the prompt or "
                          f"multi_turn.system_prompt, or use a model of a longer context")
    return Trajectory(rid=rid, segments=[Segment("prompt", ids, text=text)], messages=messages, sample=sample,
                      vision=vision,
                      metrics={"tool_calls": 0.0, "valid_tool_calls": 0.0, "tool_errors": 0.0, "aborts": 0.0})


def _has_image_token(ctx: RolloutContext, ids: list[int]) -> bool:
    """A vision model's image token after the prompt (sampled by the model, or in a tool's text): the engines take
    image slots from every image-token run of a request's input, so the trajectory cannot be fed back; it ends
    ("image_token"). Images from tool turns are not supported."""
    image_token = getattr(ctx.tokenizer, "image_token_id", None)
    return image_token is not None and image_token in ids


def _strip_stop(ids: list[int], stops: tuple[int, ...]) -> tuple[list[int], int | None]:
    if ids and ids[-1] in stops:
        return ids[:-1], ids[-1]
    return ids, None


async def _run_calls(ctx: RolloutContext, session, parsed) -> list[tuple[str, ToolResult]]:
    """Every call of one turn, concurrently; malformed and surplus calls get an error result without running."""
    calls = parsed.calls[:ctx.max_tool_calls_per_turn]
    results = list(await asyncio.gather(*(ctx.tools.call(session, c.name, c.arguments) for c in calls)))
    out = [(c.name, r) for c, r in zip(calls, results)]
    for c in parsed.calls[ctx.max_tool_calls_per_turn:]:
        out.append((c.name, ToolResult(c.name, False, f"Error: at most {ctx.max_tool_calls_per_turn} tool calls "
                                                      f"per turn; this one was not run", "too_many_calls")))
    for raw, why in parsed.malformed:
        out.append(("invalid", ToolResult("invalid", False, f"Error: could not use the tool call ({why}). Write "
                                                            f"<tool_call>\\n{{\"name\": ..., \"arguments\": {{...}}}}"
                                                            f"\\n</tool_call>", "malformed")))
    return out


async def _turns(traj: Trajectory, client: EngineClient, ctx: RolloutContext, session, seed: int) -> None:
    tok, stops = ctx.tokenizer, tuple(ctx.params.stop_token_ids)
    resuming = traj.finish_reason == "abort"
    refeed = resuming  # the first request after an abort runs under new weights: it takes every routing row
    while True:
        used = sum(len(s.ids) for s in traj.segments)
        budget = ctx.token_budget - used
        if budget <= 0:
            traj.finish_reason = "budget"
            return
        partial = traj.segments[-1] if resuming else None
        done_in_turn = len(partial.ids) if partial is not None else 0
        room = min(ctx.params.max_new_tokens - done_in_turn, budget)
        if room <= 0:  # the aborted turn had already used its max_new_tokens
            comp_ids, comp_lp, finish, version, comp_top = [], [], "length", client.weight_version, None
        else:
            aborts = int(traj.metrics.get("aborts", 0))  # a resumed turn samples from a fresh seed
            # routing replay: only the rows the trajectory lacks (its earlier turns' rows, recorded under the same
            # weights, stay), but every row when resuming after an abort or on new weights: that request re-feeds the
            # whole trajectory under them and samples the turn's next tokens from it (partial.resume_request: the same)
            start = 0 if refeed else traj.routing_request_start(client.weight_version)
            req = Request(rid=f"{traj.rid}t{traj.turns}-{aborts}-", prompt_ids=traj.tokens,
                          params=replace(ctx.params, max_new_tokens=room, seed=seed + traj.turns * 16 + aborts % 16),
                          routed_experts_start=start,
                          vision=traj.vision)  # the same images every turn: the engine prefills them again
            comp = await client.generate(req)
            # per token: rollout.async=stream's update in place may land inside a turn (Completion.token_versions)
            comp_ids, comp_lp, finish, version = comp.output_ids, comp.logprobs, comp.finish_reason, comp.versions
            comp_top = comp.top_logprobs  # score centering's head (None unless asked for)
        traj.add_model_tokens(list(comp_ids), list(comp_lp), version, continue_last=resuming, top_logprobs=comp_top)
        if room > 0:
            # routing replay: None unless the engine records routing
            traj.record_routing(comp.routed_experts, comp.routed_experts_start, comp.weight_version)
            refeed = False
        resuming = False
        sampled_image_token = _has_image_token(ctx, traj.segments[-1].ids)
        if finish == "abort" and not sampled_image_token:
            traj.finish_reason = "abort"
            traj.metrics["aborts"] = traj.metrics.get("aborts", 0) + 1
            return
        traj.finish_reason = None
        turn = traj.segments[-1]
        body, stop_id = _strip_stop(turn.ids, stops)
        turn.text = tok.decode(body, skip_special_tokens=False)
        traj.turns += 1
        traj.messages.append({"role": "assistant", "content": turn.text})
        if sampled_image_token:  # trained as sampled (text, as the engine embedded it), never fed back
            traj.finish_reason = "image_token"
            return
        if finish == "length":
            traj.finish_reason = "length"
            return
        parsed = ctx.parser.parse(turn.text)
        if parsed.attempted == 0:
            traj.finish_reason = "stop"
            return
        traj.metrics["tool_calls"] += parsed.attempted
        traj.metrics["valid_tool_calls"] += min(len(parsed.calls), ctx.max_tool_calls_per_turn)
        if traj.turns >= ctx.max_turns:
            traj.finish_reason = "max_turns"
            return
        results = await _run_calls(ctx, session, parsed)
        traj.metrics["tool_errors"] += sum(not r.ok for _, r in results)
        tool_msgs = [{"role": "tool", "name": name, "content": r.content} for name, r in results]
        stop_text = tok.decode([stop_id], skip_special_tokens=False) if stop_id is not None else None
        text, ids = tito.suffix(tok, tool_msgs, ctx.template_schemas, stop_text=stop_text)
        if sum(len(s.ids) for s in traj.segments) + len(ids) >= ctx.token_budget:
            traj.finish_reason = "budget"  # no room to generate after the tool results: stop before them
            return
        if _has_image_token(ctx, ids):  # a tool's text holding the image token: not fed to the engine
            traj.finish_reason = "image_token"
            return
        traj.segments.append(Segment("env", ids, text=text))
        traj.messages.extend(tool_msgs)


async def _replay(ctx: RolloutContext, session, calls: list[dict[str, Any]]) -> None:
    """Rebuild a resumed trajectory's tool state by calling its logged calls again, in order."""
    for c in calls:
        await ctx.tools.call(session, c["name"], c["arguments"])
    session.calls[:] = list(calls)


async def _finish(traj: Trajectory, ctx: RolloutContext, session) -> None:
    tool_rewards = {name: finite_reward(r, f"tool {name!r} on sample {traj.sample.index} ({traj.rid})")
                    for name, r in ctx.tools.calc_reward(session).items()}  # a NaN would hide inside the sum
    traj.metrics.update({f"tool_reward/{k}": v for k, v in tool_rewards.items()})
    traj.tool_calls = list(session.calls)
    sample = traj.sample
    reward = 0.0
    if ctx.reward_fn is not None:
        reward += await asyncio.to_thread(
            safe_reward, ctx.reward_fn, traj.final_text, sample.answer, prompt=sample.prompt,
            metadata=sample.metadata, sample_id=f"{sample.index} ({traj.rid})", timeout_s=ctx.reward_timeout_s,
            trajectory=traj)
    reward += ctx.tool_reward_weight * sum(tool_rewards.values())
    traj.reward = finite_reward(reward, f"the reward of sample {sample.index} ({traj.rid})")
    last_model = next((s for s in reversed(traj.segments) if s.trained), None)
    stop_id = last_model.ids[-1] if last_model and last_model.ids and last_model.ids[-1] in ctx.params.stop_token_ids \
        else None
    traj.metrics.update(tito.drift(
        ctx.tokenizer, traj.messages, ctx.template_schemas, traj.tokens,
        ends_with_generation_prompt=traj.segments[-1].kind == "env", vision=traj.vision,
        stop_text=ctx.tokenizer.decode([stop_id], skip_special_tokens=False) if stop_id is not None else None))
    traj.metrics["turns"] = float(traj.turns)
    traj.metrics["model_tokens"] = float(traj.num_model_tokens)


async def run_trajectory(traj: Trajectory, client: EngineClient, ctx: RolloutContext, seed: int) -> Trajectory:
    """Run (or resume, when traj.finish_reason == "abort") one trajectory to its end or to the next abort."""
    session = ctx.tools.create_session(traj.rid)
    try:
        if traj.finish_reason == "abort" and traj.tool_calls:
            await _replay(ctx, session, traj.tool_calls)
        await _turns(traj, client, ctx, session, seed)
        traj.tool_calls = list(session.calls)
        if traj.finish_reason != "abort":
            await _finish(traj, ctx, session)
    finally:
        ctx.tools.release_session(session)
    return traj


def group_rids(ctx: RolloutContext, n: int) -> list[str]:
    width = len(str(n - 1))
    return [f"{ctx.rid_prefix}-{j:0{width}d}-" for j in range(n)]


async def rollout_group(sample: PromptSample, n: int, client: EngineClient, ctx: RolloutContext) -> list[Trajectory]:
    """n trajectories of one prompt (a GRPO group), run concurrently; rewards filled in.

    Trajectory j uses seeds from ctx.base_seed + j * 1000 (one per turn), rid f"{ctx.rid_prefix}-{j}-"; all
    requests of the group start with ctx.rid_prefix, so client.abort(ctx.rid_prefix) aborts the group. If one
    trajectory fails (an engine error, a reward error) the others are cancelled, every session is released and
    the error propagates. Aborted trajectories come back with finish_reason "abort" (no reward): pass them to
    `resume_group` later."""
    if n < 1:
        raise ValueError(f"rollout_group: n must be >= 1, got {n}")
    trajs = [new_trajectory(sample, ctx, rid) for rid in group_rids(ctx, n)]
    return await resume_group(trajs, client, ctx)


async def resume_group(trajectories: list[Trajectory], client: EngineClient, ctx: RolloutContext
                       ) -> list[Trajectory]:
    """Run every trajectory that is new or aborted; finished ones are returned as they are."""
    try:
        async with asyncio.TaskGroup() as tg:
            for j, t in enumerate(trajectories):
                if t.reward is None:
                    tg.create_task(run_trajectory(t, client, ctx, ctx.base_seed + j * _SEED_STRIDE))
    except BaseExceptionGroup as group:  # one clear error: the first trajectory's (the others were cancelled)
        first = group
        while isinstance(first, BaseExceptionGroup):
            first = first.exceptions[0]
        raise first from None
    return trajectories


def group_metrics(trajectories: list[Trajectory]) -> dict[str, float]:
    """Means over trajectories: tool-call rate (share of trajectories with at least one call), valid-call rate
    (valid / attempted calls), turns, drift, finish reasons."""
    n = len(trajectories)
    calls = sum(t.metrics.get("tool_calls", 0) for t in trajectories)
    valid = sum(t.metrics.get("valid_tool_calls", 0) for t in trajectories)
    out = {"tools/call_rate": sum(t.metrics.get("tool_calls", 0) > 0 for t in trajectories) / n,
           "tools/valid_rate": valid / calls if calls else 0.0,
           "tools/calls_per_traj": calls / n,
           "tools/error_rate": sum(t.metrics.get("tool_errors", 0) for t in trajectories) / calls if calls else 0.0}
    for k in ("turns", "model_tokens", "drift/tokens"):
        out[f"traj/{k}"] = sum(t.metrics.get(k, 0.0) for t in trajectories) / n
    out["traj/drift_any"] = sum(t.metrics.get("drift/tokens", 0) > 0 for t in trajectories) / n
    for reason in ("stop", "length", "max_turns", "budget", "abort", "image_token"):
        out[f"finish/{reason}"] = sum(t.finish_reason == reason for t in trajectories) / n
    return out
