"""A prompt sample as every data module sees it, and the error of a prompt file that cannot be read.

Apart from the readers (datasets.py), the image checks (vision.py) and the chat rendering (chat.py), which all
use them, so that none of those needs another just for its types.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


class DatasetError(ValueError):
    """A prompt file that cannot be read; the message names the file and the line/row. `key`: the setting that
    names the file (load_datasets sets data.eval_path for the eval file's errors)."""

    key = "data.train_path"


@dataclass(frozen=True)
class PromptSample:
    index: int  # position in its dataset: the id used in logs and reward errors
    prompt: str | list[dict[str, str]]  # text, or chat messages
    answer: Any
    metadata: dict[str, Any] = field(default_factory=dict)  # the rest of the record, for reward functions
    # Images in prompt order, one per `<image>` in the prompt: file paths, PIL images or generated pictures
    # (anything with `size` and `to_pil()`); mtrain/data/vision.py renders them.
    images: tuple[Any, ...] = ()
    # where a record of a file came from ("FILE:LINE", "FILE: record I", "FILE: row I"), for messages about it; ""
    # for generated tasks, which are named by index. Not part of the sample's value (equality, hash): the same record
    # read from a .jsonl or a .parquet file is the same sample
    source: str = field(default="", compare=False)

    @property
    def where(self) -> str:
        """How a message names this sample: its file and line, else its index."""
        return self.source or f"sample {self.index}"
