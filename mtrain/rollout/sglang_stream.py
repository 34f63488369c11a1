"""SGLang's streamed outputs (`async_generate(..., stream=True)`) as TokenDeltas, and the final output they make.

What SGLang 0.5.17 sends (sglang/srt/, TM = managers/tokenizer_manager.py; /work/shared/SGLANG-APIS.md §1, §2, §6):
- `async_generate(stream=True)` returns an async generator of output dicts (entrypoints/engine.py:535-538);
- chunks are cumulative unless the server runs with `incremental_streaming_output` (TM:2368-2395; the deltas mode
  slices the logprob lists, TM:289-299; server_args.py:1425): we rely on the default, cumulative mode, and
  engine_server_args refuses the other;
- an intermediate chunk holds the *live* lists of the request's state (`output_ids` TM:2393, and meta_info's
  `output_token_logprobs`, TM:2509), which grow after we return to the loop: copy what we keep, at once;
- `meta_info["output_token_logprobs"]` is the cumulative list of `(logprob, token_id, text)` per output token
  (TM:2499-2510), `output_top_logprobs` per position its alternatives (SGLANG-APIS §6);
- a request aborted while queued or retracted ends with a chunk whose `output_ids` is only `[output_ids[-1]]`
  (TM:3183-3184), while its meta_info logprobs are still cumulative (TM:3171-3181 calls add_logprob_to_meta_info).
So the tokens are read from the cumulative logprob entries (ids and logprobs together, the same in every chunk
shape), never from `output_ids`; the final output is the last chunk's meta_info with the ids gathered so far, which
is exactly what a non-streamed call returns (its `output_ids` equal the entries' ids: completion_from_output checks
it), so the Completion does not depend on streaming.
"""
from __future__ import annotations

from typing import Any, Mapping

from mtrain.rollout.protocol import EngineError, Request, TokenDelta


def top_row(row: Any, k: int) -> list[tuple[int, float]]:
    """One position's `output_top_logprobs` entry, (logprob, token_id, text) tuples, as the protocol's k most likely
    (token, logprob) pairs, most likely first."""
    return sorted(((int(e[1]), float(e[0])) for e in row), key=lambda p: -p[1])[:k]


class StreamAssembler:
    """Feed every chunk of one request's stream; `feed` returns the new tokens (None when a chunk adds none), and
    `output()` the final output dict for `completion_from_output`."""

    def __init__(self, request: Request):
        self.request = request
        self.ids: list[int] = []
        # our own copies, extended by each chunk's new tail only: copying the whole cumulative lists at every chunk
        # would cost O(n^2) over an n-token stream
        self.entries: list[Any] = []
        self.tops: list[Any] = []
        self.last: Mapping[str, Any] | None = None

    def feed(self, chunk: Mapping[str, Any]) -> TokenDelta | None:
        meta = chunk.get("meta_info") or {}
        live = meta.get("output_token_logprobs") or []  # the live list: it grows after this returns
        new = list(live[len(self.ids):])
        # the chunk as it is now: its meta_info shallow-copied, of output_ids only the last id (what output() checks)
        self.last = {**chunk, "output_ids": list((chunk.get("output_ids") or [])[-1:]), "meta_info": dict(meta)}
        if not new:
            return None
        ids = [int(e[1]) for e in new]
        tops = None
        k = self.request.params.top_logprobs
        if k:
            rows = list((meta.get("output_top_logprobs") or [])[len(self.ids):len(self.ids) + len(new)])
            if len(rows) != len(new) or any(r is None or len(r) < k for r in rows):
                raise EngineError(f"request {self.request.rid!r}: a stream chunk has {len(new)} new tokens but "
                                  f"{len(rows)} top-logprob rows (or a row with fewer than {k})")
            tops = [top_row(r, k) for r in rows]
            self.tops += rows
        self.ids += ids
        self.entries += new
        return TokenDelta(ids, [float(e[0]) for e in new], tops)

    def _meta(self) -> dict[str, Any]:
        """The last chunk's meta_info with the logprob lists as streamed (our copies, not the live lists)."""
        meta = {**(self.last.get("meta_info") or {}), "output_token_logprobs": list(self.entries)}
        if self.request.params.top_logprobs:
            meta["output_top_logprobs"] = list(self.tops)
        return meta

    def output(self, aborted: bool = False) -> Mapping[str, Any] | None:
        """The last chunk with `output_ids` = every token streamed (None: the stream sent nothing). aborted: the
        stream ended by an abort error rather than a finished chunk (the tokens passed on stay the output)."""
        if self.last is None:
            return None
        if aborted:
            return {**self.last, "output_ids": list(self.ids),
                    "meta_info": {**self._meta(), "finish_reason": {"type": "abort"}}}
        got = list(self.last.get("output_ids") or [])
        if got and self.ids and int(got[-1]) != self.ids[-1]:  # cumulative, or the abort chunk's [last id]
            raise EngineError(f"request {self.request.rid!r}: SGLang's last stream chunk ends with token {got[-1]}, "
                              f"its logprobs with {self.ids[-1]}")
        return {**self.last, "output_ids": list(self.ids), "meta_info": self._meta()}
