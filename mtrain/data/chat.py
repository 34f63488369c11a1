"""Turning prompts into token ids: the tokenizer's chat template (with the generation prompt) or plain text.

With a chat template the rendered text already holds the model's BOS/special tokens, so it is encoded with
add_special_tokens=False (as verl and slime do); plain text is encoded with the tokenizer's own specials.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Sequence

from mtrain.data.records import PromptSample

log = logging.getLogger(__name__)


class PromptError(ValueError):
    """A prompt that cannot be rendered or does not fit; the message names the sample."""


@dataclass(frozen=True)
class TokenizedPrompt:
    sample: PromptSample
    text: str  # exactly what the ids encode (template applied; one image token per image)
    ids: list[int]  # with images: each image token expanded to its image's token count
    vision: Any = None  # mtrain.data.vision.VisionInputs when the sample has images


def to_messages(prompt: str | list[dict[str, str]], system_prompt: str | None) -> list[dict[str, str]]:
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    if system_prompt and not (messages and messages[0]["role"] == "system"):
        messages = [{"role": "system", "content": system_prompt}] + messages
    return messages


def render_prompt(tokenizer: Any, prompt: str | list[dict[str, str]], *, apply_chat_template: bool = True,
                  system_prompt: str | None = None, sample_id: Any = None) -> tuple[str, list[int]]:
    """(text, ids) of one prompt, ready for generation."""
    if apply_chat_template:
        if not getattr(tokenizer, "chat_template", None):
            raise PromptError(f"sample {sample_id}: the tokenizer has no chat template; set "
                              f"data.apply_chat_template=false to use plain text prompts")
        text = tokenizer.apply_chat_template(to_messages(prompt, system_prompt), tokenize=False,
                                             add_generation_prompt=True)
        if not isinstance(text, str):
            raise PromptError(f"sample {sample_id}: apply_chat_template(tokenize=False) returned "
                              f"{type(text).__name__}, expected str")
        return text, list(tokenizer.encode(text, add_special_tokens=False))
    if not isinstance(prompt, str):
        raise PromptError(f"sample {sample_id}: the prompt is a list of chat messages; plain text mode "
                          f"(data.apply_chat_template=false) needs a string prompt")
    text = f"{system_prompt}\n\n{prompt}" if system_prompt else prompt
    return text, list(tokenizer.encode(text, add_special_tokens=True))


def tokenize_prompts(samples: Sequence[PromptSample], tokenizer: Any, *, max_prompt_len: int,
                     apply_chat_template: bool = True, system_prompt: str | None = None,
                     drop_overlong: bool = False) -> list[TokenizedPrompt]:
    """Render and encode every sample. A prompt longer than max_prompt_len tokens is an error naming the
    sample, or (drop_overlong) left out with one warning that counts them."""
    out, dropped = [], []
    for s in samples:
        vision = None
        if getattr(s, "images", ()):
            if not hasattr(tokenizer, "vision_inputs"):
                raise PromptError(f"{s.where}: the sample has {len(s.images)} image(s) but the model has no "
                                  f"vision tower (its config.json has no vision_config/image_token_id)")
            text, ids, vision = tokenizer.render(s.prompt, s.images, apply_chat_template=apply_chat_template,
                                                 system_prompt=system_prompt, sample_id=s.index)
        else:
            text, ids = render_prompt(tokenizer, s.prompt, apply_chat_template=apply_chat_template,
                                      system_prompt=system_prompt, sample_id=s.index)
        if len(ids) > max_prompt_len:
            if not drop_overlong:
                raise PromptError(f"{s.where}: prompt has {len(ids)} tokens > rollout.max_prompt_len="
                                  f"{max_prompt_len}; raise the limit or set data.drop_overlong_prompts=true")
            dropped.append(s.where)
            continue
        out.append(TokenizedPrompt(sample=s, text=text, ids=ids, vision=vision))
    if dropped:
        log.warning("dropped %d of %d prompts longer than %d tokens (first: %s)",
                    len(dropped), len(samples), max_prompt_len, dropped[0])
    if not out:
        raise PromptError(f"every prompt is longer than max_prompt_len={max_prompt_len} tokens")
    return out


def context_problem(prompt: TokenizedPrompt, max_new_tokens: int, max_positions: int | None) -> str | None:
    """Why `prompt` cannot take `max_new_tokens` more tokens in the model's context (max_position_embeddings), naming
    the prompt's file and line and what to change; None when it fits (or the context is unknown). The one rule of the
    rollout (checked before any generation) and of preflight (before any work, where the limits allow a miss)."""
    n = len(prompt.ids)
    if max_positions is None or n + max_new_tokens <= max_positions:
        return None
    room = max_positions - n
    fix = f"lower rollout.max_new_tokens to {room} or less" if room >= 1 else "shorten that prompt"
    return (f"{prompt.sample.where}: prompt of {n} tokens + max_new_tokens={max_new_tokens} exceeds the model's "
            f"context (max_position_embeddings={max_positions}): {fix}, or leave such prompts out "
            f"with rollout.max_prompt_len={max_positions - max_new_tokens} and data.drop_overlong_prompts=true")
