"""Token-in-token-out with a chat template: tokenize only what the environment appends, measure the drift.

After a model turn the conversation grows by tool messages and the next generation prompt. Re-rendering the
whole conversation and re-tokenizing it would change the model's own tokens whenever the tokenizer merges
differently than the model sampled (or the template rewrites earlier turns), and the trainer would then train
on tokens the engine never produced. Instead we render only the *suffix*: the template's text for

    [<dummy system>, <dummy user>, <dummy assistant>] + new messages  (+ generation prompt)

minus its text for the dummy conversation up to the end of the dummy assistant content, and tokenize that.
The model's tokens before it are never touched. `drift` re-renders the real conversation the ordinary way and
counts the tokens that differ: a metric of how far token-in-token-out is from what a text-based agent would
train on. It never reaches the trained tokens.
"""
from __future__ import annotations

import difflib
from typing import Any

from mtrain.rollout.special_text import defuse_messages, special_texts

_DUMMY = "\x00mtrain-dummy-assistant-content\x00"
_DUMMY_HEAD = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]


class TemplateError(ValueError):
    """The chat template cannot be used for token-in-token-out (e.g. it rewrites earlier turns)."""


def render(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict] | None, *,
           add_generation_prompt: bool) -> str:
    kwargs = {"tools": tools} if tools else {}
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                         **kwargs)
    if not isinstance(text, str):
        raise TemplateError(f"apply_chat_template(tokenize=False) returned {type(text).__name__}, expected str")
    return text


def encode(tokenizer: Any, text: str) -> list[int]:
    # Rendered template text carries its own special tokens: never let encode add another BOS.
    return list(tokenizer.encode(text, add_special_tokens=False))


def prompt_ids(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict] | None) -> tuple[str, list[int]]:
    text = render(tokenizer, messages, tools, add_generation_prompt=True)
    return text, encode(tokenizer, text)


def suffix(tokenizer: Any, new_messages: list[dict[str, Any]], tools: list[dict] | None, *,
           stop_text: str | None) -> tuple[str, list[int]]:
    """(text, ids) to append after a model turn: `new_messages` (tool results) rendered by the template, with
    the template's glue and the next generation prompt. stop_text: the decoded stop token the model ended its
    turn with (e.g. "<|im_end|>"); when the template writes the same text after an assistant message, it is
    already in the model's tokens and is left out here."""
    head = _DUMMY_HEAD + [{"role": "assistant", "content": _DUMMY}]
    base = render(tokenizer, head, tools, add_generation_prompt=False)
    # a tool's output is not ours (sandboxed code prints what the model wrote): special-token text in it stays text
    new_messages = defuse_messages(new_messages, special_texts(tokenizer))
    full = render(tokenizer, head + list(new_messages), tools, add_generation_prompt=True)
    anchor = base.find(_DUMMY)
    if anchor < 0:
        raise TemplateError("the chat template does not write an assistant message's content verbatim")
    anchor += len(_DUMMY)
    if full[:anchor] != base[:anchor]:
        raise TemplateError("the chat template renders earlier turns differently once tool messages follow; "
                            "token-in-token-out cannot append to it")
    text = full[anchor:]
    if stop_text and text.startswith(stop_text):
        text = text[len(stop_text):]
    return text, encode(tokenizer, text)


def drift(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict] | None, tokens: list[int],
          *, ends_with_generation_prompt: bool, stop_text: str | None = None, vision=None) -> dict[str, float]:
    """Compare `tokens` (the trajectory) with re-tokenizing the conversation rendered in one go.

    A trajectory that ends with a model turn is compared with the rendering cut after that turn's content (and
    its stop text), since the model's tokens end there and the template's closing glue was never generated.
    drift/tokens: tokens not in a common subsequence (difflib's matching blocks), on either side, so 0 means
    identical; drift/first: the first position where they differ (-1 when identical). vision: the trajectory's
    images (VisionInputs; `messages` then hold HF image content): the re-rendered image tokens are expanded too."""
    text = render(tokenizer, messages, tools, add_generation_prompt=ends_with_generation_prompt)
    last = messages[-1] if messages else {}
    if not ends_with_generation_prompt and last.get("role") == "assistant" and last.get("content"):
        end = text.rfind(last["content"])
        if end >= 0:
            end += len(last["content"])
            if stop_text and text[end:].startswith(stop_text):
                end += len(stop_text)
            text = text[:end]
    ref = encode(tokenizer, text)
    if vision is not None:  # the trajectory's prompt holds each image as its expanded run of image tokens
        ref = vision.expand(ref, "drift", strict=False)
    sm = difflib.SequenceMatcher(a=tokens, b=ref, autojunk=False)
    matched = sum(b.size for b in sm.get_matching_blocks())
    first = next((i for i, (x, y) in enumerate(zip(tokens, ref)) if x != y),
                 -1 if len(tokens) == len(ref) else min(len(tokens), len(ref)))
    return {"drift/tokens": float(len(tokens) + len(ref) - 2 * matched), "drift/first": float(first),
            "drift/rerender_len": float(len(ref))}
