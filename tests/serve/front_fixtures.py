"""Shared by the front's tests, benchmark and example (a module name of its own: spawned ranks import it by name):
a tiny random Llama whose vocabulary is a real HF fast tokenizer's (characters + ChatML specials) with a
Qwen2.5-style tool template, so every id the engine samples decodes."""
from __future__ import annotations

import string

from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast


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
