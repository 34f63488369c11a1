"""Retrieval tool: BM25 (the `bm25s` library) over a local corpus, the top k documents per query.

The corpus is a list of strings: a file (.txt: one document per line; .jsonl: {"text": ...} per line) or the
generated town corpus (`mtrain.tools.corpus`) when none is given. The index is built once per tool and shared
read-only by every session; per-session state is only the query log.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import bm25s

from mtrain.tools.base import BaseTool, ToolError, ToolSession
from mtrain.tools.corpus import town_corpus


def load_corpus(path: str | Path) -> list[str]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"retrieval corpus not found: {path}")
    lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
    if path.suffix == ".jsonl":
        docs = []
        for i, ln in enumerate(lines):
            try:
                docs.append(str(json.loads(ln)["text"]))
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{i + 1}: expected a JSON object with a 'text' field ({e})") from None
        return docs
    return lines


class RetrievalTool(BaseTool):
    schema = {"type": "function", "function": {
        "name": "search",
        "description": "Search the knowledge base and return the most relevant documents.",
        "parameters": {"type": "object", "properties": {
            "query": {"type": "string", "description": "what to look for"}}, "required": ["query"]}}}

    def __init__(self, documents: list[str] | None = None, *, top_k: int = 2):
        if documents is None:
            documents = town_corpus()[0]
        if not documents or not all(isinstance(d, str) and d.strip() for d in documents):
            raise ValueError("RetrievalTool: the corpus must be a non-empty list of non-empty strings")
        if top_k < 1:
            raise ValueError(f"RetrievalTool: top_k must be >= 1, got {top_k}")
        self.documents, self.top_k = list(documents), min(top_k, len(documents))
        self._index = bm25s.BM25()
        self._index.index(bm25s.tokenize(self.documents, stopwords="en", show_progress=False), show_progress=False)

    def search(self, query: str, k: int | None = None) -> list[tuple[int, float]]:
        """(document index, score) of the best k documents, best first; documents with score 0 are left out."""
        tokens = bm25s.tokenize([query], stopwords="en", show_progress=False)
        if not tokens.ids or not tokens.ids[0]:
            return []
        ids, scores = self._index.retrieve(tokens, k=k or self.top_k, show_progress=False)
        return [(int(i), float(s)) for i, s in zip(ids[0], scores[0]) if s > 0]

    def create(self, session: ToolSession) -> dict[str, list]:
        return {"queries": []}

    def call(self, session: ToolSession, args: dict[str, Any]) -> str:
        query = args["query"].strip()
        if not query:
            raise ToolError("search: the query is empty")
        session.state[self.name]["queries"].append(query)
        hits = self.search(query)
        if not hits:
            return "No matching documents."
        return "\n".join(f"[{n + 1}] {self.documents[i]}" for n, (i, _) in enumerate(hits))
