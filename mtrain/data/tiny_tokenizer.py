"""A character-level tokenizer for tiny random models: CI runs the whole loop without downloading anything.

It offers the subset of the HF tokenizer interface the trainer uses (encode, decode, batch_decode, __call__,
apply_chat_template, eos/bos/pad ids, vocab_size) and guarantees every id is < vocab_size: characters that
do not fit in the vocabulary map to the unknown token. The most useful characters for the arithmetic task
(digits, operators, space) come first, so even a 32-entry vocabulary can express its prompts and answers.
"""
from __future__ import annotations

import re
import string
from typing import Any, Sequence

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
# Priority order: what the arithmetic task needs first, then letters, then the rest of printable ASCII.
_CHARS = "0123456789 +-*=?.\n" + string.ascii_lowercase + string.ascii_uppercase
_CHARS += "".join(c for c in string.printable if c not in _CHARS and c not in "\r\x0b\x0c")
_SPECIAL_SPLIT = re.compile("(" + "|".join(re.escape(t) for t in SPECIAL_TOKENS) + ")")

# The template is plain text so it tokenizes with the same characters as everything else.
CHAT_TEMPLATE = "<bos>{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}" \
                "{% if add_generation_prompt %}assistant:{% endif %}"


class CharTokenizer:
    pad_token, bos_token, eos_token, unk_token = SPECIAL_TOKENS
    pad_token_id, bos_token_id, eos_token_id, unk_token_id = range(4)
    chat_template = CHAT_TEMPLATE
    padding_side = "left"

    def __init__(self, vocab_size: int = 128):
        if vocab_size < len(SPECIAL_TOKENS) + 18:
            raise ValueError(f"CharTokenizer: vocab_size must be >= {len(SPECIAL_TOKENS) + 18} (special tokens, "
                             f"digits and operators), got {vocab_size}")
        self.vocab_size = vocab_size
        chars = _CHARS[: vocab_size - len(SPECIAL_TOKENS)]
        self._id_of = {c: i + len(SPECIAL_TOKENS) for i, c in enumerate(chars)}
        self._id_of.update({t: i for i, t in enumerate(SPECIAL_TOKENS)})
        self._token_of = {i: t for t, i in self._id_of.items()}

    def __len__(self) -> int:
        return self.vocab_size

    @property
    def all_special_ids(self) -> list[int]:
        return list(range(len(SPECIAL_TOKENS)))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [self.bos_token_id] if add_special_tokens else []
        for piece in _SPECIAL_SPLIT.split(text):
            if piece in SPECIAL_TOKENS:
                ids.append(self._id_of[piece])
            else:
                ids.extend(self._id_of.get(c, self.unk_token_id) for c in piece)
        return ids

    def __call__(self, text: str | Sequence[str], add_special_tokens: bool = True, **_: Any) -> dict[str, Any]:
        if isinstance(text, str):
            return {"input_ids": self.encode(text, add_special_tokens)}
        return {"input_ids": [self.encode(t, add_special_tokens) for t in text]}

    def decode(self, ids: Any, skip_special_tokens: bool = False, **_: Any) -> str:
        if hasattr(ids, "tolist"):  # torch / numpy
            ids = ids.tolist()
        if isinstance(ids, int):
            ids = [ids]
        out = []
        for i in ids:
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"CharTokenizer.decode: id {i} is outside the vocabulary [0, {self.vocab_size})")
            if skip_special_tokens and i < len(SPECIAL_TOKENS):
                continue
            # Ids in range but past the character table exist when vocab_size > table size: show as unk.
            out.append(self._token_of.get(i, self.unk_token))
        return "".join(out)

    def batch_decode(self, sequences: Sequence[Any], skip_special_tokens: bool = False, **_: Any) -> list[str]:
        return [self.decode(s, skip_special_tokens) for s in sequences]

    def apply_chat_template(self, conversation: Sequence[dict[str, str]], tokenize: bool = True,
                            add_generation_prompt: bool = False, **_: Any) -> str | list[int]:
        """Same defaults as HF (tokenize=True, add_generation_prompt=False); returns ids or text."""
        text = "<bos>" + "".join(f"{m['role']}: {m['content']}\n" for m in conversation)
        if add_generation_prompt:
            text += "assistant:"
        return self.encode(text, add_special_tokens=False) if tokenize else text
