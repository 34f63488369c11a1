"""Requests with images in the CPU reference engine: the checks before any work, and the prefill's vision inputs.

Kept apart from reference_engine.py (the engine's life cycle, weights and decoding loop); SGLang's side is
`sglang_wire.sglang_image_data`. Docs: docs/design-vlm-data.md.
"""
from __future__ import annotations

from typing import Any

import torch

from mtrain.rollout.protocol import EngineError, Request


def check_vision_request(req: Request, image_token_id: int | None, model_type: str) -> None:
    """EngineError unless the request's images fit the model: images only for a vision model (image_token_id not
    None), a VisionInputs of the model's image token, and the prompt's image token runs exactly as the processor
    expanded them; image tokens in a prompt without images are refused too (they would be embedded as text)."""
    if req.vision is None:
        if image_token_id is not None and image_token_id in req.prompt_ids:
            raise EngineError(f"generate: request {req.rid!r} has image tokens ({image_token_id}) in its prompt but "
                              f"no vision inputs")
        return
    from mtrain.data.vision import VisionError, VisionInputs
    if image_token_id is None:
        raise EngineError(f"generate: request {req.rid!r} carries images but the model ({model_type}) has no "
                          f"vision tower")
    if not isinstance(req.vision, VisionInputs):
        raise EngineError(f"generate: request {req.rid!r}: vision must be a VisionInputs, got "
                          f"{type(req.vision).__name__}")
    if req.vision.image_token_id != image_token_id:
        raise EngineError(f"generate: request {req.rid!r}: vision inputs use image token {req.vision.image_token_id}, "
                          f"the model {image_token_id}")
    try:
        req.vision.check_ids(req.prompt_ids, what=f"request {req.rid!r}")
    except VisionError as e:
        raise EngineError(f"generate: {e}") from None


def vision_prefill(model: Any, reqs: list[Request], input_ids: torch.Tensor
                   ) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    """For a prefill of equal-length rows of a transformers image-text model: its vision arguments (every row's
    pixel values and grids, in row order: the tower's output rows fill the image tokens in order), its [3, B, L]
    mRoPE positions and each row's rope delta [B, 1] (decoding position = sequence position + delta), from
    transformers' own get_rope_index row by row (a text-only row: 0, 1, 2, ... and delta 0)."""
    from mtrain.data.vision import VisionInputs
    positions, deltas = [], []
    for row, req in enumerate(reqs):
        ids = input_ids[row:row + 1]
        if req.vision is None:
            positions.append(torch.arange(ids.shape[1]).view(1, 1, -1).expand(3, 1, -1))
            deltas.append(torch.zeros((1, 1), dtype=torch.long))
            continue
        pos, delta = model.model.get_rope_index(ids, mm_token_type_ids=req.vision.mm_token_type_ids(ids),
                                                image_grid_thw=req.vision.image_grid_thw)
        positions.append(pos)
        deltas.append(delta.view(1, 1).long())
    merged = VisionInputs.concat([r.vision for r in reqs])
    kwargs = {} if merged is None else {"pixel_values": merged.pixel_values, "image_grid_thw": merged.image_grid_thw}
    return kwargs, torch.cat(positions, dim=1), torch.cat(deltas)
