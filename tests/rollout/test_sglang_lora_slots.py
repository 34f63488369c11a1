"""The direct LoRA loader's plan (mtrain/rollout/sglang_lora_loader.py) on the adapter table's names, CPU only.

Checks: every adapter row lands in exactly one (layer, SGLang pool key, A|B) stack, parts in SGLang's order; the
stacked slot computes each HF linear's own delta (for SGLang's segment kernels: output rows of part i use A rows
[i r, (i+1) r)), i.e. B_stack[rows_i] @ A_stack[i r:(i+1) r] == B_i @ A_i, float64; expert adapters and
incomplete stacks are refused with the name.
"""
from __future__ import annotations

import pytest
import torch

from mtrain.layouts import model_layout
from mtrain.layouts.lora import LoraSpec, lora_layout
from mtrain.rollout.sglang_lora_loader import STACKED, SlotPlanError, slot_plan
from mtrain.tiny_configs import tiny_config

R = 4


def _table(arch, targets=("qkv", "o_proj", "gate_up", "down")):
    return lora_layout(model_layout(dict(tiny_config(arch), num_nextn_predict_layers=0), mtp=False),
                       LoraSpec(R, 8.0, targets))


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_stacked_slots_compute_each_linears_delta(arch):
    table = _table(arch)
    g = torch.Generator().manual_seed(0)
    t = {w.hf[0].name: torch.randn(w.shape, generator=g, dtype=torch.float64) for w in table.weights}
    plan = slot_plan(list(t))
    assert sorted(n for names in plan.values() for n in names) == sorted(t)  # each row once
    layers = {k[0] for k in plan}
    assert {(key, ab) for (_, key, ab) in plan} == {(k, ab) for k in ("qkv_proj", "gate_up_proj", "o_proj",
                                                                       "down_proj") for ab in ("lora_A", "lora_B")}
    for layer in layers:
        for key in ("qkv_proj", "gate_up_proj", "o_proj", "down_proj"):
            a_names, b_names = plan[(layer, key, "lora_A")], plan[(layer, key, "lora_B")]
            assert [STACKED[n.split(".")[-3]][1] for n in a_names] == list(range(len(a_names)))
            a_stack = torch.cat([t[n] for n in a_names], 0)
            b_stack = torch.cat([t[n] for n in b_names], 0)
            row = 0
            for i, (an, bn) in enumerate(zip(a_names, b_names)):
                assert an.replace("lora_A", "lora_B") == bn
                rows = t[bn].shape[0]
                got = b_stack[row:row + rows] @ a_stack[i * R:(i + 1) * R]
                assert torch.allclose(got, t[bn] @ t[an], rtol=0, atol=1e-12)
                row += rows


def test_expert_adapters_and_partial_stacks_are_refused():
    names = [w.hf[0].name for w in _table("qwen3_moe", ("experts",)).weights]
    with pytest.raises(SlotPlanError, match="experts.*no dense LoRA slot"):
        slot_plan(names)
    dense = [w.hf[0].name for w in _table("llama").weights]
    no_k = [n for n in dense if ".k_proj." not in n]
    with pytest.raises(SlotPlanError, match="qkv_proj lora_A: parts \\[0, 2\\] of 3"):
        slot_plan(no_k)
    with pytest.raises(SlotPlanError, match="given twice"):
        slot_plan(dense + ["base_model.model." + dense[0]])
