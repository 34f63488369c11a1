"""The tail-wait fraction (`perf/tail_wait_frac`): engines' slot-time spent empty after their queue drained.

Checked against values computed by hand: on hand-built timelines (two engines), and on controlled pool runs over real
gloo ranks whose group functions take known times: a synchronous-style call (every group runs to its end) and a
quota call (partial rollout) whose unfinished groups are real reference-engine requests, aborted at the quota.
"""
from __future__ import annotations

import asyncio

import pytest

from mtrain.dist import run_on_ranks
from mtrain.rollout.pool import EngineTimeline, tail_wait_frac

CONFIG = dict(model_type="llama", vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096, initializer_range=0.2,
              tie_word_embeddings=False)


def test_hand_built_timelines():
    # Engine A: 2 slots; groups [0,1], [0,4], [1,2]; drains at 2. Engine B: 1 slot; [0,3]; drains at 3. T = 4.
    # A: from 2 to 4 one of 2 slots is busy -> 2 - 2/2 = 1.0 s empty.  B: from 3 to 4 its slot is empty -> 1.0 s.
    # (1.0 + 1.0) / (2 engines x 4 s) = 0.25
    a = EngineTimeline(slots=2, spans=[(0, 1), (0, 4), (1, 2)], drain_s=2, end_s=4)
    b = EngineTimeline(slots=1, spans=[(0, 3)], drain_s=3, end_s=3)
    assert tail_wait_frac([a, b]) == pytest.approx(0.25)
    assert tail_wait_frac([a]) == pytest.approx(1.0 / 4)
    # no tail at all: every slot busy until the end
    assert tail_wait_frac([EngineTimeline(2, [(0, 2), (0, 2)], drain_s=2, end_s=2)]) == 0.0
    # an engine that served nothing waits the whole window
    assert tail_wait_frac([EngineTimeline(1, [(0, 2)], 2, 2), EngineTimeline(1, [], 0, 0.01)]) == pytest.approx(0.5)


def _runs(rank, world):
    """Both controlled calls on one pool: one engine over both ranks (its leader runs the groups)."""
    import torch.distributed as dist

    from mtrain.rollout.groups import EngineGroups
    from mtrain.rollout.pool import RolloutPool
    from mtrain.rollout.protocol import Request, SamplingParams
    from mtrain.rollout.reference_engine import ReferenceEngine

    dist.init_process_group("gloo", rank=rank, world_size=world)
    groups = EngineGroups(world, world, world)
    engine = ReferenceEngine(CONFIG, init_seed=3, decode_delay_s=0.01) if groups.is_leader(rank) else None
    durations = [0.2, 0.8, 0.2]

    async def timed(i, client):
        await asyncio.sleep(durations[i])
        return i

    async def quota_fn(i, client):
        if i == 0:  # the one group that finishes: it meets the quota of 1 at 0.3 s
            await asyncio.sleep(0.3)
            return True, "done"
        # the others are long requests (2000 tokens at >= 10 ms each): only the abort ends them
        c = await client.generate(Request(rid=f"q-{i}-", prompt_ids=[1, 2, 3],
                                          params=SamplingParams(max_new_tokens=2000, temperature=1.0, seed=i)))
        return False, (c.finish_reason, len(c.output_ids))

    sync = RolloutPool(groups, rank, engine, max_groups_in_flight=2).run(3, timed, rid_prefix="s")
    pool = RolloutPool(groups, rank, engine, max_groups_in_flight=4, namespace="mtrain/pool-q")
    quota = pool.run(6, quota_fn, rid_prefix="q", quota=1, in_flight=3)  # 3 of 6 in flight; 3 never start
    if engine is not None:
        engine.shutdown()
    return (sync.metrics(), sync.timelines), (quota.metrics(), quota.timelines, quota.results, quota.tickets)


@pytest.fixture(scope="module")
def runs():
    return run_on_ranks(_runs, 2, timeout=120)


def test_controlled_synchronous_run(runs):
    # 2 slots, groups of 0.2, 0.8, 0.2 s: group 2 takes group 0's slot at 0.2 and ends at 0.4, when that slot finds
    # the queue empty (drain d). Group 1 ends at 0.8 = T. After the drain only group 1 runs, in 1 of 2 slots: empty
    # slot-time (T - d) / 2 of T -> (T - d) / (2 T) = 0.4 / 1.6 = 0.25. Checked on the recorded times (sleeps overrun
    # on a loaded machine), and against the nominal 0.25 when they ran on time.
    for (metrics, timelines), _ in runs:
        (t,) = timelines
        assert t.slots == 2 and len(t.spans) == 3
        g1_end = max(b for _, b in t.spans)  # the 0.8 s group
        assert t.end_s == pytest.approx(g1_end, abs=0.01)
        d, end = t.drain_s, t.end_s
        assert d >= 0.4 and end >= 0.8  # sleeps never end early (a loaded machine makes them late)
        assert metrics["perf/tail_wait_frac"] == pytest.approx((end - d) / (2 * end), abs=0.01)
        if d < 0.43 and end < 0.83:  # on time: the nominal value
            assert metrics["perf/tail_wait_frac"] == pytest.approx(0.25, abs=0.03)
        assert "time/abort_wait" not in metrics


def test_controlled_quota_run(runs):
    # 3 slots; group 0 counts at 0.3 s = the drain d (the quota stops claiming); groups 1 and 2 are aborted and come
    # back at e1, e2 (the abort's latency after d); T = max(e1, e2). After the drain: slot-time (T - d), of which
    # groups 1 and 2 fill ((e1 - d) + (e2 - d)) / 3 -> fraction ((T - d) - ((e1 - d) + (e2 - d)) / 3) / T.
    for _, (metrics, timelines, results, tickets) in runs:
        (t,) = timelines
        assert t.slots == 3 and tickets == {0: 1}
        assert results[0] == "done" and results[3:] == [None, None, None]  # never started
        assert all(r[0] == "abort" and r[1] < 2000 for r in results[1:3])
        assert t.quota_s >= 0.3 and t.drain_s == pytest.approx(t.quota_s, abs=0.01)
        d, end = t.drain_s, t.end_s
        aborted_ends = sorted(b for _, b in t.spans)[1:]  # groups 1 and 2 (group 0 ended at d)
        assert len(aborted_ends) == 2 and end == pytest.approx(max(aborted_ends), abs=0.01)
        assert end - t.quota_s < 1.0  # aborted promptly, not run to their 2000 tokens (>= 20 s)
        assert metrics["time/abort_wait"] == pytest.approx(end - t.quota_s)
        want = ((end - d) - sum(e - d for e in aborted_ends) / 3) / end
        assert metrics["perf/tail_wait_frac"] == pytest.approx(want, abs=0.01)
