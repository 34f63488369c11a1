"""Incremental text of one streamed choice: which characters are final as tokens arrive.

A streamed choice must never show text that the finished (non-streamed) choice would not have, since a streamed
character cannot be taken back. `ChoiceStream.push(ids)` takes the engine's new tokens and returns the text that is
now final plus how many of the tokens belong to the choice (their logprobs go out with the text). Held back:
- an incomplete character: a window decode that ends in U+FFFD (a UTF-8 sequence or a multi-token character
  split across tokens) waits for the next token (the usual incremental detokenizer: decode a few tokens of context
  plus the new ones and take the difference, so the whole text is never decoded again);
- any tail that could still become a `stop` string (the longest suffix that is a proper prefix of one); once a stop
  string is complete the text before it is final, and later tokens are not part of the choice (the front's `_cut`
  keeps the ids up to the token that completed it, with the same rule);
- with tools: everything from the parser's tool-call start marker on (tool calls go out as `tool_calls` deltas at
  the end, never as content), a tail that could still become the marker, and trailing whitespace (content before
  a call is stripped by the parsers).
`finish(final)` returns what is left of the finished choice's text after what was streamed.
"""
from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)

CONTEXT_TOKENS = 5  # tokens decoded before the new ones, so a tokenizer's leading-space handling sees its context


def _held_prefix(text: str, words: list[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `words`."""
    best = 0
    for w in words:
        for k in range(min(len(w) - 1, len(text)), best, -1):
            if text.endswith(w[:k]):
                best = k
                break
    return best


class ChoiceStream:
    """tokenizer: decodes ids (skip_special_tokens, as the returned text). stops: stop strings. eos_ids: the engine's
    stop token ids (never part of the text). tool_marker: where tool calls begin (None: no tools)."""

    def __init__(self, tokenizer, stops: list[str], eos_ids: tuple[int, ...], tool_marker: str | None = None):
        self.tokenizer = tokenizer
        self.stops, self.eos = list(stops or ()), set(eos_ids)
        self.marker = tool_marker
        self.body: list[int] = []  # text tokens so far (stop token excluded)
        self.text = ""  # their decoded text, final characters only (cut before a completed stop string)
        self._prefix, self._read = 0, 0  # incremental decoding window: body[_prefix:_read] is already in text
        self.sent = 0  # characters of `text` streamed
        self.done = False  # a stop string completed: nothing after it belongs to the choice
        self.content_closed = False  # the tool-call marker appeared: no more content streams

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def push(self, ids: list[int]) -> tuple[str, int]:
        """(text now final, how many of `ids` belong to the choice)."""
        taken = 0
        for t in ids:
            if self.done:
                break
            taken += 1
            if t in self.eos:  # the engine's stop token: kept in the ids, never in the text (it is the last one)
                continue
            self.body.append(t)
            before = self._decode(self.body[self._prefix:self._read])
            now = self._decode(self.body[self._prefix:])
            if len(now) <= len(before) or now.endswith("\ufffd"):
                continue  # an incomplete character: wait for the token that completes it
            old = len(self.text)
            self.text += now[len(before):]
            self._prefix, self._read = max(self._read - CONTEXT_TOKENS, 0), len(self.body)
            if self.stops:
                start = max(0, old - max(len(s) for s in self.stops) + 1)
                hits = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
                if hits:
                    self.text = self.text[:min(hits)]
                    self.done = True
        return self._release(), taken

    def _release(self) -> str:
        end = len(self.text)
        if not self.done:
            end -= _held_prefix(self.text, self.stops)
        if self.marker is not None:
            at = self.text.find(self.marker, max(0, self.sent - len(self.marker)))
            if at >= 0:
                self.content_closed = True
            if self.content_closed:
                end = min(end, at if at >= 0 else self.sent)
            else:
                end -= _held_prefix(self.text[:end], [self.marker])
            end = len(self.text[:end].rstrip())
        if end <= self.sent:
            return ""
        piece, self.sent = self.text[self.sent:end], end
        return piece

    def finish(self, final: str | None) -> str:
        """The rest of the finished choice's text (`final`: its content or text) after what was streamed."""
        final = final or ""
        streamed = self.text[:self.sent]
        if final.startswith(streamed):
            return final[len(streamed):]
        # Cannot happen with the rules above unless a tokenizer decodes a window differently from the whole text;
        # the client already has `streamed`, so the difference is logged, not sent twice.
        log.warning("streamed text %r is not a prefix of the finished choice's text %r", streamed[-40:], final[:80])
        return ""


def token_entry(tokenizer, token: int, logprob: float, top: list[tuple[int, float]] | None) -> dict[str, Any]:
    """One token of a chat `logprobs.content` list (OpenAI's shape: token text, logprob, UTF-8 bytes, top ones)."""
    def one(t: int, lp: float) -> dict[str, Any]:
        s = tokenizer.decode([t], skip_special_tokens=False)
        return {"token": s, "logprob": float(lp), "bytes": list(s.encode("utf-8"))}
    return {**one(token, logprob), "top_logprobs": [one(a, alp) for a, alp in (top or [])]}


def legacy_top(tokenizer, top: list[tuple[int, float]]) -> dict[str, float]:
    """The completions API's {token text: logprob} of one token's most likely alternatives. Two ids can decode to the
    same text; the more likely one is kept, as a dict can hold one."""
    d: dict[str, float] = {}
    for t, lp in top:
        d.setdefault(tokenizer.decode([t], skip_special_tokens=False), float(lp))
    return d
