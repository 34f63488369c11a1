"""Prompt datasets from .jsonl, .json (a list of records) and .parquet files.

A record holds a prompt (a string, or a list of chat messages {"role", "content"} as in verl's parquet files)
and an answer (anything the reward function understands; the default one compares numbers/strings).
Keys may be dotted paths into nested records: answer_key="reward_model.ground_truth".
Images: with `image_key` (data.image_key), a record may list image files (a path or a list; relative paths are
relative to the data file; or embedded {"bytes", "path"} images as in verl's parquet files); the prompt marks each with `<image>` (mtrain/data/vision.py). Every image is checked
while the file is read -- present, readable, within `max_pixels`, placeholders matching -- so a bad record stops the
run before any work, with its file and line named.
"""
from __future__ import annotations

import difflib
import json
from pathlib import Path
from typing import Any, Iterator

from mtrain.data.records import DatasetError, PromptSample

_MISSING = object()


def _get(record: dict, dotted: str) -> Any:
    node: Any = record
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return node


def _check_prompt(prompt: Any, where: str, key: str) -> str | list[dict[str, str]]:
    if isinstance(prompt, str):
        if not prompt.strip():
            raise DatasetError(f"{where}: prompt '{key}' is empty")
        return prompt
    if isinstance(prompt, (list, tuple)) and prompt:
        msgs = list(prompt)
        for i, m in enumerate(msgs):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                raise DatasetError(f"{where}: prompt '{key}' message {i} must be a dict with string "
                                   f"'role' and 'content', got {m!r}"[:300])
        return [{"role": m["role"], "content": m["content"]} for m in msgs]
    raise DatasetError(f"{where}: prompt '{key}' must be a non-empty string or a list of chat messages, "
                       f"got {type(prompt).__name__}")


def _decode(raw: bytes, where: str, first: bool) -> str:
    """UTF-8, with the byte order mark some editors put first; other bytes are one error naming the place."""
    try:
        return raw.decode("utf-8-sig" if first else "utf-8")
    except UnicodeDecodeError as e:
        raise DatasetError(f"{where}: not UTF-8 text (byte {e.start + 1}: {raw[e.start:e.start + 1]!r}); "
                           "save the file as UTF-8") from None


def _records_jsonl(path: Path) -> Iterator[tuple[str, dict]]:
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            where = f"{path}:{lineno}"
            line = _decode(raw, where, lineno == 1)
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise DatasetError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
            yield where, rec


def _records_json(path: Path) -> Iterator[tuple[str, dict]]:
    try:
        data = json.loads(_decode(path.read_bytes(), str(path), True))
    except json.JSONDecodeError as e:
        raise DatasetError(f"{path}: invalid JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(data, list):
        raise DatasetError(f"{path}: a .json prompt file must hold a list of records (use .jsonl for one "
                           f"record per line), got {type(data).__name__}")
    for i, rec in enumerate(data):
        yield f"{path}: record {i}", rec


def _records_parquet(path: Path, keys: tuple[str, str]) -> Iterator[tuple[str, dict]]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises its own ArrowInvalid etc.
        raise DatasetError(f"{path}: cannot read parquet: {e}") from None
    columns = table.column_names
    for key in keys:  # a missing column is one error for the file, not one per row
        if key.split(".")[0] not in columns:
            raise DatasetError(f"{path}: missing column '{key.split('.')[0]}' (for key '{key}'); "
                               f"columns: {columns}" + _key_hint(key, keys[0], list(columns)))
    for i, rec in enumerate(table.to_pylist()):
        yield f"{path}: row {i}", rec


# the names prompt and answer fields often have in public data sets, for the hint below
_USUAL = {"prompt": ("question", "problem", "input", "query", "instruction", "text", "messages"),
          "answer": ("solution", "output", "target", "label", "ground_truth", "response", "completion")}


def _key_hint(key: str, prompt_key: str, present: list[str]) -> str:
    """'; set data.prompt_key=question' -- the override that names the record's field (a guess among its keys)."""
    which = "prompt" if key == prompt_key else "answer"
    guess = next((k for k in _USUAL[which] if k in present), None)
    if guess is None:
        close = difflib.get_close_matches(key, present, n=1, cutoff=0.5)
        guess = close[0] if close else None
    setting = f"data.{which}_key"
    return (f"; name the field with {setting}={guess}" if guess else
            f"; name the field with {setting}=KEY (dotted for nested records)")


def _check_images(rec: dict, prompt: Any, path: Path, where: str, key: str, max_pixels: int | None
                  ) -> tuple[str, ...]:
    from mtrain.data.vision import VisionError, check_image, check_placeholders, resolve_images

    value = _get(rec, key)
    try:
        images = resolve_images(None if value is _MISSING else value, path.parent, where, key)
        check_placeholders(prompt, len(images), where)
        for image in images:
            check_image(image, max_pixels, where)
    except VisionError as e:
        raise DatasetError(str(e)) from None
    return images


def _prompt_and_answer(prompt: Any, answer: Any, same_column: bool) -> tuple[Any, Any]:
    """A chat prompt that ends with the assistant's turn (an SFT-style `messages` column): the model writes that turn,
    so it leaves the prompt; when answer_key names the same column, its text is the answer (the reward extracts the
    final answer from it, e.g. the last \\boxed{})."""
    if isinstance(prompt, list) and len(prompt) > 1 and prompt[-1]["role"] == "assistant":
        return prompt[:-1], (prompt[-1]["content"] if same_column else answer)
    return prompt, answer


def load_prompts(path: str | Path, prompt_key: str = "prompt", answer_key: str = "answer",
                 limit: int | None = None, image_key: str | None = None,
                 max_pixels: int | None = None, split: str = "train") -> list[PromptSample]:
    """Read every record of `path` into PromptSamples (index = position in the file). image_key: the records'
    image list (checked here: files present and within max_pixels pixels, one `<image>` placeholder each).
    A folder is a HF dataset (mtrain/data/hf_datasets.py); `split` chooses its split."""
    path = Path(path)
    if not path.exists():
        raise DatasetError(f"prompt file not found: {path}")
    suffix = path.suffix.lower()
    if path.is_dir():
        from mtrain.data.hf_datasets import HFDatasetError, folder_records
        try:
            records = list(folder_records(path, split, (prompt_key, answer_key)))
        except HFDatasetError as e:
            raise DatasetError(str(e)) from None
    elif suffix == ".jsonl":
        records = _records_jsonl(path)
    elif suffix == ".json":
        records = _records_json(path)
    elif suffix == ".parquet":
        records = _records_parquet(path, (prompt_key, answer_key))
    else:
        raise DatasetError(f"{path}: unknown prompt file type '{suffix}' (expected .jsonl, .json or .parquet)")
    samples: list[PromptSample] = []
    for where, rec in records:
        if limit is not None and len(samples) >= limit:
            break
        if not isinstance(rec, dict):
            raise DatasetError(f"{where}: a record must be a JSON object, got {type(rec).__name__}")
        values = []
        for key in (prompt_key, answer_key):
            v = _get(rec, key)
            if v is _MISSING:
                raise DatasetError(f"{where}: missing key '{key}' (keys present: {sorted(rec)})"
                                   + _key_hint(key, prompt_key, sorted(rec)))
            if v is None:  # the right field, without a value: naming the field again would not help
                raise DatasetError(f"{where}: null value for key '{key}': give every record one, or drop this "
                                   f"record from the file")
            values.append(v)
        prompt = _check_prompt(values[0], where, prompt_key)
        prompt, values[1] = _prompt_and_answer(prompt, values[1], prompt_key == answer_key)
        top = {prompt_key.split(".")[0], answer_key.split(".")[0]}
        images: tuple[str, ...] = ()
        if image_key is not None:
            images = _check_images(rec, prompt, path, where, image_key, max_pixels)
            top.add(image_key.split(".")[0])
        meta = {k: v for k, v in rec.items() if k not in top}
        samples.append(PromptSample(index=len(samples), prompt=prompt, answer=values[1], metadata=meta,
                                    images=images, source=where))
    if not samples:
        raise DatasetError(f"{path}: no records")
    return samples
