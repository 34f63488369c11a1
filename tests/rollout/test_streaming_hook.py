"""The streaming hook (`Request.on_tokens`, contract in protocol.py) on the CPU reference engine, through
`LocalClient` and `client.stream`: deltas arrive per decoding step from the engine's thread, concatenate to exactly
the Completion (tokens, logprobs, top logprobs; an abort too), and a request with a hook completes exactly as one
without (same seed): streaming never changes what is recorded. A consumer that stops early aborts its request."""
from __future__ import annotations

import asyncio
import dataclasses
import threading

import pytest

from mtrain.rollout import ReferenceEngine, Request, SamplingParams
from mtrain.rollout.client import RecordingClient, stream
from mtrain.rollout.protocol import Completion, TokenDelta

CONFIG = dict(model_type="llama", vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2,
              tie_word_embeddings=False)


@pytest.fixture(scope="module")
def engine():
    e = ReferenceEngine(CONFIG, init_seed=3)
    yield e
    e.shutdown()


def _req(i: int, max_new: int = 12, top: int = 0, stops=()) -> Request:
    return Request(f"s{i:02d}-", [5 + i, 7, 9, 11][: 2 + i % 3],
                   SamplingParams(max_new_tokens=max_new, temperature=1.0, seed=40 + i, top_logprobs=top,
                                  stop_token_ids=stops))


def test_deltas_concatenate_to_the_completion_and_do_not_change_it(engine):
    # the same batch twice (one generate call each), so even the last bits of the logprobs must agree
    plain = engine.generate([_req(i, top=2 * (i % 2), stops=(3,)) for i in range(5)])
    seen: dict[int, list[TokenDelta]] = {i: [] for i in range(5)}
    threads = set()

    def hook(i):
        def on(d: TokenDelta):
            threads.add(threading.current_thread().name)
            seen[i].append(d)
        return on

    hooked = engine.generate([dataclasses.replace(_req(i, top=2 * (i % 2), stops=(3,)), on_tokens=hook(i))
                              for i in range(5)])
    for i, (ref, c) in enumerate(zip(plain, hooked)):
        assert (c.output_ids, c.logprobs, c.top_logprobs, c.finish_reason) == (
            ref.output_ids, ref.logprobs, ref.top_logprobs, ref.finish_reason)
        assert all(len(d.output_ids) == 1 for d in seen[i])  # one delta per decoding step
        assert [t for d in seen[i] for t in d.output_ids] == c.output_ids
        assert [x for d in seen[i] for x in d.logprobs] == c.logprobs
        assert (c.top_logprobs is None) == all(d.top_logprobs is None for d in seen[i])
        if c.top_logprobs is not None:
            assert [r for d in seen[i] for r in d.top_logprobs] == c.top_logprobs
    assert threads == {threading.current_thread().name}  # generate() decodes on its caller's thread
    # through submit the hook runs on the engine's worker thread
    threads.clear()
    engine.submit(dataclasses.replace(_req(0), on_tokens=hook(0))).result(timeout=60)
    assert threads == {"mtrain-reference-engine"}


def test_an_abort_from_the_hook_and_a_failing_hook(engine):
    got: list[TokenDelta] = []

    def abort_after_three(d):
        got.append(d)
        if len(got) == 3:
            engine.abort("ab-")

    c = engine.submit(Request("ab-", [1, 2, 3], SamplingParams(max_new_tokens=200, seed=1),
                              on_tokens=abort_after_three)).result(timeout=60)
    assert c.finish_reason == "abort" and [d.output_ids[0] for d in got] == c.output_ids and len(c.output_ids) == 3

    def boom(d):
        raise RuntimeError("consumer bug")

    ref = engine.submit(Request("ok-", [1, 2, 3], SamplingParams(max_new_tokens=8, seed=2))).result(timeout=60)
    c = engine.submit(Request("bad-", [1, 2, 3], SamplingParams(max_new_tokens=8, seed=2),
                              on_tokens=boom)).result(timeout=60)
    assert (c.output_ids, c.logprobs, c.finish_reason) == (ref.output_ids, ref.logprobs, ref.finish_reason)


def test_client_stream_yields_deltas_then_the_completion_and_aborts_when_left(engine):
    client = RecordingClient(engine)

    async def main():
        items = [x async for x in stream(client, _req(1, max_new=10))]
        assert isinstance(items[-1], Completion) and all(isinstance(x, TokenDelta) for x in items[:-1])
        assert [t for d in items[:-1] for t in d.output_ids] == items[-1].output_ids
        gen = stream(client, Request("left-", [1, 2], SamplingParams(max_new_tokens=400, seed=3)))
        async for _ in gen:  # the consumer goes away after its first token
            break
        await gen.aclose()
        for _ in range(600):
            if len(client.log) == 2:
                break
            await asyncio.sleep(0.05)

    asyncio.run(main())
    left = client.log[-1][1]
    assert left.rid == "left-" and left.finish_reason == "abort" and len(left.output_ids) < 400
