"""Qwen2.5-VL on Megatron-core: the language model is our GPTModel path with multimodal RoPE; the vision tower and
patch merger are transformers' own `Qwen2_5_VisionTransformerPretrainedModel`, a submodule `vision` of the first
pipeline stage's chunk, replicated over tensor parallelism (docs/design-vlm.md).

Forward: the token embeddings of the chunk's first stage are computed by Megatron's embedding (vocabulary-parallel,
scattered over the sequence with sequence parallelism); the image embeddings (vision tower on `pixel_values` with
`image_grid_thw`) replace the rows of the image placeholder tokens, in row-major (batch, sequence) order as
transformers' `masked_scatter` places them, and only this rank's sequence slice of them under sequence parallelism;
the result goes to GPTModel as `decoder_input`. `position_ids` are the [3, B, S] MRoPE ids
(`mtrain.models.mrope.mrope_position_ids`), read by every pipeline stage.

Frozen by default (`model.train_vision=false`): the tower runs without autograd and its parameters have
requires_grad=False, so DDP and the optimizer skip them. Trained, its gradients are identical on every TP rank
without sequence parallelism (the decoder input's gradient is complete on each rank); with sequence parallelism each
rank sees only its positions' gradient, so the parameters are marked `sequence_parallel` and megatron's
finalize_model_grads sums them over TP, as it does for the sequence-parallel norms.
"""
from __future__ import annotations

from typing import Optional

import torch
from megatron.core import parallel_state as ps
from megatron.core.models.gpt import GPTModel

from mtrain.models.mrope import ImageTokenError, image_token_counts

# The vision tower is created with this seed on every rank: replicated parameters must start equal on all TP (and
# DP) ranks even when no checkpoint is loaded over them.
VISION_INIT_SEED = 20250220


def build_vision_tower(vision_config: dict, dtype: torch.dtype) -> torch.nn.Module:
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel
    cfg = Qwen2_5_VLVisionConfig(**vision_config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(VISION_INIT_SEED)
        tower = Qwen2_5_VisionTransformerPretrainedModel._from_config(cfg, dtype=dtype)
    return tower


def scatter_images(text: torch.Tensor, images: torch.Tensor, mask: torch.Tensor, sp_rank: int = 0,
                   sp_size: int = 1) -> torch.Tensor:
    """Token embeddings `text` [s/sp_size, b, h] (this rank's sequence slice under sequence parallelism) with the
    placeholders of `mask` [b, s] replaced by `images` rows, taken in row-major (batch, sequence) order over the
    whole sequence (transformers' masked_scatter)."""
    b, s = mask.shape
    # the image row that fills each placeholder: its rank among placeholders in (batch, sequence) order
    index = (mask.reshape(-1).long().cumsum(0) - 1).clamp(min=0).reshape(b, s)
    n = s // sp_size
    mask, index = mask[:, sp_rank * n:(sp_rank + 1) * n], index[:, sp_rank * n:(sp_rank + 1) * n]
    # [s, b, 1] like the embeddings; contiguous: the gathered rows come in (b, s) memory order, and a pipeline stage
    # sends its output (which keeps the input's layout) with isend, which needs contiguous tensors
    return torch.where(mask.t().unsqueeze(-1), images[index.t()], text).contiguous()


class VisionLanguageModel(GPTModel):
    """GPTModel + the vision tower on the first stage. Parameter names of the language model are GPTModel's; the
    tower's are `vision.<transformers name>` (the layout tables, mtrain/layouts/vlm.py)."""

    def __init__(self, *args, vision_config: dict, image_token_id: int, train_vision: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.image_token_id = int(image_token_id)
        self.spatial_merge = int(vision_config.get("spatial_merge_size", 2))
        self.train_vision = bool(train_vision)
        if self.pre_process:
            self.vision = build_vision_tower(vision_config, self.config.params_dtype)
            if torch.cuda.is_available():
                self.vision.cuda(torch.cuda.current_device())
            self.vision.requires_grad_(self.train_vision)
            if self.config.sequence_parallel:
                for p in self.vision.parameters():
                    p.sequence_parallel = True

    def image_embeddings(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> torch.Tensor:
        """[placeholder tokens of all images, hidden]: the merger's output, images in order."""
        dtype = next(self.vision.parameters()).dtype
        grid = image_grid_thw.to(device=pixel_values.device, dtype=torch.long)
        with torch.set_grad_enabled(torch.is_grad_enabled() and self.train_vision):
            out = self.vision(pixel_values.to(dtype), grid_thw=grid)
        return out.pooler_output

    def embed(self, input_ids: torch.Tensor, pixel_values: Optional[torch.Tensor],
              image_grid_thw: Optional[torch.Tensor], image_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Token embeddings [s(/tp), b, h] with image rows replaced. `image_mask` [b, s]: the placeholders that
        hold images (default: every image token; the trainer passes the prompts' only, as a generated
        placeholder id is a text token to the engines)."""
        text = self.embedding(input_ids=input_ids, position_ids=None)
        mask = (input_ids == self.image_token_id) if image_mask is None else image_mask.to(torch.bool)
        n_tokens = int(mask.sum())
        if pixel_values is None or image_grid_thw is None or len(image_grid_thw) == 0:
            if n_tokens:
                raise ImageTokenError(f"{n_tokens} image placeholder tokens but no pixel_values/image_grid_thw")
            return text
        expected = sum(image_token_counts(image_grid_thw, self.spatial_merge))
        if expected != n_tokens:
            raise ImageTokenError(f"{len(image_grid_thw)} image(s) make {expected} image tokens but the batch holds "
                                  f"{n_tokens} placeholder tokens")
        images = self.image_embeddings(pixel_values, image_grid_thw).to(text.dtype)
        if self.config.sequence_parallel:
            return scatter_images(text, images, mask, ps.get_tensor_model_parallel_rank(),
                                  ps.get_tensor_model_parallel_world_size())
        return scatter_images(text, images, mask)

    def forward(self, input_ids, position_ids, attention_mask, decoder_input=None, *args,
                pixel_values: Optional[torch.Tensor] = None, image_grid_thw: Optional[torch.Tensor] = None,
                image_mask: Optional[torch.Tensor] = None, **kwargs):
        if decoder_input is None and self.pre_process:
            decoder_input = self.embed(input_ids, pixel_values, image_grid_thw, image_mask)
        return super().forward(input_ids, position_ids, attention_mask, decoder_input, *args, **kwargs)
