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
    """tokens [B, S] (text, then per image <vision_start> placeholders <vision_end>, then text; rows padded to one
    length with text), pixel_values [patches, 3*2*14*14], image_grid_thw [N, 3], mm_token_type_ids [B, S]."""
    g = torch.Generator().manual_seed(seed)
    vc = cfg["vision_config"]
    merge, patch_dim = vc["spatial_merge_size"], 3 * vc["temporal_patch_size"] * vc["patch_size"] ** 2
    text_hi = min(cfg["image_token_id"], cfg["vision_start_token_id"], cfg["vision_end_token_id"])
    rows, all_grids = [], []
    for row_grids in grids:
        ids = torch.randint(3, text_hi, (3,), generator=g).tolist()
        for t, h, w in row_grids:
            ids += [cfg["vision_start_token_id"]] + [cfg["image_token_id"]] * (t * h * w // merge ** 2)
            ids += [cfg["vision_end_token_id"]] + torch.randint(3, text_hi, (2,), generator=g).tolist()
            all_grids.append((t, h, w))
        rows.append(ids)
    s = max(len(r) for r in rows) + 2
    tokens = torch.stack([torch.tensor(r + torch.randint(3, text_hi, (s - len(r),), generator=g).tolist())
                          for r in rows])
    grid = torch.tensor(all_grids, dtype=torch.long)
    pixels = torch.randn(int(grid.prod(-1).sum()), patch_dim, generator=g)
    return tokens, pixels, grid, (tokens == cfg["image_token_id"]).int()
