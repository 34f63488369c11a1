"""Block-wise FP8 dequantisation against a float64 reference written here with explicit loops over blocks."""
import math

import pytest
import torch

from mtrain.converters.errors import CheckpointError, TensorMismatchError
from mtrain.converters.fp8 import (dequant_fp8_blockwise, dequantized_view, is_fp8_checkpoint,
                                   weight_block_size)


def reference(w: torch.Tensor, s: torch.Tensor, br: int, bc: int) -> torch.Tensor:
    rows, cols = w.shape
    out = torch.empty(rows, cols, dtype=torch.float64)
    w64 = w.to(torch.float64)
    for bi in range(math.ceil(rows / br)):
        for bj in range(math.ceil(cols / bc)):
            r0, c0 = bi * br, bj * bc
            out[r0:r0 + br, c0:c0 + bc] = w64[r0:r0 + br, c0:c0 + bc] * float(s[bi, bj])
    return out


def fp8_case(rows, cols, br=128, bc=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(rows, cols, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    s = torch.rand(math.ceil(rows / br), math.ceil(cols / bc), generator=g) * 1e-2 + 1e-4
    return w, s.to(torch.float32)


@pytest.mark.parametrize("shape", [(128, 128), (130, 257), (1, 1), (300, 129), (7, 512), (256, 1)])
def test_matches_float64_loops(shape):
    w, s = fp8_case(*shape)
    ref = reference(w, s, 128, 128)
    # e4m3 x float32 is exact in float64, so float32 output equals the float64 product rounded once.
    assert torch.equal(dequant_fp8_blockwise(w, s, out_dtype=torch.float32), ref.to(torch.float32))
    got = dequant_fp8_blockwise(w, s)
    assert got.dtype == torch.bfloat16 and got.shape == shape
    assert torch.equal(got, ref.to(torch.float32).to(torch.bfloat16))


def test_rectangular_blocks_and_distinct_scales_per_block():
    w = torch.ones(5, 7).to(torch.float8_e4m3fn)
    s = torch.arange(1, 3 * 3 + 1, dtype=torch.float32).view(3, 3)  # blocks of 2 rows x 3 cols
    got = dequant_fp8_blockwise(w, s, (2, 3), out_dtype=torch.float32)
    assert torch.equal(got, reference(w, s, 2, 3).float())
    assert got[4, 6] == 9 and got[0, 0] == 1 and got[2, 3] == 5  # last partial block uses the last scale


@pytest.mark.parametrize("scale_shape", [(2, 2), (1, 3), (3, 3)])
def test_scale_shape_mismatch_names_the_tensor(scale_shape):
    w, _ = fp8_case(130, 257)
    with pytest.raises(TensorMismatchError, match=r"layers\.3\.mlp\.down_proj\.weight_scale_inv: shape .* \(expected \(2, 3\)\)"):
        dequant_fp8_blockwise(w, torch.ones(scale_shape), name="layers.3.mlp.down_proj.weight")


def test_bad_dtypes_and_ranks_are_refused():
    w, s = fp8_case(4, 4)
    with pytest.raises(TensorMismatchError, match="q_b.weight: expected a float8 weight"):
        dequant_fp8_blockwise(w.float(), s, name="q_b.weight")
    with pytest.raises(TensorMismatchError, match="expected float32 scales"):
        dequant_fp8_blockwise(w, s.to(torch.int32), name="q_b.weight")
    with pytest.raises(TensorMismatchError, match="must be 2-D"):
        dequant_fp8_blockwise(w.view(-1), s, name="q_b.weight")


def test_block_size_from_config():
    assert weight_block_size({"quantization_config": {"weight_block_size": [128, 128]}}) == (128, 128)
    assert weight_block_size({}) == (128, 128)
    with pytest.raises(ValueError, match="block size"):
        weight_block_size({"quantization_config": {"weight_block_size": [0, 128]}})


def fake_checkpoint():
    w1, s1 = fp8_case(200, 300, seed=1)
    w2, s2 = fp8_case(64, 129, seed=2)
    store = {
        "model.layers.0.self_attn.q_a_proj.weight": w1,
        "model.layers.0.self_attn.q_a_proj.weight_scale_inv": s1,
        "model.layers.3.mlp.experts.0.up_proj.weight": w2,
        "model.layers.3.mlp.experts.0.up_proj.weight_scale_inv": s2,
        "model.layers.0.input_layernorm.weight": torch.randn(300).to(torch.bfloat16),
        "model.layers.3.mlp.gate.e_score_correction_bias": torch.randn(8),
    }
    return store


def test_view_dequantises_and_drops_scales():
    store = fake_checkpoint()
    getters = {n: (lambda n=n: store[n]) for n in store}
    assert is_fp8_checkpoint(getters) and not is_fp8_checkpoint(["a.weight", "b.bias"])
    view = dequantized_view(getters)
    assert set(view) == {n for n in store if not n.endswith("_scale_inv")}
    for name in ("model.layers.0.self_attn.q_a_proj.weight", "model.layers.3.mlp.experts.0.up_proj.weight"):
        ref = reference(store[name], store[name + "_scale_inv"], 128, 128)
        assert torch.equal(view[name](), ref.float().bfloat16())
    norm = "model.layers.0.input_layernorm.weight"
    assert view[norm]() is store[norm]
    bias = "model.layers.3.mlp.gate.e_score_correction_bias"
    assert view[bias]().dtype == torch.float32


def test_view_refuses_orphan_scales_and_unscaled_fp8():
    store = fake_checkpoint()
    orphan = dict(store)
    del orphan["model.layers.0.self_attn.q_a_proj.weight"]
    with pytest.raises(CheckpointError, match=r"q_a_proj\.weight_scale_inv: block scales without a weight"):
        dequantized_view({n: (lambda n=n: orphan[n]) for n in orphan})
    unscaled = dict(store)
    del unscaled["model.layers.3.mlp.experts.0.up_proj.weight_scale_inv"]
    view = dequantized_view({n: (lambda n=n: unscaled[n]) for n in unscaled})
    with pytest.raises(CheckpointError, match=r"experts\.0\.up_proj\.weight: float8 weight without"):
        view["model.layers.3.mlp.experts.0.up_proj.weight"]()


def test_view_reports_scale_mismatch_with_the_weight_name():
    store = fake_checkpoint()
    store["model.layers.0.self_attn.q_a_proj.weight_scale_inv"] = torch.ones(2, 2)
    view = dequantized_view({n: (lambda n=n: store[n]) for n in store})
    with pytest.raises(TensorMismatchError, match=r"q_a_proj\.weight_scale_inv: shape \(2, 2\)"):
        view["model.layers.0.self_attn.q_a_proj.weight"]()
