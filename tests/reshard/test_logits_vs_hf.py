"""A tiny random model built with transformers' own classes, loaded into Megatron-core through the layout
tables at TP1 / TP2 / PP2 / EP2, gives transformers' logits within float32 tolerance (1e-4 relative)."""
import pytest
import torch

from mtrain.dist import run_on_ranks
from mtrain.tiny_configs import tiny_config

CASES = [
    ("llama", dict(tp=1), 1), ("llama", dict(tp=2), 2), ("llama", dict(pp=2), 2),
    ("mistral", dict(tp=2), 2),
    ("qwen2", dict(tp=2), 2), ("qwen2", dict(pp=2), 2),
    ("qwen3", dict(tp=2), 2),
    ("qwen3_moe", dict(tp=1), 1), ("qwen3_moe", dict(ep=2), 2), ("qwen3_moe", dict(tp=2), 2),
    ("deepseek_v3", dict(tp=1), 1), ("deepseek_v3", dict(ep=2), 2), ("deepseek_v3", dict(tp=2), 2),
    ("deepseek_v3_no_qlora", dict(tp=2), 2),
]


def hf_model_and_state(arch: str, seed: int = 0):
    from transformers import AutoConfig, AutoModelForCausalLM
    from mtrain.rollout.reference_engine import hf_disk_views
    cfg = tiny_config(arch)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg), torch_dtype=torch.float32).eval()
    with torch.no_grad():  # transformers initialises norms to 1 and biases to 0: randomise them too
        for n, p in model.named_parameters():
            if p.dim() == 1:
                p.normal_(1.0 if "norm" in n else 0.0, 0.1)
    state = {k: v.detach().clone() for k, v in hf_disk_views(model).items()}
    return cfg, model, state


def _megatron_logits(rank, world, cfg, state, par, tokens):
    from mtrain.dist import init_distributed
    from mtrain.layouts import model_layout
    from mtrain.models import build_model, forward_logits
    from mtrain.reshard.megatron_side import load_hf_into_megatron
    init_distributed(**par)
    chunks, _ = build_model(cfg, params_dtype=torch.float32)
    load_hf_into_megatron(model_layout(cfg, mtp=False), chunks, lambda n: state[n], rank)
    out = forward_logits(chunks, tokens)
    return None if out is None else out.detach()


@pytest.mark.parametrize("arch, par, world", CASES, ids=[f"{a}-{'-'.join(f'{k}{v}' for k, v in p.items())}"
                                                         for a, p, _ in CASES])
def test_megatron_logits_equal_transformers(arch, par, world):
    cfg, model, state = hf_model_and_state(arch)
    cfg = dict(cfg, num_nextn_predict_layers=0)  # transformers' DeepseekV3 has no MTP layers
    tokens = torch.randint(0, cfg["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(tokens).logits.float()
    outs = run_on_ranks(_megatron_logits, world, cfg, state, par, tokens, timeout=600)
    got = [o for o in outs if o is not None]
    assert got, "no rank returned logits"
    for g in got:
        assert g.shape == want.shape
        err = (g - want).abs().max() / want.abs().max()
        assert err < 1e-4, f"{arch} {par}: max relative logit error {err:.2e}"
