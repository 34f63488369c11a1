"""A synthetic image batch for a Qwen2.5-VL config: rows of text with image placeholders of several sizes and
random pixel values (the model does not care where pixels come from). `verify`, the tests and the GPU benchmark
compare Megatron against transformers on it; no image files or processor needed."""
from __future__ import annotations

import torch

from mtrain.layouts.vlm import flat_config
from mtrain.models.mrope import mrope_position_ids

# (t, h, w) patch grids per row: 4x6 -> 6 tokens, 8x4 -> 8, 4x4 -> 4 with spatial merge 2
DEFAULT_GRIDS = ([(1, 4, 6)], [(1, 8, 4), (1, 4, 4)])


def probe_batch(cfg: dict, grids=DEFAULT_GRIDS, seed: int = 2, vocab_hi: int | None = None) -> dict:
    """tokens [B, S] (text, then per image <vision_start> placeholders <vision_end> and text; rows filled to one
    length with text), pixel_values [patches, C*T*P*P], image_grid_thw [N, 3], mm_token_type_ids [B, S] (what
    transformers needs to place images), position_ids [3, B, S] (ours). Text ids are drawn below the smallest
    special id (or `vocab_hi`)."""
    cfg = flat_config(cfg)
    g = torch.Generator().manual_seed(seed)
    vc = cfg["vision_config"]
    merge = vc.get("spatial_merge_size", 2)
    patch_dim = vc.get("in_channels", 3) * vc.get("temporal_patch_size", 2) * vc.get("patch_size", 14) ** 2
    specials = [cfg[k] for k in ("image_token_id", "vision_start_token_id", "vision_end_token_id") if k in cfg]
    hi = vocab_hi or min(specials + [cfg["vocab_size"]])
    lo = min(3, hi - 1)

    def text(n):
        return torch.randint(lo, hi, (n,), generator=g).tolist()

    start = [cfg["vision_start_token_id"]] if "vision_start_token_id" in cfg else []
    end = [cfg["vision_end_token_id"]] if "vision_end_token_id" in cfg else []
    rows, all_grids = [], []
    for row_grids in grids:
        ids = text(3)
        for t, h, w in row_grids:
            ids += start + [cfg["image_token_id"]] * (t * h * w // merge ** 2) + end + text(2)
            all_grids.append((t, h, w))
        rows.append(ids)
    s = max(len(r) for r in rows) + 2
    tokens = torch.stack([torch.tensor(r + text(s - len(r))) for r in rows])
    grid = torch.tensor(all_grids, dtype=torch.long).reshape(-1, 3)
    pixels = torch.randn(int(grid.prod(-1).sum()), patch_dim, generator=g)
    return dict(tokens=tokens, pixel_values=pixels, image_grid_thw=grid,
                mm_token_type_ids=(tokens == cfg["image_token_id"]).int(),
                position_ids=mrope_position_ids(tokens, grid, cfg["image_token_id"], merge))
