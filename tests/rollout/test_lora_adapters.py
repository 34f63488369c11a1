"""Named, versioned LoRA adapters on the reference engine: the protocol the trainer drives SGLang's LoRA with.

Checks: an adapter loaded by the adapter table's HF names generates with PEFT's numbers (PeftModel on the same HF
weights, float32, <= 1e-5 per token logprob); switch_adapter loads v(n+1), routes requests to it and unloads v(n);
a request running when the switch starts finishes under the adapter it started with; bad adapters are refused
whole (the engine keeps serving the old one); an unload waits for the requests that still name the adapter; under
stream a request paused in place through a sync keeps its adapter (and its version) to the end.
"""
from __future__ import annotations

import re
import threading

import pytest
import torch

from mtrain.rollout.lora_adapters import AdapterVersions, adapter_name, switch_adapter
from mtrain.rollout.protocol import EngineError, Request, SamplingParams

RANK, ALPHA, TARGETS = 4, 8.0, ("qkv", "o_proj", "gate_up", "down")


@pytest.fixture(scope="module", params=["llama", pytest.param("qwen3", marks=pytest.mark.slow)])
def tiny(request, tmp_path_factory):
    from mtrain.tiny_hf import write_tiny_hf
    return write_tiny_hf(request.param, tmp_path_factory.mktemp("hf") / request.param, seed=0)


def _table(hf):
    import json
    from mtrain.layouts import model_layout
    from mtrain.layouts.lora import LoraSpec, lora_layout
    cfg = json.loads((hf / "config.json").read_text())
    return lora_layout(model_layout(dict(cfg, num_nextn_predict_layers=0), mtp=False), LoraSpec(RANK, ALPHA, TARGETS))


def _adapter(table, seed):
    g = torch.Generator().manual_seed(seed)
    return {w.hf[0].name: 0.3 * torch.randn(w.shape, generator=g) for w in table.weights}


def _engine(hf, table, **kw):
    from mtrain.layouts.lora import peft_target_modules
    from mtrain.rollout.reference_engine import ReferenceEngine
    lora = {"r": RANK, "lora_alpha": ALPHA, "target_modules": peft_target_modules(table)}
    return ReferenceEngine.from_pretrained(str(hf), lora=lora, **kw), lora


def _peft_logprobs(hf, lora, tensors, prompt, output, base_weights=None):
    """Per-token logprobs of `output` after `prompt` under PeftModel(HF base + this adapter): PEFT's own code.
    base_weights: HF name -> tensor replacing the checkpoint's (an FP8 engine's quantized base)."""
    import peft
    from transformers import AutoModelForCausalLM
    base = AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32, attn_implementation="eager")
    if base_weights is not None:
        params = dict(base.named_parameters())
        with torch.no_grad():
            for k, v in base_weights.items():
                params[k].copy_(v)
    model = peft.get_peft_model(base, peft.LoraConfig(r=lora["r"], lora_alpha=lora["lora_alpha"],
                                                      target_modules=lora["target_modules"], lora_dropout=0.0))
    res = peft.set_peft_model_state_dict(model, {f"base_model.model.{k}": v for k, v in tensors.items()})
    assert not [k for k in res.unexpected_keys if "lora_" in k]
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].double(), -1)
    return [logp[len(prompt) - 1 + i, t].item() for i, t in enumerate(output)]


def _greedy(rid, prompt, n=6):
    return Request(rid=rid, prompt_ids=prompt, params=SamplingParams(temperature=0.0, max_new_tokens=n))


def test_switch_generates_with_peft_numbers_and_unloads_the_old(tiny):
    table = _table(tiny)
    engine, lora = _engine(tiny, table)
    prompt = [3, 17, 5, 9]
    try:
        for version in (0, 1):
            tensors = _adapter(table, seed=version)
            assert switch_adapter(engine, version, tensors, lora) == adapter_name(version)
            assert engine._adapter_names() == [adapter_name(version)]  # the previous version is gone
            out = engine.generate([_greedy(f"r{version}", prompt)])[0]
            want = _peft_logprobs(tiny, lora, tensors, prompt, out.output_ids)
            gap = max(abs(a - b) for a, b in zip(out.logprobs, want))
            assert gap <= 1e-5, (version, gap)
            held = engine.adapter_state()
            assert all(torch.equal(held[k], tensors[k]) for k in tensors)
    finally:
        engine.shutdown()


def test_bad_adapter_is_refused_whole_and_the_old_keeps_serving(tiny):
    table = _table(tiny)
    engine, lora = _engine(tiny, table)
    prompt = [3, 17, 5, 9]
    try:
        switch_adapter(engine, 0, _adapter(table, 0), lora)
        before = engine.generate([_greedy("a", prompt)])[0].logprobs
        good = _adapter(table, 1)
        name = next(iter(good))
        for bad, why in [({**good, name: good[name][:, :-1]}, "has shape"),
                         ({k: v for k, v in good.items() if k != name}, "missing"),
                         ({**good, "model.layers.0.nope.lora_A.weight": good[name]}, "unknown")]:
            with pytest.raises(EngineError, match=why):
                switch_adapter(engine, 1, bad, lora)
            assert engine._adapter_names() == ["policy-v0"] and engine.adapters.active == "policy-v0"
        with pytest.raises(EngineError, match="differs from the engine's"):
            engine.load_lora_adapter("x", good, {"r": RANK + 1, "lora_alpha": ALPHA,
                                                 "target_modules": lora["target_modules"]})
        assert engine.generate([_greedy("b", prompt)])[0].logprobs == before
    finally:
        engine.shutdown()


def test_a_running_request_finishes_under_its_own_adapter(tiny):
    """A slow request under v0 is running when the switch to v1 starts: its tokens are v0's (the load waits for
    the model), and v0 is unloaded only after it."""
    table = _table(tiny)
    engine, lora = _engine(tiny, table, decode_delay_s=0.05)
    prompt = [3, 17, 5, 9]
    try:
        switch_adapter(engine, 0, _adapter(table, 0), lora)
        alone = engine.generate([_greedy("ref", prompt, n=8)])[0]
        fut = engine.submit(_greedy("slow", prompt, n=8))
        while not engine.active_requests():
            pass
        switch_adapter(engine, 1, _adapter(table, 1), lora)
        assert fut.result(timeout=60).output_ids == alone.output_ids
        assert engine._adapter_names() == ["policy-v1"]
        assert engine.generate([_greedy("after", prompt, n=8)])[0].logprobs != alone.logprobs
    finally:
        engine.shutdown()


def test_a_request_paused_in_place_keeps_its_adapter_through_a_stream_sync(tiny):
    """rollout.async=stream: a request under v0 is paused in place mid-decode while the sync switches to v1
    (keep_in_use: no wait, v0 retired). Continued, it decodes the rest under v0: its tokens equal an undisturbed v0
    run, all carry version 0, and its logprobs are PeftModel's with v0 (<= 1e-5); a request after the sync runs
    v1 with PEFT's v1 numbers and version 1; the next switch unloads the retired v0."""
    table = _table(tiny)
    engine, lora = _engine(tiny, table, decode_delay_s=0.05)
    prompt, v0, v1 = [3, 17, 5, 9], _adapter(table, 0), _adapter(table, 1)
    try:
        switch_adapter(engine, 0, v0, lora, keep_in_use=True)
        engine.finish_weight_update(0)
        alone = engine.generate([_greedy("ref", prompt, n=8)])[0]
        fut = engine.submit(_greedy("paused", prompt, n=8))
        while not engine.active_requests().get("paused"):
            pass  # decoding: at least one token made under v0
        engine.pause_in_place()
        made = engine.active_requests()["paused"]
        assert switch_adapter(engine, 1, v1, lora, keep_in_use=True) == "policy-v1"
        engine.finish_weight_update(1)
        assert engine.adapters.retired == ["policy-v0"] and engine._adapter_names() == ["policy-v0", "policy-v1"]
        engine.continue_generation()
        out = fut.result(timeout=60)
        assert 0 < made < 8 and out.output_ids == alone.output_ids
        assert out.weight_version == 0 and out.token_versions is None  # every token v0's
        gap = max(abs(a - b) for a, b in zip(out.logprobs, _peft_logprobs(tiny, lora, v0, prompt, out.output_ids)))
        assert gap <= 1e-5, gap
        after = engine.generate([_greedy("after", prompt, n=8)])[0]
        assert after.weight_version == 1
        gap = max(abs(a - b) for a, b in zip(after.logprobs, _peft_logprobs(tiny, lora, v1, prompt, after.output_ids)))
        assert gap <= 1e-5, gap
        switch_adapter(engine, 2, _adapter(table, 2), lora, keep_in_use=True)
        assert engine.adapters.retired == [] and engine._adapter_names() == ["policy-v2"]
    finally:
        engine.shutdown()


def test_unload_waits_for_requests_that_name_the_adapter():
    v = AdapterVersions()
    assert v.acquire() is None  # before any adapter: the base model
    v.activate("policy-v0")
    held = v.acquire()
    assert v.activate("policy-v1") == "policy-v0" and v.acquire() == "policy-v1"
    assert not v.wait_unused("policy-v0", 0.05)  # still named by a running request
    threading.Timer(0.05, v.release, args=(held,)).start()
    assert v.wait_unused("policy-v0", 5.0) and v.in_use("policy-v0") == 0 and v.in_use("policy-v1") == 1


MOE_CASES = {  # id: (architecture, config.json changes, targets)
    "qwen3_moe-experts": ("qwen3_moe", {}, ("qkv", "experts")),
    # a dense layer's MLP in a MoE model, and DeepSeek's shared experts: PEFT under transformers 5 rewrote targets
    # named gate_proj/up_proj/down_proj on a MoE model into the fused experts' parameters, so these linears got no
    # adapter (the first load refused their tensors as unknown) and the experts got one no one had targeted
    "qwen3_moe-dense_layer": ("qwen3_moe", {"mlp_only_layers": [0]}, ("gate_up", "down")),
    "deepseek_v3-shared": ("deepseek_v3", {}, ("experts", "shared.gate_up", "shared.down")),
    "deepseek_v3-dense_layer": ("deepseek_v3", {}, ("gate_up", "down")),
}


@pytest.mark.parametrize("case", list(MOE_CASES))
def test_expert_adapters_generate_like_the_merged_hf_model(tmp_path, case):
    """LoRA on a MoE model's linears: every routed expert (transformers keeps the experts fused), a dense layer's
    MLP, shared experts. The engine takes the trainer's per-expert PEFT names, and generates with the logprobs of the
    plain HF model whose weights have W + (alpha/r) B A merged in by hand, per expert, from those same tensors
    (<= 1e-5)."""
    import json

    from transformers import AutoModelForCausalLM

    from mtrain.layouts import model_layout
    from mtrain.layouts.lora import LoraSpec, lora_layout
    from mtrain.rollout.reference_engine import ReferenceEngine
    from mtrain.tiny_hf import write_tiny_hf
    from mtrain.trainer.publishers.lora import engine_lora_args

    arch, changes, targets = MOE_CASES[case]
    hf = write_tiny_hf(arch, tmp_path / "moe", seed=0, overrides=changes)
    base = model_layout(dict(json.loads((hf / "config.json").read_text()), num_nextn_predict_layers=0), mtp=False)
    spec = LoraSpec(RANK, ALPHA, targets)
    table, lora = lora_layout(base, spec), engine_lora_args(base, spec)
    tensors = _adapter(table, seed=3)
    assert ("experts" in targets) == any(".experts.3.up_proj.lora_B" in k for k in tensors)
    engine = ReferenceEngine.from_pretrained(str(hf), lora=lora)
    prompt = [3, 17, 5, 9]
    try:
        before = engine.generate([_greedy("base", prompt)])[0]
        switch_adapter(engine, 1, tensors, lora)
        out = engine.generate([_greedy("r", prompt)])[0]
    finally:
        engine.shutdown()
    model = AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32, attn_implementation="eager",
                                                 experts_implementation="eager")
    params, scale = dict(model.named_parameters()), ALPHA / RANK
    with torch.no_grad():
        for k in tensors:
            if not k.endswith(".lora_A.weight"):
                continue
            delta = scale * tensors[k.replace("lora_A", "lora_B")] @ tensors[k]
            mod = k[: -len(".lora_A.weight")]
            expert = re.match(r"(.+\.experts)\.(\d+)\.(\w+)$", mod)
            if expert is None:
                params[f"{mod}.weight"] += delta
                continue
            path, e, lin = expert[1], int(expert[2]), expert[3]
            if lin == "down_proj":
                params[f"{path}.down_proj"][e] += delta
            else:  # gate_up_proj [E, 2I, H]: gate rows first, then up (transformers' chunk(2))
                half = params[f"{path}.gate_up_proj"].shape[1] // 2
                rows = slice(0, half) if lin == "gate_proj" else slice(half, 2 * half)
                params[f"{path}.gate_up_proj"][e, rows] += delta
        ids = torch.tensor([prompt + out.output_ids])
        logp = torch.log_softmax(model(ids).logits[0].double(), -1)
    want = [logp[len(prompt) - 1 + i, t].item() for i, t in enumerate(out.output_ids)]
    gap = max(abs(a - b) for a, b in zip(out.logprobs, want))
    assert gap <= 1e-5, gap
    assert max(abs(a - b) for a, b in zip(out.logprobs, before.logprobs)) > 1e-3  # the adapter does something


def test_fp8_engine_applies_adapters_on_its_quantized_base(tmp_path):
    """engine.weight_dtype=fp8 with LoRA (the CPU FP8 engine): the base sync puts every linear weight on the FP8
    block grid; adapter-only syncs leave those bits alone; generation equals PeftModel on that quantized base with
    the adapter (<= 1e-5), and differs from PeftModel on the unquantized base (the FP8 base is what serves)."""
    from mtrain.kernels import dequantize_blocks, quantize_blocks
    from mtrain.layouts.fp8 import BLOCK
    from mtrain.layouts.lora import peft_target_modules
    from mtrain.rollout.fp8_engine import Fp8ReferenceEngine
    from mtrain.tiny_hf import write_tiny_hf

    hf = write_tiny_hf("llama", tmp_path / "llama", seed=0, overrides={  # 128-row blocks (SGLang's FP8 rules)
        "hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 64,
        "intermediate_size": 256, "num_hidden_layers": 2})
    table = _table(hf)
    lora = {"r": RANK, "lora_alpha": ALPHA, "target_modules": peft_target_modules(table)}
    engine = Fp8ReferenceEngine.from_pretrained(str(hf), lora=lora)
    prompt = [3, 17, 5, 9]
    try:
        base = {k: v.detach().clone() for k, v in engine._views.items()}
        q, s = quantize_blocks(_disk(hf)["model.layers.0.mlp.down_proj.weight"], BLOCK)
        assert torch.equal(base["model.layers.0.mlp.down_proj.weight"], dequantize_blocks(q, s, BLOCK))
        for version in (1, 2):
            tensors = _adapter(table, seed=version)
            switch_adapter(engine, version, tensors, lora)
            engine.finish_weight_update(version)  # as AdapterTarget closes an adapter-only sync
            assert all(torch.equal(engine._views[k], base[k]) for k in base)
        out = engine.generate([_greedy("r", prompt)])[0]
    finally:
        engine.shutdown()
    want = _peft_logprobs(hf, lora, tensors, prompt, out.output_ids, base_weights=base)
    gap = max(abs(a - b) for a, b in zip(out.logprobs, want))
    assert gap <= 1e-5, gap
    full = _peft_logprobs(hf, lora, tensors, prompt, out.output_ids)
    assert max(abs(a - b) for a, b in zip(out.logprobs, full)) > 1e-4


def _disk(hf):
    from safetensors.torch import load_file
    out = {}
    for f in sorted(hf.glob("*.safetensors")):
        out.update(load_file(f))
    return out
