"""Engine-side FP8 checks (pull_protocol / sglang_loader): the trainer and the engine must agree on FP8, the scale
must be there with SGLang's shape, and every refusal leaves the engine's parameters untouched. The loaders run for
real here, on parameters shaped like an FP8 SGLang engine's (float8_e4m3fn weight + float32 weight_scale_inv)."""
import json

import numpy as np
import pytest
import torch

from mtrain.kernels import quantize_blocks
from mtrain.kernels.fp8 import FP8
from mtrain.rollout import sglang_loader as L
from mtrain.reshard import pull_protocol as P

W = "model.layers.0.self_attn.o_proj.weight"
E = "model.layers.0.mlp.experts.w13_weight"


def fp8_params():
    return {W: torch.zeros(256, 200, dtype=FP8), W + "_scale_inv": torch.full((2, 2), -1.0),
            E: torch.zeros(4, 256, 128, dtype=FP8), E + "_scale_inv": torch.full((4, 2, 1), -1.0),
            "model.norm.weight": torch.zeros(200, dtype=torch.bfloat16)}


def pull_payload(targets, rows, quant=None, sources=()):
    spec = {"table": "t/0/0", "sources": "s", "n_sources": len(sources), "finish": False, "targets": targets,
            "rows": rows}
    if quant is not None:
        spec["quant"] = quant
    return [(P.PULL_PREFIX + json.dumps(spec), torch.empty(0))] + [(P.SOURCE_NAME, s) for s in sources]


def untouched(params):
    return (params[W].view(torch.uint8) == 0).all() and (params[W + "_scale_inv"] == -1).all()


def test_pull_quantizes_into_the_engine_weight_and_scale():
    params = fp8_params()
    w = torch.randn(256, 200).to(torch.bfloat16)
    n = w.numel()
    P.run_pull(params, pull_payload([[W, [256, 200]]], [[0, 0, n, 0, n, 1, n, 0]],
                                    [[0, W + "_scale_inv", [2, 2], [128, 128]]], [w.view(-1)]), P.PullState())
    q, s = quantize_blocks(w)
    assert torch.equal(params[W].view(torch.uint8), q.view(torch.uint8)) and torch.equal(params[W + "_scale_inv"], s)


@pytest.mark.parametrize("quant, match", [
    (None, r"float8_e4m3fn in this engine \(an FP8 engine\) but the trainer's plan writes it unquantized"),
    ([[0, W + "_scale", [2, 2], [128, 128]]], r"no parameter '.*o_proj.weight_scale'"),
    ([[0, W + "_scale_inv", [2, 3], [128, 128]]], r"expected a contiguous float32 \(2, 3\) scale"),
    ([[0, W + "_scale_inv", [2, 2], [128]]], r"bad FP8 block"),
    ([[1, W + "_scale_inv", [2, 2], [128, 128]]], r"bad quant entry"),
    ("x", r"'quant' must be a list"),
])
def test_pull_fp8_disagreements_are_refused_with_nothing_written(quant, match):
    params = fp8_params()
    w = torch.randn(256 * 200).to(torch.bfloat16)
    with pytest.raises(L.LoaderError, match=match):
        P.run_pull(params, pull_payload([[W, [256, 200]]], [[0, 0, w.numel(), 0, w.numel(), 1, w.numel(), 0]],
                                        quant, [w]), P.PullState())
    assert untouched(params)


def test_pull_fp8_plan_into_a_bf16_engine_is_refused():
    params = {W: torch.zeros(256, 200, dtype=torch.bfloat16)}
    w = torch.randn(256 * 200).to(torch.bfloat16)
    with pytest.raises(L.LoaderError, match=r"quantizes it to FP8 but this engine holds it as torch.bfloat16"):
        P.run_pull(params, pull_payload([[W, [256, 200]]], [[0, 0, w.numel(), 0, w.numel(), 1, w.numel(), 0]],
                                        [[0, W + "_scale_inv", [2, 2], [128, 128]]], [w]), P.PullState())


def test_push_quantizes_whole_params_and_expert_row_ranges():
    params = fp8_params()
    w = torch.randn(256, 200).to(torch.bfloat16)
    experts = torch.randn(2, 256, 128).to(torch.bfloat16)
    norm = torch.randn(200).to(torch.bfloat16)
    L.apply_copies(L.plan_copies(params, [(W, w), (E + "@1:3", experts), ("model.norm.weight", norm)]), params)
    q, s = quantize_blocks(w)
    assert torch.equal(params[W].view(torch.uint8), q.view(torch.uint8)) and torch.equal(params[W + "_scale_inv"], s)
    qe, se = quantize_blocks(experts)
    assert torch.equal(params[E][1:3].view(torch.uint8), qe.view(torch.uint8))
    assert torch.equal(params[E + "_scale_inv"][1:3], se)
    assert (params[E][[0, 3]].view(torch.uint8) == 0).all() and (params[E + "_scale_inv"][[0, 3]] == -1).all()
    assert torch.equal(params["model.norm.weight"], norm)


def test_push_errors_name_the_parameter_and_write_nothing():
    params = fp8_params()
    del params[W + "_scale_inv"]
    with pytest.raises(L.LoaderError, match=r"o_proj.weight is float8_e4m3fn but the engine has no parameter"):
        L.plan_copies(params, [(W, torch.randn(256, 200).to(torch.bfloat16))])
    params = fp8_params()
    with pytest.raises(L.LoaderError, match=r"dtype torch.int16 does not match"):
        L.plan_copies(params, [(W, torch.zeros(256, 200, dtype=torch.int16))])
    # half a 128-row block of a 2-D weight cannot get its scale: refused before the first write
    params = fp8_params()
    params["x.weight"] = torch.zeros(256, 200, dtype=FP8)
    params["x.weight_scale_inv"] = torch.full((2, 2), -1.0)
    plan = L.plan_copies(params, [("x.weight@0:64", torch.randn(64, 200).to(torch.bfloat16))])
    with pytest.raises(L.LoaderError, match=r"block row 0, block col 0\) is written 8192 of 16384 elements"):
        L.apply_copies(plan, params)
    assert (params["x.weight_scale_inv"] == -1).all()
    assert np.all(params["x.weight"].view(torch.uint8).numpy() == 0)


def test_a_scale_sglang_requantized_to_ue8m0_is_refused_by_pull_and_push():
    """SGLang marks a scale it requantized for DeepGEMM (Blackwell) `format_ue8m0`: no amax/448 write may land."""
    from mtrain.layouts.fp8 import REQUANTIZED_MARK

    for how in ("pull", "push"):
        params = fp8_params()
        params[W + "_scale_inv"] = torch.nn.Parameter(params[W + "_scale_inv"], requires_grad=False)
        setattr(params[W + "_scale_inv"], REQUANTIZED_MARK, True)
        w = torch.randn(256, 200).to(torch.bfloat16)
        with pytest.raises(L.LoaderError, match=r"requantized this layer's scales to UE8M0"):
            if how == "pull":
                n = w.numel()
                P.run_pull(params, pull_payload([[W, [256, 200]]], [[0, 0, n, 0, n, 1, n, 0]],
                                                [[0, W + "_scale_inv", [2, 2], [128, 128]]], [w.view(-1)]),
                           P.PullState())
            else:
                L.apply_copies(L.plan_copies(params, [(W, w)]), params)
        assert untouched(params)
