"""Top logprobs from the reference engine, against a float64 full-sequence forward of the same weights (no KV cache,
no incremental decoding), and the protocol's checks on the request side."""
from __future__ import annotations

import copy

import pytest
import torch

from mtrain.rollout import ReferenceEngine
from mtrain.rollout.protocol import MAX_ENGINE_TOP_LOGPROBS, Completion, Request, SamplingParams

CONFIG = dict(model_type="llama", vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.3,
              tie_word_embeddings=False)


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_reference_engine_top_logprobs_equal_a_float64_forward(temperature):
    engine = ReferenceEngine(CONFIG, init_seed=0)
    try:
        prompt = [3, 14, 15, 9, 26]
        c = engine.generate([Request("t-", prompt, SamplingParams(max_new_tokens=8, temperature=temperature, seed=5,
                                                                  top_logprobs=4))])[0]
        ref_model = copy.deepcopy(engine._model).double().eval()
        with torch.no_grad():
            logits = ref_model(torch.tensor([prompt + c.output_ids])).logits[0, len(prompt) - 1:-1]
        logp = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
        assert len(c.top_logprobs) == len(c.output_ids) == 8
        for i, top in enumerate(c.top_logprobs):
            values, ids = torch.topk(logp[i], 4)
            assert [t for t, _ in top] == ids.tolist()
            assert [v for _, v in top] == pytest.approx(values.tolist(), abs=1e-4)
            assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)
            # the sampled token's logprob is the same distribution's
            assert c.logprobs[i] == pytest.approx(float(logp[i, c.output_ids[i]]), abs=1e-4)
            if temperature == 0:
                assert top[0][0] == c.output_ids[i]
        plain = engine.generate([Request("p-", prompt, SamplingParams(max_new_tokens=3, temperature=temperature,
                                                                      seed=5))])[0]
        assert plain.top_logprobs is None and plain.output_ids == c.output_ids[:3]  # asking changes no sample
    finally:
        engine.shutdown()


@pytest.mark.parametrize("bad", [-1, MAX_ENGINE_TOP_LOGPROBS + 1, True, 2.0])
def test_top_logprobs_out_of_range_is_one_clear_error(bad):
    # the engine takes up to MAX_ENGINE_TOP_LOGPROBS (score centering asks for its top-k head); the front's
    # OpenAI limit of 20 is checked by its request schema (tests/serve)
    with pytest.raises(ValueError, match=f"top_logprobs must be an int in \\[0, {MAX_ENGINE_TOP_LOGPROBS}\\]"):
        SamplingParams(top_logprobs=bad)


def test_completion_checks_the_top_logprob_rows():
    with pytest.raises(ValueError, match="2 output ids but 1 top-logprob lists"):
        Completion("c-", [1], [4, 5], [-0.1, -0.2], "length", 0, top_logprobs=[[(4, -0.1)]])
