"""benchmarks/gpu_fp8_sync.py's diagnosis glue on CPU (the engines need a GPU; these parts do not): the row
sampling keeps whole blocks and matching scale rows, and `diagnose_state` tells apart a checkpoint quantized
with `amax / 448.0` under CUDA semantics (the 2026-11-30 reference), a transposed scale, and agreement, each
side also checked against the float64 quantization of its source."""
from __future__ import annotations

import sys
from pathlib import Path

import torch

from mtrain.kernels import quantize_blocks
from mtrain.rollout.fp8_diagnose import CudaScalarDivision

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import gpu_fp8_sync as G  # noqa: E402


def _src():
    g = torch.Generator().manual_seed(7)
    r = lambda *s: (torch.randn(*s, generator=g) * 0.02).to(torch.bfloat16)  # noqa: E731
    return {"model.layers.0.self_attn.qkv_proj.weight": r(384, 256),
            "model.layers.0.mlp.down_proj.weight": r(256, 384),
            "model.layers.0.mlp.experts.w13_weight": r(3, 256, 256),
            "model.layers.0.input_layernorm.weight": r(256)}


def _state(src, quant):
    out = {}
    for n, t in src.items():
        if t.dim() == 1:
            out[n] = t.clone()
        else:
            out[n], out[n + "_scale_inv"] = quant(t)
    return out


def test_sampled_keeps_whole_blocks_and_scale_rows():
    src = _src()
    st = _state(src, quantize_blocks)
    s = G.sampled(st, 128, experts=2)
    assert s["model.layers.0.self_attn.qkv_proj.weight"].shape == (128, 256)
    assert s["model.layers.0.self_attn.qkv_proj.weight_scale_inv"].shape == (1, 2)
    assert s["model.layers.0.mlp.experts.w13_weight"].shape == (2, 128, 256)
    assert s["model.layers.0.mlp.experts.w13_weight_scale_inv"].shape == (2, 1, 2)
    assert s["model.layers.0.input_layernorm.weight"].shape == (256,)
    assert G.sampled(st, 0) is st
    # a sampled tensor's quantization is the sample of the whole one's (blocks are independent)
    q, sc = quantize_blocks(G.sampled(src, 128)["model.layers.0.mlp.down_proj.weight"])
    assert torch.equal(q.view(torch.uint8), s["model.layers.0.mlp.down_proj.weight"].view(torch.uint8))
    assert torch.equal(sc, s["model.layers.0.mlp.down_proj.weight_scale_inv"])


def test_hf_sample_names_keeps_diag_layers_and_two_experts():
    names = ["model.layers.0.mlp.experts.0.up_proj.weight", "model.layers.0.mlp.experts.5.up_proj.weight",
             "model.layers.3.self_attn.q_proj.weight", "model.layers.1.self_attn.q_proj.weight", "lm_head.weight"]
    assert G.hf_sample_names(names, {0, 3}) == ["model.layers.0.mlp.experts.0.up_proj.weight",
                                                "model.layers.3.self_attn.q_proj.weight"]


def test_diagnose_state_names_the_2026_11_30_difference():
    src = G.sampled(_src(), 256)
    ours = _state(src, quantize_blocks)
    fp8 = {n for n, t in ours.items() if t.dtype == torch.float8_e4m3fn}

    same = G.diagnose_state(ours, {k: v.clone() for k, v in ours.items()}, src, fp8)
    assert {d["kind"] for d in same.values()} == {"equal"}
    assert all(d["ours_equals_f64"] and d["sglang_load_equals_f64"] for n, d in same.items() if n in fp8)

    with CudaScalarDivision():  # the old reference: quantize_scalar_div as CUDA torch runs it
        old = _state(src, G.quantize_scalar_div)
    diag = G.diagnose_state(old, ours, src, fp8)
    for n in fp8:
        d = diag[n]
        assert d["ours_equals_f64"] and not d["sglang_load_equals_f64"], n
        assert d["kind"].startswith("scale_ulp (ref amax*fl32(1/448) (reciprocal), ours amax/448 (IEEE))"), d
    assert diag["model.layers.0.input_layernorm.weight"]["kind"] == "equal"

    moved = dict(ours)
    n = "model.layers.0.mlp.down_proj.weight"
    moved[n + "_scale_inv"] = ours[n + "_scale_inv"].t().contiguous()
    d = G.diagnose_state(moved, ours, src, fp8)[n]
    assert d["scale"]["kind"] == "layout: transposed" and d["ours_equals_f64"]


def test_quant_checks_on_cpu_agree_with_float64():
    """On the CPU the old formula is IEEE too (only CUDA rewrites the scalar division): both equal float64."""
    from mtrain.layouts import model_layout
    from mtrain.tiny_configs import tiny_config

    cfg = tiny_config("llama", hidden_size=256, intermediate_size=384, num_attention_heads=2,
                      num_key_value_heads=2, head_dim=128, num_hidden_layers=2)
    layout = model_layout(cfg)
    g = torch.Generator().manual_seed(0)
    hf = {p.name: (torch.randn(p.rows[1] - p.rows[0], w.shape2d[1], generator=g) * 0.02).to(torch.bfloat16)
          for w in layout.weights if w.block_fp8 for p in w.hf}
    r = G.quant_checks(hf, layout, {1}, rows=128)
    assert r["tensors"] > 0 and r["gpu_quantize_blocks_equal_f64"] == r["tensors"]
    assert r["old_formula_equal_f64"] == r["tensors"] and not r["gpu_mismatches"]


def test_explain_names_the_known_sglang_differences_and_nothing_else():
    """SGLang's Llama loader leaves block scales unloaded (they keep the engine's dummy values) and our sync resets
    KV scales to 1.0: both are told apart from a real difference, a scale that is wrong on our side."""
    src = _src()
    ours = _state(src, quantize_blocks)
    ours["model.layers.0.self_attn.attn.k_scale"] = torch.tensor(1.0)
    ref = {n: t.clone() for n, t in ours.items()}
    dummy = torch.full_like(ref["model.layers.0.mlp.down_proj.weight_scale_inv"], 3e-4)
    ref["model.layers.0.mlp.down_proj.weight_scale_inv"] = dummy  # what SGLang's loader left
    ref["model.layers.0.self_attn.attn.k_scale"] = torch.tensor(4.2e-4)  # derived from the dummy weights
    wrong = ours["model.layers.0.mlp.experts.w13_weight_scale_inv"] * 2
    ours["model.layers.0.mlp.experts.w13_weight_scale_inv"] = wrong  # a real difference
    sha = lambda d: {n: {"sha256": G.sha256(t)} for n, t in d.items()}  # noqa: E731
    reference, after = sha(ref), sha(ours)
    mismatched = sorted(n for n in reference if after[n]["sha256"] != reference[n]["sha256"])
    ref["model.layers.0.mlp.experts.w13_weight_scale_inv"] = wrong  # the reference agreeing with a wrong sync
    scales = G.expected_scales(src)
    assert set(scales) == {n + "_scale_inv" for n, t in src.items() if t.dim() >= 2}
    why = G.explain(mismatched, reference, after, scales)
    assert why == {"model.layers.0.mlp.down_proj.weight_scale_inv": "sglang_loader_dropped_scale",
                   "model.layers.0.self_attn.attn.k_scale": "kv_scale_reset",
                   "model.layers.0.mlp.experts.w13_weight_scale_inv": "unexplained"}
