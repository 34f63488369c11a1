"""Test helpers for Qwen2.5-VL: transformers' own model at random (every weight, norms and biases included), its
on-disk state, and a batch of rows with images of different sizes (random pixel values: the model does not care
where pixels come from) plus what transformers needs to place them (mm_token_type_ids)."""
from __future__ import annotations

import torch

from mtrain.tiny_configs import tiny_config

# (t, h, w) patch grids: 4x6 -> 6 tokens, 8x4 -> 8, 4x4 -> 4 (spatial merge 2)
GRIDS = [[(1, 4, 6)], [(1, 8, 4), (1, 4, 4)]]


def hf_vlm(arch: str = "qwen2_5_vl", seed: int = 0, attn: str = "eager"):
    from transformers import AutoConfig, Qwen2_5_VLForConditionalGeneration
    from mtrain.rollout.reference_engine import hf_disk_views
    cfg = tiny_config(arch)
    hf_cfg = AutoConfig.for_model(**cfg)
    hf_cfg._attn_implementation = attn
    hf_cfg.vision_config._attn_implementation = attn
    hf_cfg.text_config._attn_implementation = attn
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(hf_cfg).float().eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith(("norm.weight", "norm1.weight", "norm2.weight", "ln_q.weight")):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif n.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.08 * torch.randn(p.shape, generator=g))
    state = {k: v.detach().clone() for k, v in hf_disk_views(model).items()}
    return cfg, model, state


def image_batch(cfg: dict, grids=GRIDS, seed: int = 2):
    """(tokens, pixel_values, image_grid_thw, mm_token_type_ids) of mtrain.models.vlm_probe.probe_batch."""
    from mtrain.models.vlm_probe import probe_batch
    b = probe_batch(cfg, grids=grids, seed=seed)
    return b["tokens"], b["pixel_values"], b["image_grid_thw"], b["mm_token_type_ids"]
