"""SGLang's stream chunks -> TokenDeltas (mtrain/rollout/sglang_stream.py), on chunks shaped as SGLang 0.5.17's
tokenizer manager builds them (cumulative mode; TM = sglang/srt/managers/tokenizer_manager.py):
- intermediate chunks hold the request state's *live* lists (TM:2393, TM:2509): they keep growing after the chunk
  is handed out, as the simulation below does;
- chunks can add several tokens (queued outputs are coalesced to the latest, TM:1705) or none;
- a finished chunk holds copies (TM:2388), an abort chunk of a queued/retracted request only the last id (TM:3184)
  with cumulative logprobs. The reference is the non-streamed output of the same tokens."""
from __future__ import annotations

import pytest

from mtrain.rollout.protocol import EngineError, Request, SamplingParams
from mtrain.rollout.sglang_stream import StreamAssembler
from mtrain.rollout.sglang_wire import completion_from_output, engine_server_args

TOKENS = [11, 12, 13, 14, 15, 16]
LPS = [-0.5, -1.0, -0.25, -2.0, -0.75, -1.5]


def _tops(t: int) -> list:
    return [(-3.0, t + 100, None), (-0.1, t, None), (-2.0, t + 200, None)]


class _State:
    """What TM keeps per request and hands out by reference in a streamed chunk."""

    def __init__(self):
        self.output_ids, self.logprobs, self.tops = [], [], []

    def step(self, k: int) -> None:
        for _ in range(k):
            i = len(self.output_ids)
            self.output_ids.append(TOKENS[i])
            self.logprobs.append((LPS[i], TOKENS[i], None))
            self.tops.append(_tops(TOKENS[i]))

    def chunk(self, finish=None, *, abort_shape=False) -> dict:
        ids = self.output_ids
        if finish is not None:
            ids = [ids[-1]] if abort_shape else list(ids)
        return {"output_ids": ids, "meta_info": {"id": "x", "finish_reason": finish, "weight_version": "3",
                                                 "output_token_logprobs": self.logprobs,
                                                 "output_top_logprobs": self.tops}}


def _non_streamed(n: int, finish: dict) -> dict:
    return {"output_ids": TOKENS[:n], "meta_info": {
        "id": "x", "finish_reason": finish, "weight_version": "3",
        "output_token_logprobs": [(LPS[i], TOKENS[i], None) for i in range(n)],
        "output_top_logprobs": [_tops(TOKENS[i]) for i in range(n)]}}


@pytest.mark.parametrize("finish,abort_shape", [({"type": "length"}, False), ({"type": "stop", "matched": 16}, False),
                                                ({"type": "abort", "message": "Aborted"}, True)])
@pytest.mark.parametrize("top", [0, 2])
def test_chunks_become_deltas_and_the_same_completion(finish, abort_shape, top):
    req = Request("r-0-", [1, 2], SamplingParams(max_new_tokens=6, top_logprobs=top))
    state, asm, deltas = _State(), StreamAssembler(req), []
    for k in (1, 0, 2, 1, 1):  # tokens each chunk adds (0: a chunk with nothing new)
        state.step(k)
        deltas.append(asm.feed(state.chunk()))
        state.step(0)
    state.step(1)  # the token of the last step arrives with the finished chunk
    deltas.append(asm.feed(state.chunk(finish, abort_shape=abort_shape)))
    got = [d for d in deltas if d is not None]
    assert deltas[1] is None and [len(d.output_ids) for d in got] == [1, 2, 1, 1, 1]
    assert [t for d in got for t in d.output_ids] == TOKENS
    assert [x for d in got for x in d.logprobs] == LPS
    want = completion_from_output(req, _non_streamed(6, finish), 0)
    assert completion_from_output(req, asm.output(), 0) == want
    if top:
        assert [r for d in got for r in d.top_logprobs] == want.top_logprobs
        assert want.top_logprobs[0] == [(11, -0.1), (211, -2.0)]
    else:
        assert all(d.top_logprobs is None for d in got)


def test_live_lists_growing_after_a_chunk_do_not_leak_into_it():
    req = Request("r-0-", [1], SamplingParams(max_new_tokens=6))
    state, asm = _State(), StreamAssembler(req)
    state.step(2)
    d = asm.feed(state.chunk())
    state.step(3)  # the live lists grow before the next chunk: the first delta and the kept state must not change
    assert d.output_ids == [11, 12] and asm.output()["meta_info"]["output_token_logprobs"] == state.logprobs[:2]
    assert asm.output()["output_ids"] == [11, 12]
    assert asm.feed(state.chunk()).output_ids == [13, 14, 15]


def test_an_abort_error_after_some_chunks_keeps_the_streamed_tokens():
    req = Request("r-0-", [1], SamplingParams(max_new_tokens=6))
    state, asm = _State(), StreamAssembler(req)
    state.step(3)
    asm.feed(state.chunk())
    c = completion_from_output(req, asm.output(aborted=True), 0)
    assert (c.output_ids, c.logprobs, c.finish_reason) == (TOKENS[:3], LPS[:3], "abort")
    assert StreamAssembler(req).output() is None  # nothing streamed: the engine's usual empty abort


def test_inconsistent_chunks_are_refused():
    req = Request("r-0-", [1], SamplingParams(max_new_tokens=6, top_logprobs=2))
    state, asm = _State(), StreamAssembler(req)
    state.step(2)
    bad = state.chunk()
    bad["meta_info"]["output_top_logprobs"] = bad["meta_info"]["output_top_logprobs"][:1]
    with pytest.raises(EngineError, match="2 new tokens but 1 top-logprob rows"):
        asm.feed(bad)
    asm = StreamAssembler(Request("r-1-", [1], SamplingParams(max_new_tokens=6)))
    asm.feed(state.chunk())
    last = state.chunk({"type": "length"})
    last["output_ids"] = [99]
    asm.feed(last)
    with pytest.raises(EngineError, match="ends with token 99"):
        asm.output()


def test_incremental_streaming_output_is_refused():
    with pytest.raises(EngineError, match="incremental_streaming_output"):
        engine_server_args("m", tp_size=1, mem_fraction_static=0.5, base_gpu_id=0, load_format="auto",
                           random_seed=0, extra={"incremental_streaming_output": True})
