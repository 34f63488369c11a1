"""A tiny random Qwen2.5-VL (mtrain.tiny_vlm) taught a scripted tool conversation about an image, so the real
reference engine (transformers' Qwen2_5_VLForConditionalGeneration) drives a real two-turn calculator rollout with
the image in the first user message: greedy, it calls the calculator, then answers after the tool's reply.

The model is trained on the exact token sequence the multi-turn rollout builds (the prompt rendered by the
processor with the image's expanded tokens, the model turns + <|im_end|>, the template's suffix for the tool
message), with the image's pixel values, loss on the model tokens only; the trained weights replace the folder's
model.safetensors, so both the engine and the trainer load them.
"""
from __future__ import annotations

from pathlib import Path

import torch
from PIL import Image

from scripted_model import append_turns

CALL = '<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{}"}}}}\n</tool_call>'
QUESTION = "<image>What is 12*3?"
TURN1, REPLY, ANSWER = CALL.format("12*3"), "36", "It is 36."
REPLIES = [{"role": "tool", "name": "calculator", "content": REPLY}]


def picture(w: int = 84, h: int = 56, seed: int = 0) -> Image.Image:
    g = torch.Generator().manual_seed(seed)
    return Image.fromarray(torch.randint(0, 256, (h, w, 3), generator=g, dtype=torch.uint8).numpy())


def script(proc, user: str, images, turns: list[str], tool_replies: list[list[dict]], tools=None):
    """(ids, trained mask, VisionInputs) of one scripted conversation, built as the rollout builds it."""
    _, _, prompt, vision = proc.render_messages([{"role": "user", "content": user}], images, tools)
    ids, mask = append_turns(proc, prompt, turns, tool_replies, tools)
    return ids, mask, vision


def train_scripted_vlm(hf_dir: Path, ids: list[int], mask: list[int], vision, steps: int = 300,
                       lr: float = 1e-2, device: str = "cpu") -> None:
    """Train the folder's model until its loss on the model tokens is below 1e-3; write the weights back (the
    vision tower stays as it was: the language model learns on its image features)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForImageTextToText

    from mtrain.rollout.reference_engine import hf_disk_views

    model = AutoModelForImageTextToText.from_pretrained(str(hf_dir), dtype=torch.float32,
                                                        attn_implementation="eager").to(device)
    opt = torch.optim.Adam([p for n, p in model.named_parameters() if "visual" not in n], lr=lr)
    x = torch.tensor([ids], device=device)
    m = torch.tensor([mask[1:]], dtype=torch.float32, device=device)
    kwargs = dict(pixel_values=vision.pixel_values.to(device), image_grid_thw=vision.image_grid_thw.to(device),
                  mm_token_type_ids=vision.mm_token_type_ids(x.cpu()).to(device))
    for _ in range(steps):
        logits = model(input_ids=x, **kwargs).logits[:, :-1]
        lp = torch.log_softmax(logits.float(), -1).gather(-1, x[:, 1:, None])[..., 0]
        loss = -(lp * m).sum() / m.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if loss.item() < 1e-3:
            break
    assert loss.item() < 1e-2, f"the scripted VLM did not learn its script (loss {loss.item()})"
    save_file({k: v.detach().cpu().contiguous().clone() for k, v in hf_disk_views(model).items()},
              str(Path(hf_dir) / "model.safetensors"), metadata={"format": "pt"})
