"""Tool calls out of the model's text: SGLang's function-call parsers where SGLang imports, ours elsewhere.

Our parsers reproduce SGLang 0.5.17's `FunctionCallParser(tools, name).parse_non_stream(text)` for the formats
the chat templates here use, on the same strings (tests/rollout/tool_call_corpus/: SGLang's own answers recorded
from its code, checked against ours in CI):
- "qwen25" (alias "qwen"): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one block per call;
  a block that is not JSON is skipped, the others still count.
- "hermes": `<tool_call>{json}</tool_call>`, newlines optional, a last unclosed block accepted; ONE block that is
  not JSON makes SGLang drop every call of the turn (and keep the whole text as normal text): mirrored.
Both: calls naming a tool not in the schema list are dropped; `arguments` (or `parameters`) is re-serialised with
json.dumps(ensure_ascii=False). normal_text is the text before the first `<tool_call>`, stripped.

Beyond SGLang we report what was dropped (`malformed`: the raw blocks and why), so the rollout can tell the
model its call was not understood and count the valid-call rate. One deliberate difference: a block holding
JSON that is not an object (e.g. `[1]`) makes SGLang raise; we drop that block as malformed instead.

Model output is hostile input: a parse takes time linear in the text (blocks are found with `str.find`, never a
regex that rescans the rest of the text from every unclosed `<tool_call>`), and JSON nested deeper than
`MAX_JSON_DEPTH` or an integer beyond Python's 4,300-digit limit is a malformed block, never an exception out of
the parse. SGLang's parser is asked only about texts whose every `<tool_call>` is closed (its regexes rescan).
"""
from __future__ import annotations

import importlib
import json
import logging
import re
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

PARSERS = ("qwen25", "qwen", "hermes")
MAX_JSON_DEPTH = 64  # nesting of a tool call's JSON ([ and {); deeper is malformed (json.loads would recurse)
_STRUCTURE = re.compile(r'[\[\]{}"\\]')


def json_too_deep(raw: str, limit: int = MAX_JSON_DEPTH) -> bool:
    """Does `raw` nest [ and { (outside strings) deeper than `limit`? One pass over its structural characters."""
    depth, in_string, skip = 0, False, -1
    for m in _STRUCTURE.finditer(raw):
        i, c = m.start(), m.group()
        if i == skip:  # the character right after a backslash inside a string
            continue
        if in_string:
            if c == "\\":
                skip = i + 1
            elif c == '"':
                in_string = False
            continue
        if c == '"':
            in_string = True
        elif c in "[{":
            depth += 1
            if depth > limit:
                return True
        elif c in "]}":
            depth -= 1
    return False


def load_json(raw: str) -> tuple[Any, str | None]:
    """(value, None), or (None, why) for text that is not JSON a tool call may carry: invalid, nested deeper than
    MAX_JSON_DEPTH, or holding an integer past Python's digit limit. Never raises."""
    if json_too_deep(raw):
        return None, f"invalid JSON: nested deeper than {MAX_JSON_DEPTH} levels"
    try:
        return json.loads(raw), None
    except (ValueError, RecursionError) as e:  # JSONDecodeError is a ValueError; so is the integer digit limit
        return None, f"invalid JSON: {e}"


_SURROGATE = re.compile(r"[\ud800-\udfff]")


def valid_unicode(json_text: str) -> str:
    """`json_text` with every lone surrogate written as its JSON escape: the same JSON value, and text that UTF-8
    can encode. Model output's JSON may write "\\ud800", which `json.loads` decodes to a lone surrogate; dumped
    back as it is, it made every later encode fail (the front's JSON response, the tokenizer, a log file)."""
    return _SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", json_text)


def _dumps(value: Any) -> str:
    return valid_unicode(json.dumps(value, ensure_ascii=False))


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON string (as SGLang's ToolCallItem.parameters)


@dataclass
class ParseResult:
    normal_text: str
    calls: list[ToolCall]
    malformed: list[tuple[str, str]] = field(default_factory=list)  # (raw block, reason)

    @property
    def attempted(self) -> int:
        return len(self.calls) + len(self.malformed)


class _WouldRaise(Exception):
    """SGLang's parse_base_json raises here (an element that is not a JSON object)."""


def _base_json(action: Any, names: set[str]) -> tuple[list[ToolCall], list[tuple[str, str]]]:
    """SGLang's BaseFormatDetector.parse_base_json, with what it drops reported."""
    calls, bad = [], []
    for act in action if isinstance(action, list) else [action]:
        if not isinstance(act, dict):
            raise _WouldRaise(_dumps(act)[:200])
        name = act.get("name")
        if not (isinstance(name, str) and name and name in names):
            bad.append((_dumps(act), f"unknown tool {name!r}"[:200]))
            continue
        calls.append(ToolCall(name, _dumps(act.get("parameters") or act.get("arguments", {}))))
    return calls, bad


class _Qwen25:
    bot, eot = "<tool_call>\n", "\n</tool_call>"

    def blocks(self, text: str) -> tuple[list[str], bool]:
        """The text of each closed block (a `bot` to the first `eot` after it, as a lazy regex would give) and
        whether a `bot` is left unclosed; linear time."""
        out, pos = [], 0
        while (start := text.find(self.bot, pos)) != -1:
            end = text.find(self.eot, start + len(self.bot))
            if end == -1:
                return out, True
            out.append(text[start + len(self.bot):end])
            pos = end + len(self.eot)
        return out, False

    def parse(self, text: str, names: set[str]) -> ParseResult:
        idx = text.find(self.bot)
        if idx == -1:
            # SGLang ignores a "<tool_call>" not followed by a newline; we report it as a malformed attempt
            bad = [(text[text.find("<tool_call>"):], "expected '<tool_call>' then a newline")] \
                if "<tool_call>" in text else []
            return ParseResult(text, [], bad)
        calls, bad = [], []
        blocks, _ = self.blocks(text)
        for raw in blocks:
            parsed, why = load_json(raw.strip())
            if why is not None:
                bad.append((raw, why))
                continue
            try:
                c, b = _base_json(parsed, names)
            except _WouldRaise as e:  # SGLang raises out of the whole parse; we drop this block only
                bad.append((raw, f"not a JSON object: {e}"))
                continue
            calls += c
            bad += b
        unclosed = text.count(self.bot) - len(blocks)
        if unclosed > 0:
            bad.append((text[text.rfind(self.bot):], "unclosed <tool_call> (expected '\\n</tool_call>')"))
        return ParseResult(text[:idx].strip(), calls, bad)


class _Hermes:
    bot, eot = "<tool_call>", "</tool_call>"

    def blocks(self, text: str) -> tuple[list[str], bool]:
        """Each block's text (to the first `eot` after its `bot`; a last unclosed one runs to the end of the text)
        and whether the last is unclosed; linear time."""
        out, pos = [], 0
        while (start := text.find(self.bot, pos)) != -1:
            end = text.find(self.eot, start + len(self.bot))
            if end == -1:
                out.append(text[start + len(self.bot):])
                return out, True
            out.append(text[start + len(self.bot):end])
            pos = end + len(self.eot)
        return out, False

    def parse(self, text: str, names: set[str]) -> ParseResult:
        idx = text.find(self.bot)
        if idx == -1:
            return ParseResult(text, [])
        calls, bad = [], []
        for raw in self.blocks(text)[0]:
            if not raw:
                continue
            parsed, why = load_json(raw.strip())
            if why is None:
                try:
                    c, b = _base_json(parsed, names)
                    calls += c
                    bad += b
                    continue
                except _WouldRaise as e:
                    why = f"not a JSON object: {e}"
            # SGLang catches any error here: the turn has no calls and all of it is normal text
            return ParseResult(text, [], bad + [(raw, why)] + [(c.name, "dropped with an invalid block of the "
                                                                 "same turn") for c in calls])
        return ParseResult(text[:idx].strip(), calls, bad)


_OURS = {"qwen25": _Qwen25, "qwen": _Qwen25, "hermes": _Hermes}


def sglang_parser_available() -> bool:
    try:
        importlib.import_module("sglang.srt.function_call.function_call_parser")
        return True
    except Exception:  # noqa: BLE001 - not installed, or needs a GPU stack this machine lacks
        return False


class ToolCallParser:
    """parse(text) -> ParseResult for a fixed list of tool schemas (OpenAI function format).

    backend: "auto" (SGLang's parser when it imports, else ours), "sglang" (error when it does not import), or
    "mtrain" (ours). With SGLang, calls and normal text are SGLang's; `malformed` always comes from ours.
    """

    def __init__(self, name: str, schemas: list[dict[str, Any]], backend: str = "auto"):
        if name not in _OURS:
            raise ValueError(f"tool-call parser {name!r} is not supported; choose one of {PARSERS}")
        if backend not in ("auto", "sglang", "mtrain"):
            raise ValueError(f"tool-call parser backend must be auto, sglang or mtrain, got {backend!r}")
        self.name = name
        self.names = {s["function"]["name"] for s in schemas}
        self._ours = _OURS[name]()
        self._sglang = None
        if backend == "sglang" or (backend == "auto" and sglang_parser_available()):
            from sglang.srt.entrypoints.openai.protocol import Tool
            from sglang.srt.function_call.function_call_parser import FunctionCallParser
            self._sglang = FunctionCallParser([Tool(**s) for s in schemas], name)
        self.backend = "sglang" if self._sglang is not None else "mtrain"

    @property
    def start_marker(self) -> str:
        """The text a tool call starts with (`<tool_call>\\n` / `<tool_call>`): normal text is what comes before the
        first one, so a streaming front may send text as content only up to where this could begin."""
        return self._ours.bot

    def parse(self, text: str) -> ParseResult:
        ours = self._ours.parse(text, self.names)
        if self._sglang is None or self._ours.blocks(text)[1]:  # unclosed: SGLang's regex would be quadratic
            return ours
        try:
            normal, items = self._sglang.parse_non_stream(text)
        except Exception as e:  # noqa: BLE001 - SGLang raises on non-object JSON; ours treats it as malformed
            log.debug("SGLang's %s parser raised %s; using ours for this text", self.name, e)
            return ours
        return ParseResult(normal, [ToolCall(i.name, valid_unicode(i.parameters)) for i in items], ours.malformed)
