"""Packed micro-batches (train.max_tokens_per_micro_batch) against padded ones and against transformers.

The same heavy-tailed rollout batch is scored and trained both ways on one Actor: logprobs must agree with each
other and with transformers' own unpadded forward (float32), and for every algorithm's loss aggregation the
global loss and every gradient must agree, at TP1, TP2, PP2, PP2xVPP2, DP2 (token-balanced split) and EP2 (MoE);
at CP2 (packed only) logprobs equal transformers' and loss and gradients equal a TP1 run's.
"""
from __future__ import annotations

import pytest

from mtrain.dist import run_on_ranks

LP_TOL = 1e-5
GRAD_TOL = 1e-5

SLOW = pytest.mark.slow
LAYOUTS = {  # name: (ranks, parallel sizes, architecture); the default run keeps one of each kind of layout
    "tp1_llama": (1, {}, "llama"),
    "tp1_deepseek_v3": (1, {}, "deepseek_v3"),  # MLA + MoE with shared experts and expert bias
    "tp2_qwen3": (2, {"tp": 2}, "qwen3"),
    "pp2_llama": (2, {"pp": 2}, "llama"),
    "ep2_qwen3_moe": (2, {"ep": 2}, "qwen3_moe"),
    "tp1_qwen3_yarn": (1, {}, "qwen3_yarn"),  # rope_scaling yarn: per-token rows of its table when packed
    "tp1_qwen3_moe": pytest.param((1, {}, "qwen3_moe"), marks=SLOW),
    "pp2_vpp2_qwen3_moe": pytest.param((2, {"pp": 2, "vpp": 2}, "qwen3_moe"), marks=SLOW),
    "dp2_qwen2": pytest.param((2, {}, "qwen2"), marks=SLOW),  # token-balanced DP split vs equal counts
}


@pytest.mark.parametrize("case", list(LAYOUTS.values()), ids=list(LAYOUTS))
def test_packed_equals_padded_and_hf(tmp_path, case, request):
    import json

    from packing_worker import hf_logprobs, make_batch, run

    from mtrain.tiny_hf import write_tiny_hf
    world, layout, arch = case
    name = request.node.callspec.id
    hf = write_tiny_hf(arch, tmp_path / "hf", seed=3)
    ref = hf_logprobs(str(hf), make_batch(json.loads((hf / "config.json").read_text())["vocab_size"]))
    assert bool(ref.isfinite().all())
    results = run_on_ranks(run, world, str(hf), layout, ref, timeout=600)
    checked = 0
    for rank, res in enumerate(results):
        if not res["last"]:
            continue
        checked += 1
        assert res["lp_packed_vs_padded"] <= LP_TOL, (name, rank, res)
        assert res["lp_packed_vs_hf"] <= LP_TOL, (name, rank, res)
        assert res["lp_padded_vs_hf"] <= LP_TOL, (name, rank, res)
        for a in res["algos"]:
            assert abs(a["loss_packed"] - a["loss_padded"]) <= 1e-6 * max(1.0, abs(a["loss_padded"])), (name, a)
            assert a["grad_max_abs"] > 0, (name, a)  # a loss that trains something
            assert a["grad_max_abs_diff"] <= GRAD_TOL * max(1.0, a["grad_max_abs"]), (name, a)
    assert checked, "no last pipeline stage reported"


def test_context_parallel_cp2_equals_tp1(tmp_path):
    """CP2 (packed only): logprobs equal transformers', and loss and every gradient equal a TP1 run's."""
    import json

    from packing_worker import hf_logprobs, make_batch, run

    from mtrain.tiny_hf import write_tiny_hf
    hf = write_tiny_hf("qwen3", tmp_path / "hf", seed=3)
    ref = hf_logprobs(str(hf), make_batch(json.loads((hf / "config.json").read_text())["vocab_size"]))
    base = run_on_ranks(run, 1, str(hf), {}, ref, True, timeout=600)[0]
    per_rank = run_on_ranks(run, 2, str(hf), {"cp": 2}, ref, True, timeout=600)
    for rank, res in enumerate(per_rank):
        assert res["last"] and res["lp_packed_vs_hf"] <= LP_TOL, (rank, res["lp_packed_vs_hf"])
        for a, b in zip(res["algos"], base["algos"]):
            assert abs(a["loss_packed"] - b["loss_packed"]) <= 1e-6 * max(1.0, abs(b["loss_packed"])), (rank, a["algo"])
            diff = max(float(abs(a["grads_packed"][k] - b["grads_packed"][k]).max()) for k in b["grads_packed"])
            assert diff <= GRAD_TOL * max(1.0, b["grad_max_abs"]), (rank, a["algo"], diff)
