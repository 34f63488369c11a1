"""LoRA on Megatron-core equals PEFT + transformers: logits and every adapter gradient (float32, <= 1e-5).

Llama (tied embeddings) and Qwen3 (qk-norm, untied) at TP1, TP2 and PP2 (2 spawned ranks, gloo, torchrun's
variables). The HF side is PEFT's own LoraLayer on transformers' model with random A and B; the Megatron side
loads the same base and adapter tensors through the layout tables (mtrain/layouts/lora.py) and runs megatron-core's
schedule. Gradients: loss = sum(logits * R) with a fixed random R; each rank's adapter shard is compared with the
matching rectangle of PEFT's full gradient.
"""
from __future__ import annotations

import pytest
import torch

from mtrain.dist import run_on_ranks

TOL = 1e-5
TARGETS = ("qkv", "o_proj", "gate_up", "down")
RANK, ALPHA = 4, 8.0


def _tokens() -> torch.Tensor:
    return torch.randint(0, 250, (2, 9), generator=torch.Generator().manual_seed(3))


def _megatron_grads(chunks, tokens, weights_full: torch.Tensor):
    """Backward of sum(logits * R) through megatron-core's schedule (any PP); logits on the last stage."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    b, s = tokens.shape
    tp, tpr = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    pos = torch.arange(s).unsqueeze(0).expand(b, s).contiguous()
    got = {}

    def step(it, model):
        out = model(next(it), pos, attention_mask=None)

        def loss(o):
            local = o.shape[-1]
            r = torch.zeros(b, s, local * tp)
            r[..., : weights_full.shape[-1]] = weights_full
            got["logits"] = o.detach()
            return (o.float() * r[..., tpr * local : (tpr + 1) * local]).sum(), {}
        return out, loss

    for c in chunks:
        c.eval()
    get_forward_backward_func()(forward_step_func=step, data_iterator=iter([tokens]), model=chunks[0],
                                num_microbatches=1, seq_length=s, micro_batch_size=b, forward_only=False)


def _compare(rank: int, world: int, arch: str, layout: dict) -> dict:
    import sys

    from megatron.core import parallel_state as ps

    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from lora_reference import make_peft_model, plain_state

    from mtrain.dist import init_distributed
    from mtrain.layouts import model_layout
    from mtrain.layouts.lora import LoraSpec, with_adapters
    from mtrain.models import build_model, forward_logits
    from mtrain.models.lora import _shard, attach_lora
    from mtrain.reshard.megatron_side import current_layout, load_hf_into_megatron, unwrap
    from mtrain.tiny_configs import numerics_config

    init_distributed(**layout)
    cfg = numerics_config(arch)
    spec = LoraSpec(RANK, ALPHA, TARGETS)
    peft_model = make_peft_model(cfg, TARGETS, RANK, ALPHA)
    hf_tensors = plain_state(peft_model)
    chunks, _ = build_model(cfg)
    table = attach_lora(chunks, cfg, spec)
    full = with_adapters(model_layout(cfg, mtp=False), spec)
    load_hf_into_megatron(full, chunks, hf_tensors.__getitem__, rank)
    tokens = _tokens()
    out = {}
    logits = forward_logits(chunks, tokens)
    ref = peft_model(tokens).logits
    if logits is not None:
        out["logits"] = float((logits - ref).abs().max())
    # gradients
    # scaled so the gradients are O(1): the tolerance is absolute
    r = 0.01 * torch.randn(ref.shape, generator=torch.Generator().manual_seed(5))
    (ref * r).sum().backward()
    hf_grads = plain_state(peft_model, grads=True)
    _megatron_grads(chunks, tokens, r)
    params = [dict(unwrap(c).named_parameters()) for c in chunks]
    trainable = [n for p in params for n, t in p.items() if t.requires_grad]
    out["only_adapters_trainable"] = all(".lora." in n for n in trainable) and bool(trainable)
    worst, n = 0.0, 0
    for w in table.weights:
        for h in current_layout().holders(table, w):
            if h.rank != rank:
                continue
            g = params[h.chunk][h.name].grad
            want = _shard(hf_grads[w.hf[0].name].reshape(w.shape2d), w.megatron[0].rule, h.rule_rank, h.rule_world)
            worst = max(worst, float((g - want).abs().max()))
            n += 1
    out["grad"], out["n_grads"] = worst, n
    out["grad_scale"] = max(float(g.abs().max()) for k, g in hf_grads.items() if ".lora_" in k)
    return out


# default run: one TP1 and one TP2 case (a LoRA model at PP2 trains in the default run's tests/trainer/
# test_loop_lora.py); every case, PP2 against PEFT included, with MTRAIN_SLOW=1
_SLOW = pytest.mark.slow
CASES = [pytest.param("llama", 1, {}, marks=_SLOW, id="llama-tp1"), pytest.param("qwen3", 1, {}, id="qwen3-tp1"),
         pytest.param("llama", 2, {"tp": 2}, id="llama-tp2"), pytest.param("qwen3", 2, {"tp": 2}, marks=_SLOW, id="qwen3-tp2"),
         pytest.param("llama", 2, {"pp": 2}, marks=_SLOW, id="llama-pp2"), pytest.param("qwen3", 2, {"pp": 2}, marks=_SLOW, id="qwen3-pp2")]


@pytest.mark.parametrize("arch,world,layout", CASES)
def test_lora_matches_peft(arch, world, layout):
    results = run_on_ranks(_compare, world, arch, layout, timeout=600)
    assert any("logits" in r for r in results)
    for r in results:
        if "logits" in r:
            assert r["logits"] <= TOL, r
        assert r["only_adapters_trainable"], r
        assert r["n_grads"] > 0, r
        assert r["grad_scale"] > 0.1, r  # the gradients compared are not all tiny
        assert r["grad"] <= TOL, r
