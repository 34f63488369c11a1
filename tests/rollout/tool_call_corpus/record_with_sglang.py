"""Record SGLang's own tool-call parsing of a corpus of strings (well-formed and malformed) into corpus.json.

CI checks `mtrain.tools.parsers` against these answers (tests/rollout/test_tool_parsers.py). Re-record after an
SGLang upgrade, on any machine where SGLang's function_call package imports:

    python tests/rollout/tool_call_corpus/record_with_sglang.py                  # SGLang installed (GPU box)
    python tests/rollout/tool_call_corpus/record_with_sglang.py --sglang-root DIR # an unpacked SGLang wheel

With --sglang-root the package __init__ files of sglang, sglang.srt, ... are skipped (they import the GPU
runtime); the function_call modules themselves are SGLang's, unchanged. They need pydantic, orjson,
partial-json-parser, openai, xgrammar and apache-tvm-ffi importable (pip install --target DIR, then PYTHONPATH).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import types
from pathlib import Path

HERE = Path(__file__).parent
SCHEMAS = [
    {"type": "function", "function": {"name": "calculator", "description": "math",
                                      "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                                                     "required": ["expression"]}}},
    {"type": "function", "function": {"name": "search", "description": "bm25",
                                      "parameters": {"type": "object", "properties": {"query": {"type": "string"}},
                                                     "required": ["query"]}}},
    {"type": "function", "function": {"name": "python", "description": "code",
                                      "parameters": {"type": "object", "properties": {"code": {"type": "string"}},
                                                     "required": ["code"]}}},
]
CALC = '{"name": "calculator", "arguments": {"expression": "123*456"}}'
SEARCH = '{"name": "search", "arguments": {"query": "population of Glitrux"}}'
PY = '{"name": "python", "arguments": {"code": "print(\\"<tool_call>\\")\\nprint(2**10)"}}'
STRINGS = [
    "The answer is 42.",
    "",
    f"<tool_call>\n{CALC}\n</tool_call>",
    f"Let me compute.\n<tool_call>\n{CALC}\n</tool_call>",
    f"  I will search. <tool_call>\n{SEARCH}\n</tool_call>  ",
    f"<tool_call>\n{CALC}\n</tool_call>\n<tool_call>\n{SEARCH}\n</tool_call>",
    f"<tool_call>\n{PY}\n</tool_call>",
    f"<tool_call>{CALC}</tool_call>",
    f"<tool_call>{CALC}</tool_call><tool_call>{SEARCH}</tool_call>",
    f"<tool_call>\n{CALC}",
    f"<tool_call>{CALC}",
    "<tool_call>\n{\"name\": \"calculator\", \"arguments\": {\"expression\": \"1+1\"}\n</tool_call>",
    "<tool_call>\n{'name': 'calculator', 'arguments': {'expression': '1+1'}}\n</tool_call>",
    f"<tool_call>\nnot json at all\n</tool_call>\n<tool_call>\n{CALC}\n</tool_call>",
    f"<tool_call>not json</tool_call><tool_call>{CALC}</tool_call>",
    "<tool_call>\n{\"name\": \"weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>",
    "<tool_call>\n{\"arguments\": {\"expression\": \"1\"}}\n</tool_call>",
    "<tool_call>\n{\"name\": \"calculator\"}\n</tool_call>",
    "<tool_call>\n{\"name\": \"calculator\", \"parameters\": {\"expression\": \"7*7\"}}\n</tool_call>",
    "<tool_call>\n{\"name\": \"calculator\", \"arguments\": \"{\\\"expression\\\": \\\"2+2\\\"}\"}\n</tool_call>",
    "<tool_call>\n[{\"name\": \"calculator\", \"arguments\": {\"expression\": \"1\"}}, "
    "{\"name\": \"search\", \"arguments\": {\"query\": \"q\"}}]\n</tool_call>",
    "<tool_call>\n{\"name\": \"search\", \"arguments\": {\"query\": \"Zürich café ☕\"}}\n</tool_call>",
    "<tool_call>\n\n</tool_call>",
    "<tool_call></tool_call>",
    "<tool_call>",
    "</tool_call>",
    f"text </tool_call> more <tool_call>\n{CALC}\n</tool_call>",
    f"<TOOL_CALL>\n{CALC}\n</TOOL_CALL>",
    f"<tool_call>\n {CALC} \n</tool_call>",
    f"<tool_call>\n{CALC}\n</tool_call> trailing words",
    f"<tool_call>\n{CALC}\n</tool_call><|im_end|>",
    f"```json\n{CALC}\n```",
    CALC,
    "<tool_call>\n{\"name\": \"calculator\", \"arguments\": {\"expression\": \"1\"}} extra\n</tool_call>",
    "<tool_call>\n{\"name\": \"calculator\", \"arguments\": {}}\n</tool_call>",
    "<tool_call>\n{\"name\": \"calculator\", \"arguments\": null}\n</tool_call>",
    "<tool_call>\n{\"name\": null, \"arguments\": {}}\n</tool_call>",
    "<tool_call>\n{\"name\": \"\", \"arguments\": {}}\n</tool_call>",
    "<tool_call>\n\"calculator\"\n</tool_call>",
    f"<tool_call>\n{CALC}\n</tool_call>\n<tool_call>\n{{broken\n</tool_call>\n<tool_call>\n{SEARCH}\n</tool_call>",
    f"<tool_call>{CALC}</tool_call>\n<tool_call>{{broken</tool_call>",
    "<tool_call>\n{\"name\": \"calculator\", \"arguments\": {\"expression\": \"1\"}, \"name\": \"search\"}\n</tool_call>",
    "<tool_call>\n{\"name\": \"calculator\", \"arguments\": {\"expression\": \"1\\n</tool_call>\\n\"}}\n</tool_call>",
]
PARSER_NAMES = ["qwen25", "hermes"]


def _import_from_root(root: str):
    for name in ["sglang", "sglang.srt", "sglang.srt.utils", "sglang.srt.entrypoints", "sglang.srt.entrypoints.openai",
                 "sglang.srt.debug_utils"]:
        m = types.ModuleType(name)
        m.__path__ = [os.path.join(root, *name.split("."))]
        sys.modules[name] = m


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sglang-root", help="folder holding an unpacked sglang package (sglang/...)")
    ap.add_argument("--out", default=str(HERE / "corpus.json"))
    a = ap.parse_args()
    if a.sglang_root:
        _import_from_root(a.sglang_root)
    from sglang.srt.entrypoints.openai.protocol import Tool
    from sglang.srt.function_call.function_call_parser import FunctionCallParser
    try:
        from importlib.metadata import version
        sgl_version = version("sglang")
    except Exception:  # noqa: BLE001 - an unpacked wheel has no installed metadata
        ns: dict = {}
        exec((Path(a.sglang_root) / "sglang" / "version.py").read_text(), ns)  # __version__ = "..."
        sgl_version = ns.get("__version__", "unknown")
    tools = [Tool(**s) for s in SCHEMAS]
    entries = []
    for text in STRINGS:
        rec = {"text": text, "sglang": {}}
        for pname in PARSER_NAMES:
            parser = FunctionCallParser(tools, pname)  # fresh: detectors keep streaming state
            try:
                normal, calls = parser.parse_non_stream(text)
                rec["sglang"][pname] = {"normal_text": normal, "calls": [[c.name, c.parameters] for c in calls]}
            except Exception as e:  # noqa: BLE001 - recorded: ours must not crash there
                rec["sglang"][pname] = {"raises": type(e).__name__}
        entries.append(rec)
    out = {"sglang_version": sgl_version, "schemas": SCHEMAS, "entries": entries}
    Path(a.out).write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n")
    print(f"recorded {len(entries)} strings x {PARSER_NAMES} with SGLang {sgl_version} -> {a.out}")


if __name__ == "__main__":
    main()
