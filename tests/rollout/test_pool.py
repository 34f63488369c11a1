"""The rollout pool over real gloo ranks with real reference engines (no Megatron: the pool alone).

4 ranks, engine.tp in {1, 2, 4}: 4, 2 or 1 engines share one queue of GRPO groups through torchrun's c10d store.
Checked: a seeded rollout gives the same tokens whichever engines serve it; every group is served exactly once; a
slowed engine serves fewer groups and the step completes; an engine that dies mid-rollout ends the call on every
rank with one clear error within seconds.
"""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

from mtrain.dist import run_on_ranks

CONFIG = dict(model_type="llama", vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2,
              tie_word_embeddings=False)
N_GROUPS, N = 8, 3


def _setup(rank, world, tp, delay_rank=None, delay_s=0.0):
    import torch.distributed as dist

    from mtrain.rollout.groups import EngineGroups
    from mtrain.rollout.pool import RolloutPool
    from mtrain.rollout.reference_engine import ReferenceEngine

    dist.init_process_group("gloo", rank=rank, world_size=world)
    groups = EngineGroups(world, tp, world)
    engine = None
    if groups.is_leader(rank):
        engine = ReferenceEngine(CONFIG, init_seed=7, decode_delay_s=delay_s if rank == delay_rank else 0.0)
    return RolloutPool(groups, rank, engine, max_groups_in_flight=2), engine


def _group_fn(max_new=8):
    from mtrain.rollout.protocol import SamplingParams
    from mtrain.trainer.generation.rollouts import group_requests

    params = SamplingParams(max_new_tokens=max_new, temperature=1.0)

    async def fn(i, client):
        prompt = [(5 * i + k) % 96 for k in range(3 + i % 3)]
        reqs = group_requests(prompt, i, N, params, base_seed=1000, rid_prefix="t", width=2)
        comps = await asyncio.gather(*(client.generate(r) for r in reqs))
        if any(c.finish_reason == "abort" for c in comps):
            raise RuntimeError(f"group {i} aborted")
        return [(c.rid, c.output_ids, c.logprobs) for c in comps]
    return fn


def _rollout(rank, world, tp, delay_s=0.0):
    pool, engine = _setup(rank, world, tp, delay_rank=2, delay_s=delay_s)
    run = pool.run(N_GROUPS, _group_fn(), rid_prefix="t")
    run2 = pool.run(N_GROUPS, _group_fn(), rid_prefix="t")  # a second call on the same pool (fresh store keys)
    if engine is not None:
        engine.shutdown()
    tokens = [[(rid, ids) for rid, ids, _ in g] for g in run.results]  # logprobs: last bits vary with batching
    return run.results, run.served, tokens == [[(rid, ids) for rid, ids, _ in g] for g in run2.results], run.metrics()


@pytest.fixture(scope="module")
def by_engine_count():
    """engine.tp 4 (one engine), 1 (four engines), 2 (two engines, the one led by rank 2 decoding 30 ms a token)."""
    return {tp: run_on_ranks(_rollout, 4, tp, 0.03 if tp == 2 else 0.0, timeout=300) for tp in (4, 1, 2)}


def test_same_tokens_with_1_2_4_engines(by_engine_count):
    ref = by_engine_count[4][0][0]  # one engine serves everything
    assert len(ref) == N_GROUPS and all(len(g) == N for g in ref)
    for tp, ranks in by_engine_count.items():
        for results, served, repeat_equal, _ in ranks:
            assert results == ranks[0][0] and repeat_equal  # every rank gets every group, in index order; a repeat
            # call samples the same tokens
            assert sum(served) == N_GROUPS and len(served) == 4 // tp
            for got, want in zip(results, ref):
                for (rid, ids, lps), (rid0, ids0, lps0) in zip(got, want):
                    assert (rid, ids) == (rid0, ids0), (tp, rid)
                    assert max(abs(a - b) for a, b in zip(lps, lps0)) <= 1e-5
    # with 4 engines, more than one engine really served groups
    assert sum(1 for s in by_engine_count[1][0][1] if s) > 1


def test_slow_engine_serves_fewer_groups(by_engine_count):
    _, served, _, metrics = by_engine_count[2][0]
    assert sum(served) == N_GROUPS
    assert served[1] < served[0], served  # engine 1 (leader rank 2) decodes 30 ms per token
    assert metrics["rollout/engines"] == float(sum(1 for s in served if s))
    assert metrics["rollout/groups_per_engine_min"] == min(served)
    assert metrics["rollout/groups_per_engine_max"] == max(served)


def _dies(rank, world):
    pool, engine = _setup(rank, world, 1, delay_rank=None)
    if rank == 3:  # this engine is shut down under its running requests after a moment
        threading.Timer(0.5, engine.shutdown).start()
    t0 = time.monotonic()
    try:
        pool.run(32, _group_fn(max_new=40), rid_prefix="d")
    except Exception as e:  # the cause itself (here the group function's error), with where it happened
        out = (f"{type(e).__name__}: {e} | {' '.join(getattr(e, '__notes__', []))}", time.monotonic() - t0)
    else:
        out = ("no error", time.monotonic() - t0)
    if engine is not None and rank != 3:
        engine.shutdown()
    return out


def test_engine_failure_stops_every_rank_quickly():
    outs = run_on_ranks(_dies, 4, timeout=120)
    for msg, seconds in outs:
        assert "engine 3 (rank 3) failed" in msg and ("aborted" in msg or "shut down" in msg), msg
        assert seconds < 30, seconds
    assert len({m for m, _ in outs}) == 1  # the same message on every rank
