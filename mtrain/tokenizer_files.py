"""Which files make a model folder's tokenizer, and the marker of a folder meant for the character tokenizer.

A real model folder carries its tokenizer (tokenizer.json, tokenizer_config.json, ...). The tiny random models of the
tests and demos (`mtrain init-tiny`, `mtrain-convert make-fp8 --config`) have none: they are trained with
mtrain's character tokenizer of their vocab_size, and say so with CHAR_TOKENIZER_MARKER, a small JSON file that
travels with config.json through the converters (`mcore_io.copy_side_files`). A folder with neither is refused
before any work (`mtrain.preflight_models.check_tokenizer`): training a real model through a character tokenizer
produces garbage without any error.
"""
from __future__ import annotations

import json
from pathlib import Path

# files that define a HF tokenizer (any one is enough for transformers' AutoTokenizer to try)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "merges.txt")
CHAR_TOKENIZER_MARKER = "mtrain_char_tokenizer.json"


def write_char_tokenizer_marker(model_dir: str | Path, vocab_size: int) -> Path:
    """Mark a random model folder as one trained through the character tokenizer."""
    path = Path(model_dir) / CHAR_TOKENIZER_MARKER
    path.write_text(json.dumps({"tokenizer": "mtrain character tokenizer (mtrain/data/tiny_tokenizer.py)",
                                "vocab_size": vocab_size,
                                "why": "a random model for tests and demos: no tokenizer files of its own"},
                               indent=2, sort_keys=True) + "\n")
    return path


def tokenizer_files(model_dir: str | Path) -> list[str]:
    d = Path(model_dir)
    return [f for f in TOKENIZER_FILES if (d / f).is_file()]


def uses_char_tokenizer(model_dir: str | Path) -> bool:
    return (Path(model_dir) / CHAR_TOKENIZER_MARKER).is_file()
