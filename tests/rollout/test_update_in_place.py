"""Weight updates without aborting on the CPU reference engine: pause_in_place / update / continue_generation.

The reference for the tokens and logprobs is the plain HF models (default attention kernels, not the engine's eager
ones) run step by step by the test: the prompt and the tokens before the swap through model A's forward into one KV
cache, the tokens after the swap through model B's forward on that same cache (what SGLang's in_place pause does:
the KV computed with the old weights is kept), sampling re-implemented in float64 numpy with one uniform per token
from the request's seeded generator.
"""
import threading
import time

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

from mtrain.rollout import EngineError, ReferenceEngine, Request, SamplingParams

CONFIG = dict(vocab_size=160, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.1, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(model A, its folder, model B, its folder): two random llamas of one shape."""
    out = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **CONFIG), dtype=torch.float32).eval()
        path = tmp_path_factory.mktemp(f"m{seed}")
        model.save_pretrained(path)
        out += [model, str(path)]
    return out


def sample_np(logits: np.ndarray, params: SamplingParams, gen: torch.Generator) -> tuple[int, float]:
    z = logits / params.temperature
    lp_all = z - np.logaddexp.reduce(z)
    p = np.exp(lp_all)
    order = np.argsort(-p, kind="stable")
    ps = p[order]
    if params.top_k != -1:
        ps[params.top_k:] = 0
    ps[np.concatenate([[0.0], np.cumsum(ps)[:-1]]) > params.top_p] = 0
    u = torch.rand((), generator=gen, dtype=torch.float64).item()
    cdf = np.cumsum(ps)
    tok = int(order[int(np.argmax(cdf > u * cdf[-1]))])
    return tok, float(lp_all[tok])


@torch.no_grad()
def swapped_generate(model_a, model_b, prompt, params, seed, swap_at):
    """Tokens 0..swap_at-1 from model A's forwards, the rest from model B's on A's KV cache."""
    gen = torch.Generator().manual_seed(seed)
    cache = DynamicCache(config=model_a.config)
    ids, out, lps = torch.tensor([prompt]), [], []
    for j in range(params.max_new_tokens):
        model = model_a if j < swap_at else model_b
        logits = model(input_ids=ids, past_key_values=cache, use_cache=True).logits[0, -1].double().numpy()
        tok, lp = sample_np(logits, params, gen)
        out.append(tok)
        lps.append(lp)
        ids = torch.tensor([[tok]])
    return out, lps


def wait_for(cond, what, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.002)


def test_requests_in_flight_continue_across_an_update(models):
    model_a, path_a, model_b, path_b = models
    engine = ReferenceEngine.from_pretrained(path_a)
    params = SamplingParams(max_new_tokens=60, temperature=1.0, seed=None)
    prompts = {"r0-": [1, 2, 3, 4], "r1-": [7, 8, 9, 10]}  # one prompt length: one batch, decoded together
    reqs = [Request(rid, p, SamplingParams(max_new_tokens=60, temperature=1.0, seed=11 + i))
            for i, (rid, p) in enumerate(prompts.items())]
    got = {}
    thread = threading.Thread(target=lambda: got.update(out=engine.generate(reqs)))
    thread.start()
    wait_for(lambda: engine.active_requests().get("r0-", 0) >= 5, "no decoding progress")
    engine.pause_in_place()
    k = engine.active_requests()["r0-"]
    time.sleep(0.1)
    assert engine.active_requests()["r0-"] == k, "decoding went on while paused"
    late = engine.submit(Request("late-", [3, 3, 3], SamplingParams(max_new_tokens=4, seed=5)))  # arrives paused
    engine.update_weights([list(load_file(f"{path_b}/model.safetensors").items())])
    engine.finish_weight_update(1)
    engine.continue_generation()
    thread.join(timeout=60)
    assert not thread.is_alive()
    outs = got["out"]
    assert engine.aborted_requests == 0
    for req, c in zip(reqs, outs):
        assert c.finish_reason == "length" and len(c.output_ids) == 60
        # the tokens decoded before the pause carry version 0, every later one version 1
        assert c.token_versions == [0] * k + [1] * (60 - k) and c.weight_version == 1
        want_ids, want_lps = swapped_generate(model_a, model_b, req.prompt_ids, req.params, req.params.seed, k)
        assert c.output_ids == want_ids
        np.testing.assert_allclose(c.logprobs, want_lps, atol=2e-4, rtol=0)
        # and not what the old weights would have said for the same tokens: the swap really happened
        old_ids, old_lps = swapped_generate(model_a, model_a, req.prompt_ids, req.params, req.params.seed, 60)
        assert old_ids[k:] != c.output_ids[k:] or np.abs(np.array(c.logprobs[k:]) - old_lps[k:]).max() > 1e-2
    # a request that arrived during the pause ran entirely on the new weights
    done = late.result(timeout=30)
    assert done.finish_reason == "length" and done.weight_version == 1 and done.token_versions is None
    engine.shutdown()


def test_continue_before_the_sync_is_finished_is_refused(models):
    _, path_a, _, path_b = models
    engine = ReferenceEngine.from_pretrained(path_a)
    box = {}

    def run():
        try:
            box["out"] = engine.generate([Request("x-", [1, 2, 3], SamplingParams(max_new_tokens=200, seed=1))])
        except EngineError as e:
            box["error"] = e

    thread = threading.Thread(target=run)
    thread.start()
    wait_for(lambda: engine.active_requests().get("x-", 0) >= 2, "no decoding progress")
    engine.pause_in_place()
    with pytest.raises(EngineError, match="already paused"):
        engine.pause_in_place()
    engine.update_weights([list(load_file(f"{path_b}/model.safetensors").items())[:3]])  # a partial sync
    engine.continue_generation()
    thread.join(timeout=30)
    assert "weight sync is in progress" in str(box["error"])
    with pytest.raises(EngineError, match="not paused"):
        engine.continue_generation()
    engine.shutdown()


def test_shutdown_while_paused_ends_the_parked_generation(models):
    _, path_a, _, _ = models
    engine = ReferenceEngine.from_pretrained(path_a)
    box = {}

    def run():
        try:
            box["out"] = engine.generate([Request("y-", [1, 2, 3], SamplingParams(max_new_tokens=300, seed=1))])
        except EngineError as e:
            box["error"] = e

    thread = threading.Thread(target=run)
    thread.start()
    wait_for(lambda: engine.active_requests().get("y-", 0) >= 2, "no decoding progress")
    engine.pause_in_place()
    engine.shutdown()
    thread.join(timeout=30)
    assert not thread.is_alive() and "shut down" in str(box["error"])


def test_sglang_versions_from_marks():
    """SGLang's side: the tokens a paused request had at each update in place carry the version before it."""
    from mtrain.rollout.sglang_engine import versions_from_marks
    assert versions_from_marks([(3, 0)], 5, 1) == [0, 0, 0, 1, 1]
    assert versions_from_marks([(2, 4), (4, 5)], 6, 6) == [4, 4, 5, 5, 6, 6]
    # a non-streamed request's mark is rounded up (up to 49 tokens): capped at the output, never newer than true
    assert versions_from_marks([(52, 0)], 10, 1) == [0] * 10
    assert versions_from_marks([(2, 0), (2, 1)], 3, 2) == [0, 0, 2]  # no token between two updates
