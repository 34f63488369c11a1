"""model.fp32_lm_head: the output layer of a bf16 Megatron model computes its logits in float32 (tied head too),
checked against float64 math from the same bf16 weights; gradients still reach the bf16 parameters."""
from __future__ import annotations

import torch

from mtrain.dist import run_on_ranks


def _check(rank: int, world: int) -> dict:
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron.core.transformer import TransformerConfig

    from mtrain.dist import init_distributed
    from mtrain.models.fp32_head import install_fp32_lm_head
    init_distributed(seed=3)
    cfg = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, params_dtype=torch.bfloat16,
                            bf16=True, use_cpu_initialization=True)

    class Chunk(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.output_layer = ColumnParallelLinear(64, 96, config=cfg, init_method=torch.nn.init.normal_,
                                                     bias=False, gather_output=False)

    torch.manual_seed(0)
    chunk = Chunk()
    x = torch.randn(5, 2, 64).to(torch.bfloat16)
    plain, _ = chunk.output_layer(x)
    hooked = install_fp32_lm_head([chunk, torch.nn.Identity()])
    w = chunk.output_layer.weight
    ref = x.double() @ w.detach().double().t()
    out, _ = chunk.output_layer(x)
    tied = torch.randn(96, 64).to(torch.bfloat16)
    out_tied, _ = chunk.output_layer(x, weight=tied)
    ref_tied = x.double() @ tied.double().t()
    chunk.output_layer(x)[0].float().pow(2).sum().backward()
    return {"hooked": hooked, "plain_dtype": plain.dtype, "dtype": out.dtype, "tied_dtype": out_tied.dtype,
            "rel": float((out.double() - ref).norm() / ref.norm()),
            "rel_bf16": float((plain.double() - ref).norm() / ref.norm()),
            "rel_tied": float((out_tied.double() - ref_tied).norm() / ref_tied.norm()),
            "grad_dtype": None if w.grad is None else w.grad.dtype,
            "grad_abs": 0.0 if w.grad is None else float(w.grad.abs().sum())}


def test_output_layer_logits_are_float32_products_of_the_bf16_weights():
    r = run_on_ranks(_check, 1)[0]
    assert r["hooked"] == 1 and r["plain_dtype"] == torch.bfloat16
    assert r["dtype"] == torch.float32 and r["tied_dtype"] == torch.float32
    # float32 accumulation of the bf16 values is exact to float32 rounding; the bf16 head is not
    assert r["rel"] < 1e-6 and r["rel_tied"] < 1e-6 and r["rel_bf16"] > 1e-4
    assert r["grad_dtype"] == torch.bfloat16 and r["grad_abs"] > 0  # gradients reach the bf16 parameter
