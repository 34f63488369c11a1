"""Multi-turn tool rollouts on the real CPU reference engine (a tiny Llama taught scripted turns, scripted_model.py).

What is checked: token-in-token-out (the trajectory's model tokens are the engine's output ids and logprobs, bit
for bit; every request's prompt is the trajectory so far), segment masks (every model token trained, no prompt /
tool / template token), the batch equal to build_batch's for single-turn trajectories, parallel calls, drift,
sessions released on every exit path (normal, tool crash, engine error, reward error, caller timeout, abort),
and an aborted trajectory resuming at the same turn with per-token weight versions.
"""
from __future__ import annotations

import asyncio

import pytest
import torch

from mtrain.data import CharTokenizer, PromptSample
from mtrain.data.rewards import RewardError, exact_match_reward
from mtrain.rollout import EngineError, SamplingParams
from mtrain.rollout.agents.multi_turn import RolloutContext, group_metrics, resume_group, rollout_group
from mtrain.rollout.client import LocalClient, RecordingClient
from mtrain.rollout.trajectory import to_batch
from mtrain.tools.base import BaseTool, ToolError
from mtrain.tools.calculator import CalculatorTool
from mtrain.tools.parsers import ToolCallParser
from mtrain.tools.server import ToolServer
from mtrain.trainer.batch import build_batch
from scripted_model import CONFIG, script_tokens, train_scripted_engine

TOK = CharTokenizer(128)
EOS = TOK.eos_token_id
CALL = '<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{}"}}}}\n</tool_call>'
TURN1 = CALL.format("123*456") + "\n" + CALL.format("9*9")  # two calls in one turn: run concurrently
REPLIES = [{"role": "tool", "name": "calculator", "content": "56088"}, {"role": "tool", "name": "calculator",
                                                                       "content": "81"}]
TOOL_Q, PLAIN_Q = "What is 123*456?", "Say hi."
TOOL_SAMPLE, PLAIN_SAMPLE = PromptSample(0, TOOL_Q, "56088"), PromptSample(1, PLAIN_Q, "hi")


@pytest.fixture(scope="module")
def trained():
    seqs = [script_tokens(TOK, TOOL_Q, [TURN1, "56088"], [REPLIES]), script_tokens(TOK, PLAIN_Q, ["hi"], [])]
    engine = train_scripted_engine(seqs)
    weights = [(k, v.clone()) for k, v in engine._views.items()]
    yield engine, weights
    engine.shutdown()


def ctx_for(tools=None, reward_fn=exact_match_reward, **kw):
    tools = tools or ToolServer([CalculatorTool()])
    kw.setdefault("params", SamplingParams(max_new_tokens=200, temperature=0.0, stop_token_ids=(EOS,)))
    return RolloutContext(tokenizer=TOK, tools=tools, parser=ToolCallParser("qwen25", tools.schemas, backend="mtrain"),
                          reward_fn=reward_fn, system_prompt=None, rid_prefix="g0", max_positions=512, **kw)


def test_token_in_token_out_masks_and_parallel_calls(trained):
    engine, _ = trained
    client, ctx = RecordingClient(engine), ctx_for()
    trajs = asyncio.run(rollout_group(TOOL_SAMPLE, 2, client, ctx))
    assert ctx.tools.open_sessions == []
    for t in trajs:
        assert [s.kind for s in t.segments] == ["prompt", "model", "env", "model"]
        assert t.finish_reason == "stop" and t.turns == 2 and t.reward == 1.0
        assert [c["output"] for c in t.tool_calls] == ["56088", "81"]
        assert "56088" in t.segments[2].text and "81" in t.segments[2].text
        mine = [(r, c) for r, c in client.log if r.rid.startswith(t.rid)]
        assert len(mine) == 2
        # bit for bit: the engine's output ids and logprobs, and each request's prompt = the trajectory so far
        assert t.model_ids == [i for _, c in mine for i in c.output_ids]
        assert [x for s in t.segments if s.trained for x in s.logprobs] == [x for _, c in mine for x in c.logprobs]
        assert all(v == engine.weight_version for s in t.segments if s.trained for v in s.versions)
        assert mine[0][0].prompt_ids == t.segments[0].ids
        assert mine[1][0].prompt_ids == t.tokens[:sum(len(s.ids) for s in t.segments[:3])]
        assert t.metrics["tool_calls"] == 2 and t.metrics["valid_tool_calls"] == 2 and t.metrics["tool_errors"] == 0
        # CharTokenizer's template writes "assistant: " (a space the model never generates after the generation
        # prompt "assistant:") and no <eos> after a message: 2 turns x (1 space + 1 <eos>) = 4 tokens of drift
        assert t.metrics["drift/tokens"] == 4
    batch = to_batch(trajs, pad_id=TOK.pad_token_id)
    for b, t in enumerate(trajs):
        mask = t.loss_mask
        assert batch.tokens[b, :len(t.tokens)].tolist() == t.tokens
        assert batch.response_mask[b, :len(mask) - 1].tolist() == mask[1:]  # position p predicts token p + 1
        assert batch.response_mask[b].sum() == t.num_model_tokens
        trained_ids = batch.tokens[b, 1:][batch.response_mask[b].bool()].tolist()
        assert trained_ids == t.model_ids  # every model token is trained, nothing else
        lp = batch.engine_logprobs[b][batch.response_mask[b].bool()]
        assert torch.equal(lp, torch.tensor([x for s in t.segments if s.trained for x in s.logprobs]))
    m = group_metrics(trajs)
    assert m["tools/call_rate"] == 1.0 and m["tools/valid_rate"] == 1.0 and m["finish/stop"] == 1.0


def test_single_turn_batch_equals_build_batch(trained):
    engine, _ = trained
    client, ctx = RecordingClient(engine), ctx_for(params=SamplingParams(max_new_tokens=20, temperature=1.0,
                                                                         stop_token_ids=(EOS,)))
    trajs = asyncio.run(rollout_group(PLAIN_SAMPLE, 3, client, ctx))
    assert all(t.finish_reason in ("stop", "length") and len(t.segments) == 2 for t in trajs)
    completions = [c for _, c in sorted(client.log, key=lambda rc: rc[0].rid)]
    rewards = [t.reward for t in trajs]
    a, b = to_batch(trajs, pad_id=0, pad_to_multiple=4), build_batch(completions, rewards, pad_id=0, pad_to_multiple=4)
    for f in ("tokens", "response_mask", "engine_logprobs", "rewards", "response_lens"):
        assert torch.equal(getattr(a, f), getattr(b, f)), f
    assert len({c.params.seed for c, _ in client.log}) == 3  # every sample of the group has its own seed


class Exploding(BaseTool):
    schema = {"type": "function", "function": {"name": "calculator", "parameters": {
        "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}

    def call(self, session, args):
        raise RuntimeError("disk on fire")


def test_tool_crash_is_a_message_and_the_rollout_goes_on(trained):
    engine, _ = trained
    ctx = ctx_for(tools=ToolServer([Exploding()]), max_turns=2)
    t, = asyncio.run(rollout_group(TOOL_SAMPLE, 1, LocalClient(engine), ctx))
    assert t.metrics["tool_errors"] == 2 and "disk on fire" in t.segments[2].text
    assert t.turns >= 2 and ctx.tools.open_sessions == []


def test_max_turns_and_budget_end_a_trajectory(trained):
    engine, _ = trained
    t, = asyncio.run(rollout_group(TOOL_SAMPLE, 1, LocalClient(engine), ctx_for(max_turns=1)))
    assert t.finish_reason == "max_turns" and [s.kind for s in t.segments] == ["prompt", "model"]
    plen = len(script_tokens(TOK, TOOL_Q, [], [])[0])
    t, = asyncio.run(rollout_group(TOOL_SAMPLE, 1, LocalClient(engine), ctx_for(max_total_tokens=plen + 30)))
    assert t.finish_reason in ("budget", "length") and len(t.tokens) <= plen + 30


def test_sessions_released_on_engine_error_reward_error_and_timeout(trained):
    _, weights = trained
    dead = train_engine_copy(weights)
    dead.shutdown()
    ctx = ctx_for()
    with pytest.raises(EngineError):
        asyncio.run(rollout_group(TOOL_SAMPLE, 2, LocalClient(dead), ctx))
    assert ctx.tools.open_sessions == []

    def broken_reward(response, answer):
        raise ValueError("no")
    engine = trained[0]
    ctx = ctx_for(reward_fn=broken_reward)
    with pytest.raises(RewardError, match="broken_reward"):
        asyncio.run(rollout_group(TOOL_SAMPLE, 2, LocalClient(engine), ctx))
    assert ctx.tools.open_sessions == []

    slow = train_engine_copy(weights, decode_delay_s=0.02)
    ctx = ctx_for()

    async def with_deadline():
        client = LocalClient(slow)
        try:
            await asyncio.wait_for(rollout_group(TOOL_SAMPLE, 2, client, ctx), timeout=0.3)
        finally:
            client.abort(ctx.rid_prefix)
    try:
        with pytest.raises(asyncio.TimeoutError):
            asyncio.run(with_deadline())
        assert ctx.tools.open_sessions == []
    finally:
        slow.shutdown()


def train_engine_copy(weights, **kw):
    from mtrain.rollout import ReferenceEngine
    e = ReferenceEngine(CONFIG, **kw)
    e.update_weights([[(k, v.clone()) for k, v in weights]])
    e.finish_weight_update(1)
    return e


def test_abort_mid_turn_then_resume_at_the_same_turn(trained):
    engine, weights = trained
    slow = train_engine_copy(weights, decode_delay_s=0.01)
    ctx = ctx_for()
    try:
        async def abort_soon():
            client = LocalClient(slow)
            task = asyncio.create_task(rollout_group(TOOL_SAMPLE, 1, client, ctx))
            while not slow.active_requests():
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.2)
            client.abort(ctx.rid_prefix)
            return await task
        t, = asyncio.run(abort_soon())
        assert t.finish_reason == "abort" and t.reward is None and ctx.tools.open_sessions == []
        partial = len(t.segments[-1].ids)
        assert t.segments[-1].kind == "model" and 0 < partial < len(TOK.encode(TURN1, False)) + 1
        slow.update_weights([[(k, v.clone()) for k, v in weights]])  # a weight sync happens while it waits
        slow.finish_weight_update(2)
        t, = asyncio.run(resume_group([t], LocalClient(slow), ctx))
        assert t.finish_reason == "stop" and t.reward == 1.0 and t.turns == 2
        assert [s.kind for s in t.segments] == ["prompt", "model", "env", "model"]
        # the resumed turn is the scripted turn (greedy continuation of the same prefix), its tokens tagged with
        # the version each was sampled under
        assert TOK.decode(t.segments[1].ids) == TURN1 + TOK.eos_token
        assert t.segments[1].versions == [1] * partial + [2] * (len(t.segments[1].ids) - partial)
        assert t.segments[3].versions == [2] * len(t.segments[3].ids)
        assert [c["output"] for c in t.tool_calls] == ["56088", "81"]  # run once, not replayed twice
    finally:
        slow.shutdown()


def test_update_in_place_mid_turn_tags_each_token(trained):
    """rollout.async=stream: a weight update in place lands inside a turn (pause between two decoding steps, sync,
    continue): the turn goes on with its KV and tool calls, and its tokens carry the version each was sampled under."""
    engine, weights = trained
    slow = train_engine_copy(weights, decode_delay_s=0.01)
    ctx = ctx_for()
    try:
        async def update_soon():
            task = asyncio.create_task(rollout_group(TOOL_SAMPLE, 1, LocalClient(slow), ctx))
            while not slow.active_requests():
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.2)
            slow.pause_in_place()
            slow.update_weights([[(k, v.clone()) for k, v in weights]])
            slow.finish_weight_update(2)
            slow.continue_generation()
            return await task
        t, = asyncio.run(update_soon())
        assert t.finish_reason == "stop" and t.reward == 1.0 and t.turns == 2 and ctx.tools.open_sessions == []
        assert TOK.decode(t.segments[1].ids) == TURN1 + TOK.eos_token
        first = t.segments[1].versions
        k = first.count(1)
        assert 0 < k < len(first) and first == [1] * k + [2] * (len(first) - k), first
        assert t.segments[3].versions == [2] * len(t.segments[3].ids)
        assert [c["output"] for c in t.tool_calls] == ["56088", "81"]
    finally:
        slow.shutdown()


def test_non_finite_rewards_never_reach_a_trajectory(trained):
    """A tool's NaN reward, and a reward function's 10**400 (beyond a float), stop the group with one RewardError
    naming where it came from, instead of a NaN reward (or an OverflowError) in the batch."""
    engine = trained[0]

    class NanRewardCalculator(CalculatorTool):
        def calc_reward(self, session):
            return float("nan")
    ctx = ctx_for(tools=ToolServer([NanRewardCalculator()]), tool_reward_weight=0.5)
    with pytest.raises(RewardError, match=r"tool 'calculator' on sample 0 .*returned nan; expected a finite number"):
        asyncio.run(rollout_group(TOOL_SAMPLE, 1, LocalClient(engine), ctx))
    assert ctx.tools.open_sessions == []

    class HugeRewardCalculator(CalculatorTool):
        def calc_reward(self, session):
            return 10 ** 400
    ctx = ctx_for(tools=ToolServer([HugeRewardCalculator()]), tool_reward_weight=0.5)
    with pytest.raises(RewardError, match=r"tool 'calculator' on sample 0 .*not one number"):
        asyncio.run(rollout_group(TOOL_SAMPLE, 1, LocalClient(engine), ctx))

    def huge_reward(response, answer):
        return 10 ** 400
    with pytest.raises(RewardError, match=r"huge_reward.*sample 0 .*not one number"):
        asyncio.run(rollout_group(TOOL_SAMPLE, 1, LocalClient(engine), ctx_for(reward_fn=huge_reward)))
