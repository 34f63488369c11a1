"""Request-by-request submission (`RolloutEngine.submit`, `LocalClient`) on the CPU reference engine.

The reference for every request is the same request generated alone in one blocking `generate` call: batching
concurrent submissions must not change a single token; logprobs agree to float32 rounding (CPU BLAS picks its
blocking by batch size, so the last bits of a matmul row depend on how many rows run with it).
"""
import asyncio
import time

import pytest
import torch

from mtrain.rollout import EngineError, ReferenceEngine, Request, SamplingParams
from mtrain.rollout.client import EngineClient, LocalClient

CONFIG = dict(model_type="llama", vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2,
              tie_word_embeddings=False)


def _requests(n=12, max_new=10):
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        plen = 3 + i % 4  # several prompt lengths: the engine groups them internally
        prompt = torch.randint(0, 96, (plen,), generator=g).tolist()
        out.append(Request(f"r{i:02d}-", prompt, SamplingParams(max_new_tokens=max_new, temperature=1.0, seed=100 + i)))
    return out


@pytest.fixture(scope="module")
def engine():
    e = ReferenceEngine(CONFIG, init_seed=3)
    yield e
    e.shutdown()


def test_concurrent_submissions_equal_requests_run_alone(engine):
    reqs = _requests()
    alone = [engine.generate([r])[0] for r in reqs]
    client = LocalClient(engine)
    assert isinstance(client, EngineClient)

    async def main():
        return await asyncio.gather(*(client.generate(r) for r in reqs))

    together = asyncio.run(main())
    for a, b in zip(alone, together):
        assert (a.rid, a.output_ids, a.finish_reason) == (b.rid, b.output_ids, b.finish_reason)
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)


def test_bad_request_fails_only_its_own_future(engine):
    good, = _requests(1)
    bad = Request("bad-", [10_000], SamplingParams(max_new_tokens=4, seed=1))
    f_bad, f_good = engine.submit(bad), engine.submit(good)
    with pytest.raises(EngineError, match="outside"):
        f_bad.result(timeout=30)
    assert f_good.result(timeout=60).finish_reason in ("stop", "length")


def test_pause_holds_requests_and_abort_finishes_queued_ones(engine):
    reqs = _requests(2)
    engine.pause()
    try:
        futs = [engine.submit(r) for r in reqs]
        time.sleep(0.2)
        assert not any(f.done() for f in futs)  # held while paused
        engine.abort(reqs[0].rid)
        c = futs[0].result(timeout=5)
        assert c.finish_reason == "abort" and c.output_ids == []
    finally:
        engine.resume()
    assert futs[1].result(timeout=60).finish_reason in ("stop", "length")


def test_shutdown_fails_waiting_requests():
    e = ReferenceEngine(CONFIG, init_seed=3)
    e.pause()
    fut = e.submit(_requests(1)[0])
    e.shutdown()
    with pytest.raises(EngineError, match="shut down"):
        fut.result(timeout=5)


def test_a_caller_that_gives_up_does_not_stop_the_engine(engine):
    """asyncio.wait_for cancels the awaited future: the engine drops or discards that request and keeps serving."""
    slow, fast = _requests(2, max_new=10)
    client = LocalClient(engine)

    async def main():
        engine.pause()
        try:
            await asyncio.wait_for(client.generate(slow), timeout=0.05)
        except asyncio.TimeoutError:
            pass
        engine.resume()
        return await asyncio.wait_for(client.generate(fast), timeout=60)

    assert asyncio.run(main()).finish_reason in ("stop", "length")
