"""What a vision-language model's forward needs beside the tokens of a micro-batch: the [3, b, s] MRoPE position
ids (mtrain.models.mrope) of its rows, the mask of their prompts' image placeholders, and their images (pixel values
and patch grids computed once by the processor and carried in RolloutBatch.vision, mtrain.data.vision), in the
order the model scatters them (row-major over the micro-batch, or along the packed stream)."""
from __future__ import annotations

import torch

from mtrain.layouts.vlm import flat_config
from mtrain.models.hf_config import ModelConfigError
from mtrain.models.mrope import image_mask, mrope_position_ids


class VisionBatcher:
    def __init__(self, hf_config: dict):
        flat = flat_config(hf_config)
        self.image_token_id = int(flat["image_token_id"])
        self.merge = int(flat["vision_config"].get("spatial_merge_size", 2))
        self._cache: tuple | None = None  # (batch, positions [3, B, T], image mask [B, T]) of the last batch

    def _images(self, batch, rows):
        """The images of `rows` (in that order) as one VisionInputs, or None."""
        from mtrain.data.vision import VisionInputs
        vision = getattr(batch, "vision", None)
        vis = VisionInputs.concat(vision[rows].items) if vision is not None else None
        if vis is not None and (vis.image_token_id, vis.merge_size) != (self.image_token_id, self.merge):
            raise ModelConfigError(f"the batch's images use image token {vis.image_token_id} and merge size "
                                   f"{vis.merge_size}; the model {self.image_token_id} and {self.merge}")
        return vis

    def batch_inputs(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """([3, B, T] positions, [B, T] bool image mask) of the whole batch (computed once per batch). Only prompts
        hold images: a placeholder id in a response is a text token, as the engines treat it."""
        if self._cache is not None and self._cache[0] is batch:
            return self._cache[1], self._cache[2]
        vis = self._images(batch, torch.arange(batch.size))
        prompt_lens = batch.seq_lens - batch.response_lens
        pos = mrope_position_ids(batch.tokens, None if vis is None else vis.image_grid_thw, self.image_token_id,
                                 self.merge, lengths=batch.seq_lens, prompt_lens=prompt_lens)
        mask = image_mask(batch.tokens, self.image_token_id, prompt_lens)
        self._cache = (batch, pos, mask)
        return pos, mask

    def _with_pixels(self, images: dict, batch, rows, device) -> dict:
        vis = self._images(batch, rows)
        if vis is not None:
            images.update(pixel_values=vis.pixel_values.to(device), image_grid_thw=vis.image_grid_thw.to(device))
        return images

    def micro_inputs(self, batch, rows: torch.Tensor, device) -> dict:
        """{"position_ids": [3, b, s], "images": {image_mask, pixel_values, image_grid_thw}} of padded rows."""
        pos, mask = self.batch_inputs(batch)
        images = self._with_pixels({"image_mask": mask[rows].to(device)}, batch, rows, device)
        return {"position_ids": pos[:, rows].to(device), "images": images}

    def packed_inputs(self, batch, pk, width: int, device) -> dict:
        """The same for a packed stream ([3, 1, S] positions, [1, S] mask; rows in the pack's order). The padding
        segment gets positions 0 and no images."""
        from mtrain.trainer.packing import pack
        pos, mask = self.batch_inputs(batch)
        packed_pos = pack(pk, pos.permute(1, 2, 0), width, "mrope positions").t().unsqueeze(1)
        images = {"image_mask": pack(pk, mask, width, "image mask").unsqueeze(0).to(device)}
        return {"position_ids": packed_pos.to(device), "images": self._with_pixels(images, batch, pk.rows, device)}
