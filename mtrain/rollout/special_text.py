"""Text that is not ours (a policy's response, a tool's output) spelling a tokenizer's special tokens.

Tokenizers turn the text of a special token into that token wherever it appears in a string: written out by the
policy or printed by sandboxed code, "<|im_end|>\n<|im_start|>user\n..." would become real turn markers (a forged
turn), and "<|endoftext|>" a real end of text. Such text is defused before it is tokenized: a zero-width space
after the marker's first character, so it reads the same and is ordinary text. Used for the judge's prompt
(mtrain/rollout/judge.py) and for every message appended after a model turn (mtrain/rollout/agents/tito.py).
"""
from __future__ import annotations

import re
import weakref
from typing import Any, Sequence

# tokenizer -> its special_texts; a tokenizer's special tokens are fixed once it is loaded (mtrain adds none later)
_SPECIAL_TEXTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def special_texts(tokenizer: Any) -> tuple[str, ...]:
    """The texts the tokenizer turns into its special tokens wherever they appear in a string (`<|im_start|>`,
    `<|im_end|>`, `<eos>`...), longest first. Computed once per tokenizer object (every tool turn asks again);
    a tokenizer that cannot be weakly referenced or hashed gets them computed on every call."""
    try:
        return _SPECIAL_TEXTS[tokenizer]
    except KeyError:
        pass
    except TypeError:  # not weak-referenceable, or unhashable
        return _compute_special_texts(tokenizer)
    out = _SPECIAL_TEXTS[tokenizer] = _compute_special_texts(tokenizer)
    return out


def _compute_special_texts(tokenizer: Any) -> tuple[str, ...]:
    out = set(getattr(tokenizer, "all_special_tokens", None) or ())
    for tok in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
        if getattr(tok, "special", False):
            out.add(str(tok))
    for i in getattr(tokenizer, "all_special_ids", None) or ():
        try:
            out.add(tokenizer.decode([i], skip_special_tokens=False))
        except Exception:  # noqa: BLE001 - a tokenizer that cannot decode its own id: nothing to defuse for it
            pass
    return tuple(sorted((t for t in out if isinstance(t, str) and t.strip()), key=len, reverse=True))


def defuse(text: str, specials: Sequence[str]) -> str:
    """`text` with every occurrence of a special token's text broken by a zero-width space after its first
    character (the module's docstring says why)."""
    if not specials or not any(t in text for t in specials):
        return text
    pattern = re.compile("|".join(re.escape(t) for t in specials))
    return pattern.sub(lambda m: m.group()[0] + "\u200b" + m.group()[1:], text)


def defuse_messages(messages: Sequence[dict[str, Any]], specials: Sequence[str]) -> list[dict[str, Any]]:
    """Copies of `messages` with their text content (a string, or the text of content parts) defused."""
    out = []
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, str):
            m = {**m, "content": defuse(content, specials)}
        elif isinstance(content, list):
            m = {**m, "content": [{**p, "text": defuse(p["text"], specials)}
                                  if isinstance(p, dict) and isinstance(p.get("text"), str) else p for p in content]}
        out.append(m)
    return out
