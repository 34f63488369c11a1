"""A real OpenAI front on 127.0.0.1 (ephemeral port) over the real CPU reference engine, for the real `openai`
client: a tiny random Llama whose vocabulary is a real HF fast tokenizer's (characters + ChatML specials) with a
Qwen2.5-style tool template, so every id the engine samples decodes."""
from __future__ import annotations

import string

import pytest
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

from mtrain.rollout import ReferenceEngine
from mtrain.rollout.client import LocalClient
from mtrain.serve.front import OpenAIFront
from mtrain.serve.server import FrontServer

CHATML_TOOLS = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{{- messages[0]['content'] if messages[0]['role'] == 'system' else 'Be nice.' }}"
    "{{- '\\n<tools>' }}{%- for t in tools %}{{- '\\n' + t['function']['name'] }}{%- endfor %}"
    "{{- '\\n</tools><|im_end|>\\n' }}"
    "{%- elif messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + m['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- elif m['role'] == 'assistant' %}{{- '<|im_start|>assistant\\n' + (m['content'] or '') }}"
    "{%- for c in m.get('tool_calls') or [] %}{{- '\\n<tool_call>\\n{\"name\": \"' + c['function']['name'] }}"
    "{{- '\", \"arguments\": ' + c['function']['arguments'] + '}\\n</tool_call>' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif m['role'] != 'system' %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
MODEL = "tiny-llama"


def chatml_tokenizer() -> PreTrainedTokenizerFast:
    chars = sorted(set(string.printable))
    vocab = {c: i for i, c in enumerate(chars)}
    vocab["56"] = len(vocab)  # one merge, so tokenization is not trivially per character
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("5", "6")]))
    tok.decoder = decoders.Fuse()  # ids decode to their characters, no spaces between
    tok.add_special_tokens(SPECIALS)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   chat_template=CHATML_TOOLS)


def tiny_config(vocab: int) -> dict:
    return dict(model_type="llama", vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.5,
                tie_word_embeddings=False)


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
