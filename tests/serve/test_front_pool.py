"""Agents through the fronts of an engine pool: 2 gloo ranks, engine.tp 1 (two engines, one front on each leader).
The pool hands GRPO groups to the leaders; each runs an `openai`-client agent n times against its own front;
every rank gets every group's recorded trajectories back, and they become the trainer's batch."""
from __future__ import annotations

from mtrain.dist import run_on_ranks

N_GROUPS, N = 6, 3


def _agent_rollout(rank, world):
    import torch.distributed as dist
    from openai import AsyncOpenAI

    from front_fixtures import MODEL, chatml_tokenizer, tiny_config
    from mtrain.serve.openai_agent import FrontRegistry, agent_group_fn
    from mtrain.rollout.groups import EngineGroups
    from mtrain.rollout.pool import RolloutPool
    from mtrain.rollout.reference_engine import ReferenceEngine
    from mtrain.serve.front import OpenAIFront
    from mtrain.serve.server import FrontServer

    dist.init_process_group("gloo", rank=rank, world_size=world)
    tok = chatml_tokenizer()
    groups = EngineGroups(world, 1, world)
    engine = ReferenceEngine(tiny_config(len(tok)), init_seed=3)
    pool = RolloutPool(groups, rank, engine, max_groups_in_flight=2)
    fronts = FrontRegistry(lambda client: FrontServer(OpenAIFront(client, tok, model_name=MODEL,
                                                                  max_positions=512)))

    async def agent(base_url, api_key, sample):  # an ordinary two-turn chat agent
        c = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        m = [{"role": "user", "content": sample["q"]}]
        for turn in range(2):
            r = await c.chat.completions.create(model=MODEL, messages=m, max_tokens=6)
            m += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": f"again {turn}"}]
        await c.close()
        return float(len(m[-2]["content"] or "") % 2)

    samples = [{"q": f"question {i}"} for i in range(N_GROUPS)]
    run = pool.run(N_GROUPS, agent_group_fn(fronts, agent, samples, N, rid_prefix="agents"), rid_prefix="agents")
    fronts.stop()
    engine.shutdown()
    out = []
    for i, trajs in enumerate(run.results):
        for t in trajs:
            out.append((i, t.tokens, t.loss_mask, t.reward, [s.kind for s in t.segments], t.messages[0]["content"],
                        [tok.decode([x for x in s.ids if x != tok.eos_token_id], skip_special_tokens=True)
                         for s in t.segments if s.kind == "model"],
                        [m.get("content") or "" for m in t.messages if m["role"] == "assistant"],
                        t.metrics["session/calls"]))
    from mtrain.rollout.trajectory import to_batch
    batch = to_batch([t for trajs in run.results for t in trajs], pad_id=tok.pad_token_id)
    return out, run.served, batch.size, float(batch.response_mask.sum()), sum(sum(x[2]) for x in out)


def test_agents_through_each_leaders_front():
    ranks = run_on_ranks(_agent_rollout, 2, timeout=240)
    out, served, size, masked, model_tokens = ranks[0]
    assert ranks[1][0] == out  # every rank got every group's trajectories
    assert sum(served) == N_GROUPS and len(out) == N_GROUPS * N and size == N_GROUPS * N
    assert masked == model_tokens  # the batch trains exactly the recorded model tokens
    for i, tokens, mask, reward, kinds, first, spoken, replied, calls in out:
        assert first == f"question {i}"  # no session got another group's conversation
        assert kinds == ["prompt", "model", "env", "model"] and calls == 2.0
        assert spoken == replied  # each recorded model turn decodes to what the agent was sent
        assert reward in (0.0, 1.0)
