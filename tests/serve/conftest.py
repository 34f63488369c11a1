"""A real OpenAI front on 127.0.0.1 (ephemeral port) over the real CPU reference engine, for the real `openai`
client (the model and tokenizer: front_fixtures.py)."""
from __future__ import annotations

import pytest
from front_fixtures import MODEL, chatml_tokenizer, tiny_config

from mtrain.rollout import ReferenceEngine
from mtrain.rollout.client import LocalClient
from mtrain.serve.front import OpenAIFront
from mtrain.serve.server import FrontServer


@pytest.fixture(scope="module")
def tokenizer():
    return chatml_tokenizer()


@pytest.fixture(scope="module")
def engine(tokenizer):
    e = ReferenceEngine(tiny_config(len(tokenizer)), init_seed=0)
    yield e
    e.shutdown()


@pytest.fixture(scope="module")
def server(engine, tokenizer):
    front = OpenAIFront(LocalClient(engine), tokenizer, model_name=MODEL, max_positions=512, default_max_tokens=24,
                        tool_parser="qwen25")
    srv = FrontServer(front, max_body_bytes=64 << 10, max_concurrency=64)
    srv.start()
    yield srv
    srv.stop()
