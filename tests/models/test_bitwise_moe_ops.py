"""mtrain.kernels.bitwise_moe_ops: transformers' Qwen3-MoE semantics (which experts, their weights, the block's
output) and the properties both sides rely on (row independence, tie order, one fixed combination order)."""
from __future__ import annotations

import pytest
import torch

from mtrain.kernels import bitwise_moe_ops as moe_ops
from mtrain.kernels import bitwise_ops as ops
from mtrain.tiny_configs import numerics_config


def _hf_block(norm_topk_prob: bool):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cfg = Qwen3MoeConfig(**numerics_config("qwen3_moe", num_experts_per_tok=4, norm_topk_prob=norm_topk_prob))
    block = Qwen3MoeSparseMoeBlock(cfg).float()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    return cfg, block


def _experts(block):
    """expert(e, rows): the HF block's expert e (fused gate|up, down) by the bitwise ops."""
    return moe_ops.fused_experts(block.experts.gate_up_proj, block.experts.down_proj)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_block_is_transformers_qwen3_moe(norm_topk_prob):
    """The same experts as transformers' router, in its top-k order, and its block output to float32 rounding."""
    cfg, block = _hf_block(norm_topk_prob)
    x = torch.randn(40, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    expert = _experts(block)

    with torch.no_grad():
        _, hf_weights, hf_ids = block.gate(x)
        out, ids = moe_ops.moe(x, block.gate.weight, cfg.num_experts_per_tok, norm_topk_prob, expert)
        _, weights = moe_ops.route(ops.linear(x, block.gate.weight), cfg.num_experts_per_tok, norm_topk_prob)
        hf_out = block(x[None])[0]
    assert torch.equal(ids, hf_ids)
    torch.testing.assert_close(weights, hf_weights, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out, hf_out, rtol=1e-5, atol=1e-5)
    assert weights.dtype == torch.float32  # never rounded to the model dtype
    if norm_topk_prob:
        assert (weights.sum(-1) - 1).abs().max() < 1e-6


def test_rows_are_independent_and_ties_go_to_the_lower_id():
    """A token's route and output do not depend on the other tokens (a 1-token call gives the same bits); equal
    probabilities pick the lower expert id."""
    cfg, block = _hf_block(True)
    x = torch.randn(9, cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    expert = _experts(block)

    with torch.no_grad():
        out, ids = moe_ops.moe(x, block.gate.weight, 4, True, expert)
        for i in range(x.shape[0]):
            one, one_ids = moe_ops.moe(x[i:i + 1], block.gate.weight, 4, True, expert)
            assert torch.equal(one[0], out[i]) and torch.equal(one_ids[0], ids[i])
    tied = torch.tensor([[0.0, 2.0, 1.0, 2.0, 1.0, 2.0]])
    ids, weights = moe_ops.route(tied, 4, True)
    assert ids.tolist() == [[1, 3, 5, 2]]
    assert weights[0, 0] == weights[0, 1] == weights[0, 2]


def test_combine_adds_in_ascending_expert_id():
    """The weighted outputs are added by the fixed tree in ascending expert id, whatever the top-k rank order:
    permuting the k slots (ids with them) changes no bit, and the result is the explicit ascending-id tree."""
    gen = torch.Generator().manual_seed(3)
    y = torch.randn(64, 4, 16, generator=gen) * torch.tensor([1.0, 1e4, 1e-3, 3e2])[None, :, None]
    ids = torch.stack([torch.randperm(8, generator=gen)[:4] for _ in range(64)])
    w = torch.rand(64, 4, generator=gen)
    out = moe_ops.combine(y, ids, w)
    perm = torch.randperm(4, generator=gen)
    assert torch.equal(moe_ops.combine(y[:, perm], ids[:, perm], w[:, perm]), out)
    order = ids.argsort(dim=-1)
    terms = [torch.gather(y, 1, order[:, j, None, None].expand(-1, 1, 16))[:, 0]
             * torch.gather(w, 1, order[:, j, None]) for j in range(4)]
    assert torch.equal(out, (terms[0] + terms[1]) + (terms[2] + terms[3]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_expert_path_gives_the_same_bits(dtype):
    """The path CUDA-graph capture takes (every expert on every token, no host read of the routes) equals the
    chosen-experts path bit for bit, and so does its gradient (SGLang's decode graphs vs the trainer's eager pass)."""
    cfg, block = _hf_block(True)
    block = block.to(dtype)
    expert = _experts(block)
    x = torch.randn(23, cfg.hidden_size, generator=torch.Generator().manual_seed(3)).to(dtype)
    outs = []
    for every in (False, True):
        xi = x.clone().requires_grad_(True)
        out, ids = moe_ops.moe(xi, block.gate.weight, cfg.num_experts_per_tok, True, expert, every_expert=every)
        out.float().square().sum().backward()
        outs.append((out.detach(), ids, xi.grad))
    (a, ia, ga), (b, ib, gb) = outs
    assert torch.equal(ia, ib) and torch.equal(a.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                                               b.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))
    assert torch.equal(ga, gb)
