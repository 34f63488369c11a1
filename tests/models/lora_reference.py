"""Test-only: a PEFT LoRA model on the seeded tiny HF model, adapters nonzero, and its tensors by plain HF/PEFT names.

PEFT initializes B = 0 (the adapter starts as a no-op); a numerics check needs every A and B random, so a wrong
slice, scale or row order shows up.
"""
from __future__ import annotations

import torch

PEFT_MODULES = {"qkv": ["q_proj", "k_proj", "v_proj"], "o_proj": ["o_proj"], "gate_up": ["gate_proj", "up_proj"],
                "down": ["down_proj"]}


def make_peft_model(hf_config: dict, targets, rank: int, alpha: float, seed: int = 0):
    import peft
    from hf_reference import make_hf_model

    hf = make_hf_model(hf_config, seed)
    mods = sorted({m for t in targets for m in PEFT_MODULES[t]})
    model = peft.get_peft_model(hf, peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=mods, lora_dropout=0.0))
    gen = torch.Generator().manual_seed(seed + 11)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    return model.eval()


def plain_name(peft_name: str) -> str:
    """PEFT's in-memory name -> the HF/PEFT-file name the layout tables use (no base_model.model., no .default)."""
    n = peft_name.removeprefix("base_model.model.").replace(".base_layer.", ".")
    return n.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B.")


def plain_state(model, grads: bool = False) -> dict[str, torch.Tensor]:
    out = {}
    for n, p in model.named_parameters():
        t = p.grad if grads else p.detach()
        if t is not None:
            out[plain_name(n)] = t.detach().clone()
    return out
