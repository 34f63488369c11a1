"""The CPU reference engine with engine.weight_dtype=fp8 (mtrain/rollout/fp8_engine.py): after a sync every linear
weight holds exactly dequant(quant(w)) of its SGLang-fused canonical tensor (checked against the float64
reference of tests/reshard/test_fp8_sync.py), everything else is untouched, and it generates; shapes SGLang's FP8
layers refuse are refused; the SGLang model dir carries DeepSeek's quantization_config."""
import json
import os
import sys

import pytest
import torch

from mtrain.converters.fp8 import dequant_fp8_blockwise
from mtrain.layouts import model_layout
from mtrain.rollout.fp8_engine import QUANTIZATION_CONFIG, Fp8ReferenceEngine, fp8_model_dir
from mtrain.rollout.protocol import EngineError, Request, SamplingParams
from mtrain.rollout.reference_engine import ReferenceEngine
from mtrain.tiny_configs import tiny_config

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "reshard"))
from test_fp8_sync import ref_quant  # noqa: E402

CFG = {
    "qwen3": tiny_config("qwen3", hidden_size=128, num_attention_heads=2, num_key_value_heads=2, head_dim=64,
                         intermediate_size=256, num_hidden_layers=2),
    "deepseek_v3": tiny_config("deepseek_v3", hidden_size=128, num_attention_heads=2, num_key_value_heads=2, head_dim=64,
                               q_lora_rank=128, kv_lora_rank=64, qk_nope_head_dim=64, qk_rope_head_dim=64,
                               v_head_dim=64, intermediate_size=256, moe_intermediate_size=128, n_routed_experts=4,
                               n_group=2, topk_group=1, num_experts_per_tok=2, num_hidden_layers=2,
                               num_nextn_predict_layers=0),
}


def random_weights(engine, seed):
    g = torch.Generator().manual_seed(seed)
    return {n: (torch.randn(s, generator=g) * 0.05).to(dt) for n, (s, dt) in engine.parameter_specs().items()}


@pytest.mark.parametrize("arch", list(CFG))
def test_fp8_reference_engine_holds_quantize_dequantize_of_the_fused_tensors(arch):
    cfg = CFG[arch]
    eng, plain = Fp8ReferenceEngine(cfg), ReferenceEngine(cfg)
    w = random_weights(eng, 0)
    for e in (eng, plain):
        e.update_weights([list(w.items())])
        e.finish_weight_update(1)
    layout = model_layout(cfg)
    held = eng.parameter_specs()
    linear = set()
    for wt in layout.weights:
        if not (wt.block_fp8 and wt.sglang):
            continue
        names = [p.name for p in wt.hf]
        linear |= set(names)
        q, s = ref_quant(torch.cat([w[n] for n in names]).float())
        # dequantized by the converters' own DeepSeek-checkpoint reader (independent of the kernels' helper)
        deq = dequant_fp8_blockwise(q.view(torch.float8_e4m3fn), s, 128, out_dtype=torch.float32)
        start = 0
        for n in names:
            got = eng._views[n]
            want = deq[start:start + got.shape[0]].to(got.dtype)
            assert torch.equal(got, want), n
            start += got.shape[0]
    assert linear and linear < set(held)
    for n in set(held) - linear:  # norms, embedding, head, router, biases: as sent
        assert torch.equal(eng._views[n], w[n]), n
    # it generates, and the first greedy step shows the quantization: a small, nonzero logprob gap
    req = Request(rid="r", prompt_ids=[3, 5, 7, 11], params=SamplingParams(max_new_tokens=3, temperature=0.0))
    (a,) = eng.generate([req])
    (b,) = plain.generate([req])
    assert len(a.output_ids) == 3 and a.weight_version == 1
    if a.output_ids[0] == b.output_ids[0]:
        assert 0 < abs(a.logprobs[0] - b.logprobs[0]) < 0.5


def test_fp8_reference_engine_refuses_what_sglang_refuses():
    with pytest.raises(EngineError, match=r"engine.weight_dtype=fp8: L0.qkv .* divisible by 128"):
        Fp8ReferenceEngine(tiny_config("qwen3"))


def test_sglang_fp8_model_dir(tmp_path):
    src = tmp_path / "hf"
    src.mkdir()
    (src / "tokenizer.json").write_text("{}")
    cfg = CFG["deepseek_v3"]
    out = fp8_model_dir(str(src), cfg, str(tmp_path / "fp8"))
    got = json.loads(open(os.path.join(out, "config.json")).read())
    assert got["quantization_config"] == QUANTIZATION_CONFIG == {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    assert {k: v for k, v in got.items() if k != "quantization_config"} == json.loads(json.dumps(cfg))
    assert os.path.islink(os.path.join(out, "tokenizer.json"))
    with pytest.raises(EngineError, match="already has quantization_config"):
        fp8_model_dir(str(src), dict(cfg, quantization_config={"quant_method": "awq"}), str(tmp_path / "x"))


def test_weight_dtype_config_key():
    from pathlib import Path

    from mtrain.config import ConfigError, load_config
    example = Path(__file__).resolve().parents[2] / "mtrain" / "configs" / "tiny_llama_grpo.yaml"
    assert load_config(example).engine.weight_dtype == "auto"
    assert load_config(example, ["engine.weight_dtype=fp8"]).engine.weight_dtype == "fp8"
    with pytest.raises(ConfigError, match=r"engine.weight_dtype.*must be auto, bfloat16 or fp8, got 'fp16'"):
        load_config(example, ["engine.weight_dtype=fp16"])
