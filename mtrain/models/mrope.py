"""Qwen2.5-VL's multimodal RoPE position ids ([3, B, S]: temporal, height, width), our own statement of
transformers' `Qwen2_5_VLModel.get_rope_index` for images (tests/models/test_vlm_numerics.py compares them).

A text token advances all three positions by one. An image of grid (t, h, w) patches becomes t*(h/m)*(w/m)
placeholder tokens (m = spatial_merge_size); the image's tokens, in order, get temporal index `start + frame`,
height `start + row`, width `start + col` (start = the position after the text before it), and the text after it
starts at `start + max(h/m, w/m)` (for an image t = 1 patch frame; transformers' images never space frames out).
Images are consumed in order: a run of placeholder tokens may hold several images back to back. Only the prompt
holds images: a placeholder id the model generated (`prompt_lens`) is a text token, as the engines treat it.
"""
from __future__ import annotations

import torch


class ImageTokenError(ValueError):
    """Placeholder tokens and image grids do not agree (names the row and the counts)."""


def image_token_counts(grid_thw: torch.Tensor, merge: int) -> list[int]:
    """Placeholder tokens per image: t * (h/m) * (w/m)."""
    g = torch.as_tensor(grid_thw).reshape(-1, 3).tolist()
    return [t * (h // merge) * (w // merge) for t, h, w in g]


def image_mask(tokens: torch.Tensor, image_token_id: int, prompt_lens=None) -> torch.Tensor:
    """[B, S] bool: the image placeholders of each row's prompt (all of them when prompt_lens is None)."""
    mask = tokens == image_token_id
    if prompt_lens is not None:
        mask &= torch.arange(tokens.shape[1]).unsqueeze(0) < torch.as_tensor(prompt_lens).reshape(-1, 1)
    return mask


def mrope_position_ids(tokens: torch.Tensor, grid_thw: torch.Tensor | None, image_token_id: int, merge: int,
                       lengths: torch.Tensor | list[int] | None = None,
                       prompt_lens: torch.Tensor | list[int] | None = None) -> torch.Tensor:
    """[3, B, S] position ids of `tokens` [B, S]. `grid_thw` [N, 3]: the images of all rows, row by row, in the
    order their placeholders appear. `lengths` [B]: real tokens per row (the rest is right padding, which continues
    the text positions: causal attention never lets a real token see it). `prompt_lens` [B]: placeholders are
    looked for before these positions only (default: anywhere)."""
    if tokens.dim() != 2:
        raise ValueError(f"tokens must be [batch, seq], got shape {tuple(tokens.shape)}")
    b, s = tokens.shape
    counts = image_token_counts(grid_thw, merge) if grid_thw is not None and len(grid_thw) else []
    grids = torch.as_tensor(grid_thw).reshape(-1, 3).tolist() if counts else []
    out = torch.empty(3, b, s, dtype=torch.long)
    img = 0
    is_image = image_mask(tokens, image_token_id, prompt_lens).tolist()
    for r in range(b):
        n = int(lengths[r]) if lengths is not None else s
        row = is_image[r]
        pos = torch.empty(3, s, dtype=torch.long)
        i, cur = 0, 0
        while i < n:
            if not row[i]:
                j = i
                while j < n and not row[j]:
                    j += 1
                pos[:, i:j] = torch.arange(cur, cur + j - i)
                cur += j - i
                i = j
                continue
            if img >= len(counts):
                raise ImageTokenError(f"row {r}: image placeholder tokens at position {i} but only {len(counts)} "
                                      f"image grid(s) were given")
            t, h, w = grids[img]
            k = counts[img]
            if i + k > n or not all(row[i:i + k]):
                raise ImageTokenError(f"row {r}: image {img} (grid {t}x{h}x{w}) needs {k} placeholder tokens at "
                                      f"position {i}; the row has fewer there")
            hh, ww = h // merge, w // merge
            frame = torch.arange(t).repeat_interleave(hh * ww)
            height = torch.arange(hh).repeat_interleave(ww).repeat(t)
            width = torch.arange(ww).repeat(hh * t)
            pos[:, i:i + k] = torch.stack([frame, height, width]) + cur
            cur += max(hh, ww)
            img += 1
            i += k
        pos[:, n:] = torch.arange(cur, cur + s - n)
        out[:, r] = pos
    if img != len(counts):
        raise ImageTokenError(f"{len(counts)} image grid(s) given but the rows hold placeholders for {img}")
    return out
