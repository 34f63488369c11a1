"""Multimodal RoPE positions (Qwen2-VL / Qwen2.5-VL) of one sequence, from its ids and its VisionInputs.

Each position is a triple (temporal, height, width). Text tokens advance all three together: p, p+1, ... An image
of grid (t, h, w) patches becomes t * (h/m) * (w/m) tokens (m = merge size) whose triples are (p + i_t, p + i_h,
p + i_w) over the merged grid; the text after it starts at one past the largest position used. The rope delta
(max position + 1 - length) continues the sequence while decoding: token k >= length sits at k + delta on all three.

The trainer needs these for every row of a batch (Megatron's MultimodalRotaryEmbedding takes [3, B, S]); they
depend only on the row's tokens and grids, so they are computed here instead of inside a model. Tested equal to
transformers' `Qwen2_5_VLModel.get_rope_index` (tests/data/test_mrope.py). Still images only (no videos).
"""
from __future__ import annotations

from typing import Sequence

import torch

from mtrain.data.vision import VisionError, VisionInputs


def mrope_positions(ids: Sequence[int] | torch.Tensor, vision: VisionInputs | None) -> tuple[torch.Tensor, int]:
    """([3, len(ids)] int64 positions, rope delta) of one sequence (prompt, or prompt + response).

    Without vision the positions are 0, 1, 2, ... on all three axes and the delta is 0. Raises VisionError when the
    image token runs do not match the grids (the same check engines make)."""
    ids = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
    n = len(ids)
    if vision is None:
        return torch.arange(n).view(1, -1).expand(3, -1).clone(), 0
    vision.check_ids(ids, what="mrope_positions")
    m = vision.merge_size
    grids = iter(vision.image_grid_thw.tolist())
    out = torch.empty((3, n), dtype=torch.long)
    cur, i = 0, 0
    while i < n:
        if ids[i] != vision.image_token_id:
            j = i
            while j < n and ids[j] != vision.image_token_id:
                j += 1
            out[:, i:j] = torch.arange(cur, cur + j - i)
            cur += j - i
            i = j
            continue
        t, h, w = next(grids)
        gh, gw = h // m, w // m
        k = t * gh * gw
        tt = torch.arange(t).repeat_interleave(gh * gw)
        hh = torch.arange(gh).repeat_interleave(gw).repeat(t)
        ww = torch.arange(gw).repeat(t * gh)
        block = torch.stack([tt, hh, ww]) + cur
        out[:, i:i + k] = block
        cur = int(block.max()) + 1
        i += k
    return out, int(out.max()) + 1 - n if n else 0


def batch_mrope_positions(tokens: torch.Tensor, seq_lens: torch.Tensor,
                          vision: Sequence[VisionInputs | None] | None) -> torch.Tensor:
    """[3, B, T] positions of a padded batch (RolloutBatch.tokens, .seq_lens, .vision.items): each row's own
    positions over its seq_len tokens; padding continues the row's text positions (it is masked anyway)."""
    b, t = tokens.shape
    if vision is not None and len(vision) != b:
        raise VisionError(f"batch_mrope_positions: {b} rows but {len(vision)} vision entries")
    out = torch.empty((3, b, t), dtype=torch.long)
    for r in range(b):
        n = int(seq_lens[r])
        pos, delta = mrope_positions(tokens[r, :n], None if vision is None else vision[r])
        out[:, r, :n] = pos
        out[:, r, n:] = torch.arange(n, t) + delta
    return out
