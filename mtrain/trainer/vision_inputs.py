"""What a vision-language model's forward needs beside the tokens of a padded micro-batch: the [3, b, s] MRoPE
position ids (mtrain.models.mrope) of its rows and their images (pixel values and patch grids computed once by the
processor and carried in RolloutBatch.vision, mtrain.data.vision), in row order, as the model scatters them."""
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

    def micro_inputs(self, batch, rows: torch.Tensor, tokens: torch.Tensor, device) -> dict:
        """{"position_ids": [3, b, s], "images": {"image_mask", and "pixel_values"/"image_grid_thw" when a row has
        images}} for the padded rows `rows`. Only prompts hold images: a placeholder id in a response is text."""
        from mtrain.data.vision import VisionInputs
        vision = getattr(batch, "vision", None)
        vis = VisionInputs.concat(vision[rows].items) if vision is not None else None
        if vis is not None and (vis.image_token_id, vis.merge_size) != (self.image_token_id, self.merge):
            raise ModelConfigError(f"the batch's images use image token {vis.image_token_id} and merge size "
                                   f"{vis.merge_size}; the model {self.image_token_id} and {self.merge}")
        grid = vis.image_grid_thw if vis is not None else None
        prompt_lens = batch.seq_lens[rows] - batch.response_lens[rows]
        pos = mrope_position_ids(tokens.cpu(), grid, self.image_token_id, self.merge, lengths=batch.seq_lens[rows],
                                 prompt_lens=prompt_lens)
        images = {"image_mask": image_mask(tokens.cpu(), self.image_token_id, prompt_lens).to(device)}
        if vis is not None:
            images.update(pixel_values=vis.pixel_values.to(device), image_grid_thw=grid.to(device))
        return {"position_ids": pos.to(device), "images": images}
