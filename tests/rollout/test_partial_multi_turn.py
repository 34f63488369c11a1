"""Partial rollout of multi-turn tool trajectories (rollout.partial with multi_turn.rollout_fn) on the CPU
reference engine, through the real pool (one gloo rank) and `PartialRollout`.

The engine is a tiny Llama taught scripted turns (scripted_model.py): for the tool question it calls the calculator
twice in one long first turn, then answers in a long second turn after the results; for the plain question it says
"hi". Step 1 keeps two groups in flight (over_sample 2): the plain group meets the quota of 1 while the tool group
is still generating, so the tool group is aborted and buffered mid-turn. (The reference engine decodes whole batches:
the plain group is submitted first, so it is in the first batch; the tool group is either in that batch too and is
aborted in its second turn, after its tool calls, or in the next batch and aborted in its first turn. Both are
resumptions; the assertions hold for either.) The buffer goes through a checkpoint (pickled state, a new
PartialRollout), the engine takes new weights (version 2), and step 2 (over_sample 1) resumes the tool group at the
same turn. Checked: the finished trajectories equal an uninterrupted run of the same group token for token, every
token generated before the abort carries version 1 and every later one version 2, each tool call ran once (a turn-2
resumption replays the logged calls into a fresh session), rewards, the resume and off-policy metrics.
"""
from __future__ import annotations

import asyncio
import pickle

from mtrain.data import CharTokenizer, PromptSample
from mtrain.dist import run_on_ranks
from scripted_model import script_tokens, train_scripted_engine

TOK = CharTokenizer(128)
CALL = '<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{}"}}}}\n</tool_call>'
TURN1 = CALL.format("123*456") + "\n" + CALL.format("9*9")
REPLIES = [{"role": "tool", "name": "calculator", "content": "56088"},
           {"role": "tool", "name": "calculator", "content": "81"}]
ANSWER = "The product of 123 and 456 is 56088."  # long: an abort lands inside this turn, not after it
TOOL_Q, PLAIN_Q = "What is 123*456?", "Say hi."
DATA = [PromptSample(0, PLAIN_Q, "hi"), PromptSample(1, TOOL_Q, "56088")]


def reward(response, answer, trajectory=None):
    """Right answers score 1 (sample 0) or 0.5 (sample 1): a group with a right answer has a learning signal."""
    ok = str(answer) in response
    return (1.0 if trajectory.rid.endswith("-0-") else 0.5) if ok else 0.0


async def rollout_fn(sample, n, client, ctx):
    """The built-in multi-turn rollout; the tool group starts 2 ms late so the plain group is submitted first."""
    from mtrain.rollout.agents.multi_turn import rollout_group
    if sample.prompt == TOOL_Q:
        await asyncio.sleep(0.002)
    return await rollout_group(sample, n, client, ctx)


from mtrain.rollout.agents.multi_turn import resume_group  # noqa: E402  what partial rollout resumes groups with


def _steps(rank, world, weights):
    import torch.distributed as dist

    from mtrain.config import load_config
    from mtrain.data.sampler import PromptSampler
    from mtrain.rollout import ReferenceEngine
    from mtrain.rollout.agents.multi_turn import rollout_group
    from mtrain.rollout.groups import EngineGroups
    from mtrain.rollout.pool import RolloutPool
    from mtrain.rollout.agents.setup import build_tool_server
    from mtrain.trainer.sources.partial import PartialRollout
    from scripted_model import CONFIG

    dist.init_process_group("gloo", rank=rank, world_size=world)
    engine = ReferenceEngine(CONFIG, decode_delay_s=0.01)  # the tool turn takes > 1 s, "hi" ~ 0.05 s
    engine.update_weights([[(k, v.clone()) for k, v in weights]])
    engine.finish_weight_update(1)
    cfg = load_config(None, [
        "model.hf_path=unused", "data.task=arithmetic", "train.micro_batch_size=2", "rollout.partial=true", "rollout.prompts_per_step=1", "rollout.samples_per_prompt=2", "rollout.temperature=0.0001",
        "rollout.max_new_tokens=200", "rollout.over_sample=2", "rollout.offpolicy=tis", "algo.tis_cap=2",
        "algo.filter_uniform_groups=true", "multi_turn.rollout_fn=mtrain.rollout.agents.multi_turn:rollout_group",
        "multi_turn.max_total_tokens=500", "multi_turn.system_prompt=",
        "multi_turn.parser_backend=mtrain", "data.shuffle=false"])

    def make():
        pool = RolloutPool(EngineGroups(1, 1, 1), 0, engine, max_groups_in_flight=4)
        pr = PartialRollout(cfg, pool, TOK, DATA, PromptSampler(2, 1, shuffle=False), reward)
        pr.use_multi_turn(build_tool_server(cfg.multi_turn), rollout_fn, 512)
        return pr

    pr = make()
    first = pr.step(0, version=1, base_seed=77)
    state = pickle.loads(pickle.dumps(pr.state_dict()))  # what a checkpoint keeps
    pr2 = make()
    pr2.load_state_dict(state)
    pr2.sampler.position = pr.sampler.position
    engine.update_weights([[(k, v.clone()) for k, v in weights]])  # the weight sync between the steps
    engine.finish_weight_update(2)
    cfg.rollout.over_sample = 1.0  # only the buffered group in flight: it finishes and meets the quota
    second = pr2.step(1, version=2, base_seed=77)

    # the same group run uninterrupted on the same weights (temperature 1e-4: the argmax, as in the steps)
    from mtrain.rollout.agents.setup import make_context
    from mtrain.rollout.client import LocalClient
    from mtrain.rollout.protocol import SamplingParams
    ctx = make_context(cfg, TOK, build_tool_server(cfg.multi_turn), reward, base_seed=77 + 2000, rid_prefix="ref",
                       params=SamplingParams(max_new_tokens=200, temperature=0.0001, stop_token_ids=(TOK.eos_token_id,)),
                       max_positions=512)
    reference = asyncio.run(rollout_group(DATA[1], 2, LocalClient(engine), ctx))
    engine.shutdown()
    return first, state, second, reference


def test_aborted_trajectories_resume_at_the_same_turn_across_a_checkpoint():
    seqs = [script_tokens(TOK, TOOL_Q, [TURN1, ANSWER], [REPLIES]), script_tokens(TOK, PLAIN_Q, ["hi"], [])]
    engine = train_scripted_engine(seqs)
    weights = [(k, v.clone()) for k, v in engine._views.items()]
    engine.shutdown()
    (first, state, second, reference), = run_on_ranks(_steps, 1, weights, timeout=300)

    # step 1: the plain group (uid 0) is trained; the tool group (uid 1) was aborted mid-turn and buffered
    assert [t.final_text for t in first.trajectories] == ["hi", "hi"] and first.rewards == [1.0, 0.5]
    assert state["kind"] == "multi_turn"
    buffered = {g["uid"]: g for g in state["buffer"]}
    assert set(buffered) == {1, 2} and buffered[2]["trajectories"] is None  # the reserve group never started
    tool = buffered[1]["trajectories"]
    assert [t["finish_reason"] for t in tool] == ["abort", "abort"] and all(t["reward"] is None for t in tool)
    before = []  # model tokens each trajectory had at the abort
    for t in tool:
        kinds = [s["kind"] for s in t["segments"]]
        assert kinds in (["prompt", "model"], ["prompt", "model", "env", "model"])  # aborted in turn 1 or turn 2
        assert t["turns"] == len(kinds) // 2 - 1  # the aborted turn is not counted as done
        assert len(t["tool_calls"]) == (2 if t["turns"] else 0)  # the session's log, replayed on resumption
        last = t["segments"][-1]["ids"]
        assert len(last) < (len(TURN1) if t["turns"] == 0 else len(ANSWER))  # really mid-turn
        before.append(sum(len(s["ids"]) for s in t["segments"] if s["kind"] == "model"))
        assert all(set(s["versions"]) <= {1} for s in t["segments"] if s["kind"] == "model")
    assert first.metrics["rollout/offpolicy_token_frac"] == 0.0

    # step 2: resumed at the same turn on version 2 and finished, token for token the uninterrupted run
    assert [t.rid for t in second.trajectories] == ["s1-g1-0-", "s1-g1-1-"]  # this step's names (the abort's prefix)
    assert second.rewards == [1.0, 0.5] and second.metrics["rollout/resumed"] == 2
    for got, want, k in zip(second.trajectories, reference, before):
        assert got.finish_reason == "stop" and got.turns == 2 and want.finish_reason == "stop"
        assert [s.kind for s in got.segments] == ["prompt", "model", "env", "model"]
        assert [s.ids for s in got.segments] == [s.ids for s in want.segments]
        assert TOK.decode(got.segments[1].ids) == TURN1 + TOK.eos_token
        assert TOK.decode(got.segments[3].ids) == ANSWER + TOK.eos_token
        versions = [v for s in got.segments if s.trained for v in s.versions]
        assert versions == [1] * k + [2] * (len(versions) - k)
        assert [c["output"] for c in got.tool_calls] == ["56088", "81"]  # each call once in the log
    old = sum(before)
    total = sum(t.num_model_tokens for t in second.trajectories)
    assert abs(second.metrics["rollout/offpolicy_token_frac"] - old / total) < 1e-9
    assert second.metrics.get("rollout/tokens_lag_1", 0.0) == old


def test_a_rollout_function_without_resume_group_is_refused():
    import pytest

    from mtrain.data.rewards import digit_share_reward
    from mtrain.rollout.partial_multi_turn import resume_fn_of
    assert resume_fn_of(rollout_fn) is resume_group
    with pytest.raises(ValueError, match="mtrain.data.rewards:digit_share_reward: its module has no resume_group"):
        resume_fn_of(digit_share_reward)


def test_a_buffer_of_the_other_kind_is_refused():
    import pytest

    from mtrain.config import ConfigError
    from mtrain.trainer.sources.partial import PartialRollout
    single = PartialRollout(None, None, TOK, DATA, None, reward)
    with pytest.raises(ConfigError, match="holds multi_turn groups; this run is single_turn"):
        single.load_state_dict({"kind": "multi_turn", "buffer": [], "next_uid": 0})
    single.load_state_dict({"buffer": [], "next_uid": 3})  # a single-turn checkpoint (no kind: written before it)
    assert single.next_uid == 3
