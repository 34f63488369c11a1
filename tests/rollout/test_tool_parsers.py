"""Tool-call parsing agrees with SGLang's own parsers on a recorded corpus (well-formed and malformed calls).

corpus.json holds SGLang 0.5.17's `FunctionCallParser.parse_non_stream` answers, recorded from SGLang's code by
tool_call_corpus/record_with_sglang.py. Where SGLang is importable (the GPU box) the live parser is compared too.
"""
import json
from pathlib import Path

import pytest

from mtrain.tools.parsers import ToolCallParser, sglang_parser_available

CORPUS = json.loads((Path(__file__).parent / "tool_call_corpus" / "corpus.json").read_text())
CASES = [(e, p) for e in CORPUS["entries"] for p in e["sglang"]]


@pytest.mark.parametrize("entry,parser_name", CASES, ids=[f"{p}-{i // 2}" for i, (_, p) in enumerate(CASES)])
def test_ours_equal_sglangs_recorded_answer(entry, parser_name):
    want = entry["sglang"][parser_name]
    got = ToolCallParser(parser_name, CORPUS["schemas"], backend="mtrain").parse(entry["text"])
    if "raises" in want:  # SGLang raises (non-object JSON in a block): ours keeps going and calls it malformed
        assert got.malformed, entry["text"]
        return
    assert got.normal_text == want["normal_text"]
    assert [[c.name, c.arguments] for c in got.calls] == want["calls"]


def test_the_corpus_covers_malformed_and_multi_call_strings():
    qwen = [e["sglang"]["qwen25"] for e in CORPUS["entries"]]
    assert sum(len(r.get("calls", [])) >= 2 for r in qwen) >= 2  # parallel calls in one turn
    assert sum(len(r.get("calls", [])) == 0 and "<tool_call>" in e["text"]
               for r, e in zip(qwen, CORPUS["entries"])) >= 10  # attempts SGLang drops
    assert any("raises" in e["sglang"]["hermes"] or "raises" in e["sglang"]["qwen25"] for e in CORPUS["entries"])


def test_malformed_attempts_are_reported():
    p = ToolCallParser("qwen25", CORPUS["schemas"], backend="mtrain")
    r = p.parse('<tool_call>\n{"name": "calculator", "arguments": {"expression": "1"}}\n</tool_call>\n'
                '<tool_call>\n{broken\n</tool_call>\n<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>')
    assert [c.name for c in r.calls] == ["calculator"] and r.attempted == 3
    assert [why.split(":")[0] for _, why in r.malformed] == ["invalid JSON", "unknown tool 'nope'"]
    assert ToolCallParser("qwen25", CORPUS["schemas"], backend="mtrain").parse("<tool_call>{}").attempted == 1
    with pytest.raises(ValueError, match="not supported"):
        ToolCallParser("llama4", CORPUS["schemas"])


@pytest.mark.skipif(not sglang_parser_available(), reason="SGLang's function_call package does not import here")
@pytest.mark.parametrize("entry,parser_name", CASES)
def test_live_sglang_parser_gives_the_recorded_answer(entry, parser_name):
    want = entry["sglang"][parser_name]
    p = ToolCallParser(parser_name, CORPUS["schemas"], backend="sglang")
    if "raises" in want:
        with pytest.raises(Exception):
            p._sglang.parse_non_stream(entry["text"])
        return
    got = p.parse(entry["text"])
    assert (got.normal_text, [[c.name, c.arguments] for c in got.calls]) == (want["normal_text"], want["calls"])
