"""top_logprobs through the real `openai` client and a real server: chat (`logprobs=true, top_logprobs=k`) and the
legacy completions API (`logprobs=k`), against a float64 full-sequence forward of the engine's weights."""
from __future__ import annotations

import copy

import pytest
import torch
from openai import OpenAI

from front_fixtures import MODEL


def float64_top(engine, prompt_ids, output_ids, temperature, k):
    model = copy.deepcopy(engine._model).double().eval()
    with torch.no_grad():
        logits = model(torch.tensor([list(prompt_ids) + list(output_ids)])).logits[0, len(prompt_ids) - 1:-1]
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return [torch.topk(row, k) for row in logp]


def test_chat_top_logprobs_equal_a_float64_forward(server, engine, tokenizer):
    c = OpenAI(base_url=server.base_url, api_key=server.api_key)
    messages = [{"role": "user", "content": "Count: 1, 2,"}]
    r = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, seed=11, temperature=0.8,
                                  logprobs=True, top_logprobs=5)
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    content = r.choices[0].logprobs.content
    out_ids = [tokenizer.convert_tokens_to_ids(x.token) if x.token in tokenizer.get_vocab() else None
               for x in content]
    assert None not in out_ids  # every sampled token decodes to one vocabulary entry in this tokenizer
    ref = float64_top(engine, prompt, out_ids, 0.8, 5)
    for x, (values, ids) in zip(content, ref):
        assert [t.token for t in x.top_logprobs] == [tokenizer.decode([i]) for i in ids.tolist()]
        assert [t.logprob for t in x.top_logprobs] == pytest.approx(values.tolist(), abs=1e-4)
        assert all(t.bytes == list(t.token.encode()) for t in x.top_logprobs)
    plain = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, seed=11, temperature=0.8,
                                      logprobs=True)
    assert plain.choices[0].message.content == r.choices[0].message.content  # asking for them changes no sample
    assert all(x.top_logprobs == [] for x in plain.choices[0].logprobs.content)


def test_completions_logprobs_k_gives_the_k_most_likely(server, engine, tokenizer):
    c = OpenAI(base_url=server.base_url, api_key=server.api_key)
    r = c.completions.create(model=MODEL, prompt="The answer is", max_tokens=6, seed=4, logprobs=3)
    lp = r.choices[0].logprobs
    ids = [tokenizer.convert_tokens_to_ids(t) for t in lp.tokens]
    ref = float64_top(engine, tokenizer.encode("The answer is"), ids, 1.0, 3)
    for top, (values, want_ids) in zip(lp.top_logprobs, ref):
        want = {tokenizer.decode([i]): v for i, v in zip(want_ids.tolist(), values.tolist())}
        assert set(top) == set(want)
        assert [top[k] for k in want] == pytest.approx(list(want.values()), abs=1e-4)
