"""Multimodal RoPE positions (Qwen2-VL / Qwen2.5-VL) of one sequence or a padded batch, from ids and VisionInputs.

One implementation: `mtrain.models.mrope.mrope_position_ids` (tested equal to transformers' get_rope_index,
tests/models/test_vlm_numerics.py and tests/data/test_mrope.py); these are its per-sequence / VisionInputs forms.
Each position is a triple (temporal, height, width); the rope delta (max position + 1 - length) continues the
sequence while decoding: token k >= length sits at k + delta on all three axes. Still images only (no videos).
"""
from __future__ import annotations

from typing import Sequence

import torch

from mtrain.data.vision import VisionError, VisionInputs
from mtrain.models.mrope import mrope_position_ids


def mrope_positions(ids: Sequence[int] | torch.Tensor, vision: VisionInputs | None,
                    prompt_len: int | None = None) -> tuple[torch.Tensor, int]:
    """([3, len(ids)] int64 positions, rope delta) of one sequence (prompt, or prompt + response).

    prompt_len: images live in the first prompt_len ids; image token ids after them (a sampled <|image_pad|>) are
    text, as the engines treat them (default: all of ids is the prompt). Raises VisionError when the prompt's image
    token runs do not match the grids (the same check engines make)."""
    ids = torch.as_tensor(ids if isinstance(ids, torch.Tensor) else list(ids), dtype=torch.long).reshape(1, -1)
    n = ids.shape[1]
    p = n if prompt_len is None else prompt_len
    if vision is not None:
        vision.check_ids(ids[0, :p].tolist(), what="mrope_positions")
    pos = mrope_position_ids(ids, None if vision is None else vision.image_grid_thw,
                             -1 if vision is None else vision.image_token_id,
                             2 if vision is None else vision.merge_size, prompt_lens=[p])[:, 0]
    return pos, (int(pos.max()) + 1 - n if n else 0)


def batch_mrope_positions(tokens: torch.Tensor, seq_lens: torch.Tensor, vision: Sequence[VisionInputs | None] | None,
                          prompt_lens: torch.Tensor | None = None) -> torch.Tensor:
    """[3, B, T] positions of a padded batch (RolloutBatch.tokens, .seq_lens, .vision.items, and prompt_lens =
    seq_lens - response_lens): each row's own positions over its seq_len tokens; padding continues the row's text
    positions (it is masked anyway)."""
    b, t = tokens.shape
    if vision is not None and len(vision) != b:
        raise VisionError(f"batch_mrope_positions: {b} rows but {len(vision)} vision entries")
    out = torch.empty((3, b, t), dtype=torch.long)
    for r in range(b):
        n = int(seq_lens[r])
        pos, delta = mrope_positions(tokens[r, :n], None if vision is None else vision[r],
                                     None if prompt_lens is None else int(prompt_lens[r]))
        out[:, r, :n] = pos
        out[:, r, n:] = torch.arange(n, t) + delta
    return out
