"""The CPU reference engine against an independent uncached generation loop, and its failure modes.

The reference for generation is a plain HF model (default attention/experts kernels, not the engine's
eager ones) run over the whole sequence at every step, with sampling re-implemented in float64 numpy;
both draw one float64 uniform per sampled token from a generator seeded by the request's seed.
"""
import threading
import time

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

from mtrain.rollout import EngineError, ReferenceEngine, Request, SamplingParams, expand_samples

COMMON = dict(vocab_size=160, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.1)
CONFIGS = {
    "llama": dict(COMMON, tie_word_embeddings=False),
    "qwen2": dict(COMMON, tie_word_embeddings=True),
    "qwen3": dict(COMMON, head_dim=8, tie_word_embeddings=False),
    "qwen3_moe": dict(COMMON, head_dim=8, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                      tie_word_embeddings=True),
    "deepseek_v3": dict(COMMON, num_key_value_heads=4, moe_intermediate_size=16, n_routed_experts=4,
                        num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1,
                        q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """model_type -> (HF model in float32, its save_pretrained folder); built once per module."""
    cache = {}

    def get(model_type):
        if model_type not in cache:
            torch.manual_seed(1234)
            cfg = AutoConfig.for_model(model_type, **CONFIGS[model_type])
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
            path = tmp_path_factory.mktemp(model_type)
            model.save_pretrained(path)
            cache[model_type] = (model, str(path))
        return cache[model_type]

    return get


def naive_generate(model, prompt, params, seed):
    """Full forward over the whole sequence per step, no cache; sampling in float64 numpy."""
    gen = torch.Generator().manual_seed(seed)
    seq, out, lps = list(prompt), [], []
    for _ in range(params.max_new_tokens):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([seq])).logits[0, -1].double().numpy()
        if params.temperature == 0:
            tok = int(np.argmax(logits))
            lp_all = logits - np.logaddexp.reduce(logits)
        else:
            z = logits / params.temperature
            lp_all = z - np.logaddexp.reduce(z)
            p = np.exp(lp_all)
            order = np.argsort(-p, kind="stable")
            ps = p[order]
            if params.top_k != -1:
                ps[params.top_k:] = 0
            mass_before = np.concatenate([[0.0], np.cumsum(ps)[:-1]])
            ps[mass_before > params.top_p] = 0
            u = torch.rand((), generator=gen, dtype=torch.float64).item()
            cdf = np.cumsum(ps)
            tok = int(order[int(np.argmax(cdf > u * cdf[-1]))])
        out.append(tok)
        lps.append(float(lp_all[tok]))
        seq.append(tok)
        if tok in params.stop_token_ids:
            break
    return out, lps


def tensors_of(path):
    return load_file(f"{path}/model.safetensors")


@pytest.mark.parametrize("model_type", ["llama", "qwen3_moe"])
def test_generation_matches_uncached_loop(saved, model_type):
    model, path = saved(model_type)
    engine = ReferenceEngine.from_pretrained(path)
    # low temperatures sharpen the tiny model's near-uniform logits so that top-k/top-p cut-offs matter
    settings = [SamplingParams(max_new_tokens=12, temperature=1.0, seed=11),
                SamplingParams(max_new_tokens=12, temperature=0.3, top_p=0.5, seed=12),
                SamplingParams(max_new_tokens=12, temperature=0.5, top_k=3, seed=13),
                SamplingParams(max_new_tokens=12, temperature=0.8, top_k=10, top_p=0.3, seed=14),
                SamplingParams(max_new_tokens=12, temperature=0.0)]
    prompts = [[5, 9, 2, 7], [3, 1, 4, 1, 5, 9, 2], [8]]
    reqs = [Request(f"r{i}{j}-", p, s) for i, p in enumerate(prompts) for j, s in enumerate(settings)]
    for req, c in zip(reqs, engine.generate(reqs)):
        tokens, lps = naive_generate(model, req.prompt_ids, req.params, req.params.seed or 0)
        assert c.rid == req.rid and c.prompt_ids == req.prompt_ids and c.finish_reason == "length"
        assert c.output_ids == tokens, req.rid
        np.testing.assert_allclose(c.logprobs, lps, atol=1e-5, rtol=0)


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3", "deepseek_v3"])
def test_other_architectures_load_and_generate(saved, model_type):
    model, path = saved(model_type)
    engine = ReferenceEngine.from_pretrained(path)
    on_disk = tensors_of(path)
    specs = engine.parameter_specs()
    assert specs == {k: (tuple(v.shape), v.dtype) for k, v in on_disk.items()}
    if CONFIGS[model_type].get("tie_word_embeddings"):
        assert "lm_head.weight" not in specs
    params = SamplingParams(max_new_tokens=6, temperature=0.9, seed=3)
    [c] = engine.generate([Request("a", [4, 8, 15, 16], params)])
    tokens, lps = naive_generate(model, [4, 8, 15, 16], params, 3)
    assert c.output_ids == tokens
    np.testing.assert_allclose(c.logprobs, lps, atol=1e-5, rtol=0)


def test_moe_on_disk_names_land_in_fused_experts(saved):
    _, path = saved("qwen3_moe")
    engine = ReferenceEngine.from_pretrained(path)
    specs = engine.parameter_specs()
    assert specs["model.layers.1.mlp.experts.3.up_proj.weight"] == ((16, 32), torch.float32)
    up = torch.randn(16, 32)
    engine.update_weights([[("model.layers.1.mlp.experts.3.up_proj.weight", up)]])
    engine.finish_weight_update(1)
    fused = engine._model.model.layers[1].mlp.experts.gate_up_proj  # [E, 2I, H]: gate rows then up rows
    assert torch.equal(fused[3, 16:], up)


def test_batching_invariance_and_seeds(saved):
    _, path = saved("llama")
    engine = ReferenceEngine.from_pretrained(path)
    params = SamplingParams(max_new_tokens=10, temperature=1.0, top_p=0.95, seed=77)
    target = Request("target", [7, 3, 9, 1, 2], params)
    [alone] = engine.generate([target])
    others = [Request(f"o{i}-", [i + 1] * n, SamplingParams(max_new_tokens=4 + i, seed=i))
              for i, n in enumerate([5, 3, 5, 8, 5])]
    batch = engine.generate(others[:2] + [target] + others[2:])
    assert [c.rid for c in batch] == [r.rid for r in others[:2]] + ["target"] + [r.rid for r in others[2:]]
    assert batch[2].output_ids == alone.output_ids
    np.testing.assert_allclose(batch[2].logprobs, alone.logprobs, atol=1e-6, rtol=0)
    assert [len(c.output_ids) for c in batch] == [4, 5, 10, 6, 7, 8]
    # distinct seeds (one GRPO group) give different samples; the same seed gives the same sample
    group = engine.generate(expand_samples([[7, 3, 9]], 4, SamplingParams(max_new_tokens=8), 500, "g"))
    assert len({tuple(c.output_ids) for c in group}) == 4
    again = engine.generate(expand_samples([[7, 3, 9]], 4, SamplingParams(max_new_tokens=8), 500, "g"))
    assert [c.output_ids for c in again] == [c.output_ids for c in group]


def test_greedy_stop_and_length(saved):
    model, path = saved("llama")
    engine = ReferenceEngine.from_pretrained(path)
    prompt = [10, 20, 30]
    [greedy] = engine.generate([Request("g", prompt, SamplingParams(max_new_tokens=9, temperature=0))])
    seq = list(prompt)
    for tok in greedy.output_ids:  # greedy = argmax of the logits at every step
        with torch.no_grad():
            assert tok == int(model(input_ids=torch.tensor([seq])).logits[0, -1].argmax())
        seq.append(tok)
    assert greedy.finish_reason == "length" and len(greedy.output_ids) == 9
    [top1] = engine.generate([Request("k", prompt, SamplingParams(max_new_tokens=9, top_k=1, seed=5))])
    assert top1.output_ids == greedy.output_ids
    stop = greedy.output_ids[4]
    first = greedy.output_ids.index(stop)
    [stopped] = engine.generate([Request("s", prompt, SamplingParams(max_new_tokens=9, temperature=0,
                                                                      stop_token_ids=(999, stop)))])
    assert stopped.finish_reason == "stop"
    assert stopped.output_ids == greedy.output_ids[: first + 1]  # the stop token is part of the output
    assert stopped.logprobs == greedy.logprobs[: first + 1]


def test_update_weights_equals_fresh_engine(saved):
    _, path = saved("qwen3_moe")
    fresh = ReferenceEngine.from_pretrained(path)
    engine = ReferenceEngine(AutoConfig.from_pretrained(path), init_seed=99)  # different random weights
    reqs = [Request(f"u{i}-", [1 + i, 2, 3], SamplingParams(max_new_tokens=8, seed=i)) for i in range(3)]
    want = fresh.generate(reqs)
    assert [c.output_ids for c in engine.generate(reqs)] != [c.output_ids for c in want]
    items = list(tensors_of(path).items())
    for bucket in (items[:10], items[10:25], items[25:]):
        engine.update_weights([bucket])
    engine.finish_weight_update(5)
    got = engine.generate(reqs)
    assert engine.weight_version == 5 and all(c.weight_version == 5 for c in got)
    assert [c.output_ids for c in got] == [c.output_ids for c in want]
    assert [c.logprobs for c in got] == [c.logprobs for c in want]


def test_update_weights_errors(saved):
    _, path = saved("qwen3_moe")
    engine = ReferenceEngine.from_pretrained(path)
    name = "model.layers.0.self_attn.q_proj.weight"
    good = torch.zeros(32, 32)
    before = engine._views[name].clone()
    cases = [
        ([("model.layers.0.self_attn.qproj.weight", good)], "unknown parameter 'model.layers.0.self_attn.qproj"),
        ([("lm_head.weight", torch.zeros(160, 32))], "'lm_head.weight' \\(tied to the embedding"),
        ([(name, good), ("model.norm.weight", torch.zeros(31))], "'model.norm.weight' has shape \\(31,\\), the engine "
                                                               "expects \\(32,\\)"),
        ([(name, good.bfloat16())], f"'{name}' has dtype torch.bfloat16, the engine holds torch.float32"),
        ([(name, good), (name, good)], f"'{name}' appears twice"),
        ([(name, good.numpy())], f"'{name}' is a ndarray"),
    ]
    for bucket, msg in cases:
        with pytest.raises(EngineError, match=msg):
            engine.update_weights([bucket])
        assert torch.equal(engine._views[name], before)  # a rejected bucket writes nothing
    with pytest.raises(EngineError, match="tp_size=1, expected tensors for 1 rank, got 2"):
        engine.update_weights([[(name, good)], [(name, good)]])
    with pytest.raises(EngineError, match="version must be an int"):
        engine.finish_weight_update("3")
    casting = ReferenceEngine.from_pretrained(path, allow_dtype_cast=True)
    casting.update_weights([[(name, torch.ones(32, 32, dtype=torch.bfloat16))]])
    casting.finish_weight_update(1)
    assert torch.equal(casting._views[name], torch.ones(32, 32))


def test_pull_weights_writes_and_refuses_bad_jobs(saved):
    from mtrain.reshard.pull import PullJob
    _, path = saved("qwen3_moe")
    engine = ReferenceEngine.from_pretrained(path)
    name = "model.layers.0.self_attn.q_proj.weight"  # [32, 32] float32
    src = torch.randn(1024)
    rows = np.asarray([[0, 0, 0, 0, 0, 1, 1024, 0]], dtype=np.int64)
    engine.pull_weights([PullJob("p/0/0", [(name, (32, 32))], rows, [src], "p:s", 4096)], version=7)
    assert torch.equal(engine._views[name], src.view(32, 32)) and engine.weight_version == 7
    before = engine._views[name].clone()
    bad = PullJob("p/1/0", [(name, (16, 64))], rows, [src * 2], "p:t", 4096)
    with pytest.raises(EngineError, match=r"pull_weights: pull: .*plan has shape \(16, 64\), the engine's parameter "
                                          r"\(32, 32\)"):
        engine.pull_weights([bad])
    assert torch.equal(engine._views[name], before) and engine.weight_version == 7
    with pytest.raises(EngineError, match="expected 1 job"):
        engine.pull_weights([None, None])
    engine.release_memory(("weights",))
    with pytest.raises(EngineError, match="weights are released"):
        engine.pull_weights([None], version=8)


def test_request_errors(saved):
    _, path = saved("llama")
    engine = ReferenceEngine.from_pretrained(path)
    ok = SamplingParams(max_new_tokens=4)
    cases = [
        ([Request("long-rid", [1] * 500, SamplingParams(max_new_tokens=13))],
         "'long-rid': prompt length 500 \\+ max_new_tokens 13 = 513 exceeds max_position_embeddings 512"),
        ([Request("empty", [], ok)], "'empty' has an empty prompt"),
        ([Request("oov", [1, 160, -1], ok)], "'oov' has token ids outside \\[0, 160\\): \\[160, -1\\]"),
        ([Request("d", [1], ok), Request("d", [2], ok)], "duplicate rids \\['d'\\]"),
        ([Request("", [1], ok)], "rid must be a non-empty string"),
        ([Request("p", [1], {"max_new_tokens": 3})], "'p' params must be SamplingParams"),
    ]
    for reqs, msg in cases:
        with pytest.raises(EngineError, match=msg):
            engine.generate(reqs)
    assert engine.active_requests() == {}  # failed calls leave nothing registered


def test_release_resume_semantics(saved):
    _, path = saved("llama")
    engine = ReferenceEngine.from_pretrained(path)
    reqs = [Request("m", [3, 4, 5], SamplingParams(max_new_tokens=6, seed=1))]
    want = engine.generate(reqs)[0]
    with pytest.raises(EngineError, match="unknown memory tag 'weight'"):
        engine.release_memory(("weight",))
    engine.release_memory(("weights",))
    params = list(engine._model.parameters())
    assert all(p.untyped_storage().nbytes() == 0 for p in params)  # the bytes really went back
    with pytest.raises(EngineError, match="already released"):
        engine.release_memory(("weights",))
    with pytest.raises(EngineError, match="memory \\['weights'\\] is released"):
        engine.generate(reqs)
    with pytest.raises(EngineError, match="weights are released; call resume_memory"):
        engine.update_weights([[("model.norm.weight", torch.ones(32))]])
    engine.resume_memory(("weights",))
    assert all(torch.isnan(p).all() for p in params)  # garbage until pushed
    with pytest.raises(EngineError, match="'kv_cache' was not released"):
        engine.resume_memory(("kv_cache",))
    with pytest.raises(EngineError, match="weights not pushed since resume_memory"):
        engine.generate(reqs)
    items = list(tensors_of(path).items())
    engine.update_weights([items[:-2]])
    with pytest.raises(EngineError, match="2 parameters were not written since the weights were resumed: "
                                          + repr(sorted(n for n, _ in items[-2:])).replace("[", "\\[")):
        engine.finish_weight_update(2)
    with pytest.raises(EngineError, match="weights not pushed"):
        engine.generate(reqs)
    engine.update_weights([items[-2:]])
    with pytest.raises(EngineError, match="a weight sync is in progress"):
        engine.generate(reqs)
    engine.finish_weight_update(2)
    got = engine.generate(reqs)[0]
    assert got.output_ids == want.output_ids and got.weight_version == 2
    # kv_cache alone: generation refuses until resumed; weights are untouched
    engine.release_memory(("kv_cache",))
    with pytest.raises(EngineError, match="memory \\['kv_cache'\\] is released"):
        engine.generate(reqs)
    engine.resume_memory(("kv_cache",))
    assert engine.generate(reqs)[0].output_ids == want.output_ids
    # both tags (the default), then shutdown
    engine.release_memory()
    engine.resume_memory()
    engine.shutdown()
    with pytest.raises(EngineError, match="generate: the engine was shut down"):
        engine.generate(reqs)


def test_abort_from_another_thread_returns_partial_output(saved):
    _, path = saved("llama")
    engine = ReferenceEngine.from_pretrained(path)
    long = SamplingParams(max_new_tokens=480, seed=4)
    reqs = [Request("ab-0-", [1, 2, 3, 4, 5], long),
            Request("keep-", [5, 4, 3, 2, 1], SamplingParams(max_new_tokens=3, seed=5)),
            Request("ab-1-", [1, 2, 3, 4, 5, 6, 7], long)]  # another prompt length: still queued
    result = {}
    thread = threading.Thread(target=lambda: result.update(out=engine.generate(reqs)))
    thread.start()
    deadline = time.monotonic() + 30
    while engine.active_requests().get("ab-0-", 0) < 3:
        assert time.monotonic() < deadline and thread.is_alive()
        time.sleep(0.001)
    engine.abort("ab-")
    thread.join(timeout=30)
    ab0, keep, ab1 = result["out"]
    assert ab0.finish_reason == "abort" and 3 <= len(ab0.output_ids) < 480
    assert len(ab0.logprobs) == len(ab0.output_ids)
    assert keep.finish_reason == "length" and len(keep.output_ids) == 3
    assert ab1.finish_reason == "abort" and ab1.output_ids == []
    # the partial output is a prefix of the unaborted sample
    n = len(ab0.output_ids)
    [full] = engine.generate([Request("ab-0-", [1, 2, 3, 4, 5], SamplingParams(max_new_tokens=n, seed=4))])
    assert full.output_ids == ab0.output_ids and full.finish_reason == "length"
    engine.abort()  # nothing in flight: a no-op, and it does not poison later requests
    assert engine.active_requests() == {}
    assert engine.generate([Request("ab-0-", [1, 2], SamplingParams(max_new_tokens=2))])[0].finish_reason == "length"


def test_config_dict_and_bad_config():
    engine = ReferenceEngine({"model_type": "llama", **CONFIGS["llama"]})
    assert engine.hf_config.model_type == "llama" and engine.layout == "hf" and engine.tp_size == 1
    assert engine.weight_version == 0
    assert len(engine.generate([Request("x", [1], SamplingParams(max_new_tokens=2))])[0].output_ids) == 2
    with pytest.raises(EngineError, match="needs a HF config dict with a 'model_type'"):
        ReferenceEngine({"hidden_size": 32})
    with pytest.raises(EngineError, match="no \\*.safetensors in"):
        ReferenceEngine.from_pretrained("/nonexistent-dir")
