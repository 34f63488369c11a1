"""Images in prompts: placeholders, checks before any work, and the processor's outputs carried to engine and trainer.

A sample's prompt marks each image with `<image>` (IMAGE_PLACEHOLDER) -- in a text prompt or inside chat messages'
content -- and `PromptSample.images` lists the images in the same order (file paths, resolved when the dataset is
read; PIL images; or generated pictures with `size` and `to_pil()`, as count_shapes makes). The placeholders must match the images one to one.

`VisionProcessor` renders such a prompt once per rollout: the chat template turns each placeholder into the model's
`<|vision_start|><|image_pad|><|vision_end|>`, the HF image processor (Qwen2-VL's smart resize + patching) computes
the pixel values and the (t, h, w) patch grid of every image, and each `<|image_pad|>` is expanded to the number
of tokens its image becomes after the patch merger (t*h*w / merge_size^2). The result is

    TokenizedPrompt.ids      the expanded prompt ids: what the engine prefills and the trainer's tokens start with
    TokenizedPrompt.vision   VisionInputs(pixel_values, image_grid_thw, ...): the same tensors HF's processor gives

and both travel unchanged: Request.vision -> the engine (reference: transformers' forward; SGLang: one
"processor_output" image item, sglang_wire.sglang_image_data), Completion.vision / Trajectory.vision -> the
trainer's RolloutBatch.vision (VisionRows: one VisionInputs or None per row). Nothing re-runs the processor.

Bad input is one VisionError before any generation: a missing or unreadable image file, an image with more
pixels than the budget (data.max_pixels: the processor would otherwise shrink it silently), and a prompt whose
placeholders do not match its images (more or fewer).
"""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from mtrain.data.records import DatasetError

IMAGE_PLACEHOLDER = "<image>"


class VisionError(DatasetError):
    """An image or an image prompt that cannot be used; the message names the sample and the file. A DatasetError:
    the preflight check and `mtrain train` report it as one line, before any work."""


# ---------------------------------------------------------------- the carried tensors

@dataclass(frozen=True, eq=False)
class VisionInputs:
    """The processor's outputs for one prompt's images, in prompt order. Computed once, never recomputed.

    pixel_values: float32 [sum of t*h*w over images, channels * temporal_patch * patch^2] -- every image's
        patches, flattened as HF's Qwen2-VL image processor emits them (what the vision tower's patch embed takes).
    image_grid_thw: int64 [num_images, 3] -- (t, h, w) in patches per image; t = 1 for a still image.
    image_token_id: the id of `<|image_pad|>` in the prompt ids. merge_size: the patch merger's spatial size.
    The prompt ids (kept beside this object, in TokenizedPrompt.ids / Request.prompt_ids / the trajectory's
    prompt segment) hold exactly `tokens_per_image[i]` consecutive image_token_id for image i, in order.
    """

    pixel_values: torch.Tensor
    image_grid_thw: torch.Tensor
    image_token_id: int
    merge_size: int = 2

    def __post_init__(self) -> None:
        g = self.image_grid_thw
        if g.dim() != 2 or g.shape[1] != 3 or g.dtype != torch.long or len(g) == 0:
            raise VisionError(f"VisionInputs.image_grid_thw must be int64 [num_images >= 1, 3], got "
                              f"{g.dtype} {tuple(g.shape)}")
        if self.pixel_values.dim() != 2 or self.pixel_values.shape[0] != int(g.prod(-1).sum()):
            raise VisionError(f"VisionInputs.pixel_values must be [{int(g.prod(-1).sum())} patches, dim], got "
                              f"{tuple(self.pixel_values.shape)}")
        if bool(((g[:, 1:] % self.merge_size) != 0).any()):
            raise VisionError(f"VisionInputs: grid {g.tolist()} is not divisible by merge_size {self.merge_size}")

    @property
    def num_images(self) -> int:
        return int(self.image_grid_thw.shape[0])

    @property
    def tokens_per_image(self) -> list[int]:
        return (self.image_grid_thw.prod(-1) // self.merge_size ** 2).tolist()

    @property
    def patches_per_image(self) -> list[int]:
        return self.image_grid_thw.prod(-1).tolist()

    def check_ids(self, ids: Sequence[int], what: str = "prompt") -> None:
        """Raise unless `ids` hold one run of image_token_id per image, each of that image's token count."""
        runs, n = [], 0
        for t in list(ids) + [None]:
            if t == self.image_token_id:
                n += 1
            elif n:
                runs.append(n)
                n = 0
        if runs != self.tokens_per_image:
            raise VisionError(f"{what}: image token runs {runs} do not match the images' token counts "
                              f"{self.tokens_per_image} (image_token_id {self.image_token_id})")

    def mm_token_type_ids(self, ids: Sequence[int] | torch.Tensor, prompt_len: int | None = None) -> torch.Tensor:
        """transformers' mm_token_type_ids for `ids` (1 on the prompt's image tokens, 0 elsewhere). Image token ids
        after the first `prompt_len` tokens are text: a model may sample <|image_pad|>, and engines embed it as text."""
        t = ids if isinstance(ids, torch.Tensor) else torch.tensor(list(ids), dtype=torch.long)
        out = (t == self.image_token_id).to(torch.int32)
        if prompt_len is not None:
            out[..., prompt_len:] = 0
        return out

    def to_state(self) -> dict[str, Any]:
        """Plain data for checkpoints (a partial rollout's buffer keeps the images of its aborted samples)."""
        return {"pixel_values": self.pixel_values, "image_grid_thw": self.image_grid_thw,
                "image_token_id": self.image_token_id, "merge_size": self.merge_size}

    @staticmethod
    def from_state(state: "dict[str, Any] | VisionInputs | None") -> "VisionInputs | None":
        """The inverse of to_state (dataclasses.asdict of a holder gives the same dict); None stays None."""
        if state is None or isinstance(state, VisionInputs):
            return state
        return VisionInputs(state["pixel_values"], state["image_grid_thw"], int(state["image_token_id"]),
                            int(state["merge_size"]))

    def expand(self, ids: Sequence[int], where: str, *, strict: bool = True) -> list[int]:
        """Rendered ids holding one image_token_id per image -> each expanded to its image's token count (token
        level: the text around the images is never re-tokenized). strict=False: more image tokens may follow (a
        re-rendered conversation whose model turn sampled one); only the first num_images are images."""
        found = sum(1 for t in ids if t == self.image_token_id)
        if found < self.num_images or (strict and found != self.num_images):
            raise VisionError(f"{where}: the rendered prompt has {found} image tokens for {self.num_images} images; "
                              f"the chat template does not render image content as one image token per image")
        expanded: list[int] = []
        counts = iter(self.tokens_per_image)
        for t in ids:
            expanded.extend([t] * next(counts, 1) if t == self.image_token_id else [t])
        return expanded

    @staticmethod
    def concat(items: Sequence["VisionInputs | None"]) -> "VisionInputs | None":
        """The images of several sequences in order (a batch row after row, or a packed row): pixel values and
        grids concatenated. None entries (text-only rows) contribute nothing; all None -> None."""
        present = [v for v in items if v is not None]
        if not present:
            return None
        first = present[0]
        for v in present[1:]:
            if (v.image_token_id, v.merge_size) != (first.image_token_id, first.merge_size) or \
                    v.pixel_values.shape[1] != first.pixel_values.shape[1]:
                raise VisionError("VisionInputs.concat: inputs from different processors")
        if len(present) == 1:
            return first
        return VisionInputs(torch.cat([v.pixel_values for v in present]),
                            torch.cat([v.image_grid_thw for v in present]), first.image_token_id, first.merge_size)


class VisionRows:
    """RolloutBatch.vision: one VisionInputs (or None: a text-only row) per batch row, indexable like the batch's
    tensors (slice, index tensor, bool mask, list) so RolloutBatch.select / concat keep rows and images together.
    `VisionInputs.concat(rows.items)` gives a micro-batch's images in row order (what a forward takes)."""

    def __init__(self, items: Sequence[VisionInputs | None]):
        self.items = list(items)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, idx: Any) -> "VisionRows":
        if isinstance(idx, slice):
            return VisionRows(self.items[idx])
        if isinstance(idx, torch.Tensor):
            idx = idx.nonzero().flatten().tolist() if idx.dtype == torch.bool else idx.flatten().tolist()
        elif isinstance(idx, int):
            idx = [idx]
        return VisionRows([self.items[int(i)] for i in idx])

    @staticmethod
    def cat(parts: Sequence["VisionRows"]) -> "VisionRows":
        return VisionRows([v for p in parts for v in p.items])


# ---------------------------------------------------------------- images and placeholders

def count_placeholders(prompt: str | list[dict[str, Any]]) -> int:
    if isinstance(prompt, str):
        return prompt.count(IMAGE_PLACEHOLDER)
    return sum(m["content"].count(IMAGE_PLACEHOLDER) for m in prompt if isinstance(m.get("content"), str))


def check_placeholders(prompt: str | list[dict[str, Any]], num_images: int, where: str) -> None:
    n = count_placeholders(prompt)
    if n != num_images:
        more = "more" if n > num_images else "fewer"
        raise VisionError(f"{where}: the prompt has {n} image placeholder(s) '{IMAGE_PLACEHOLDER}' but the sample "
                          f"has {num_images} image(s) ({more} placeholders than images); put one "
                          f"'{IMAGE_PLACEHOLDER}' in the prompt where each image goes, in order")


def image_pixels(image: Any, where: str) -> tuple[int, int]:
    """(width, height) of a file (read from its header, not decoded) or a PIL image."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(image, Image.Image) or hasattr(image, "to_pil"):  # to_pil: generated (count_shapes) or embedded
        try:
            return tuple(image.size)
        except (UnidentifiedImageError, OSError) as e:
            raise VisionError(f"{where}: cannot read {image}: {e}") from None
    path = Path(image)
    if not path.is_file():
        raise VisionError(f"{where}: image file not found: {path}")
    try:
        with Image.open(path) as im:
            return im.size
    except (UnidentifiedImageError, OSError) as e:
        raise VisionError(f"{where}: cannot read image {path}: {e}") from None


def check_image(image: Any, max_pixels: int | None, where: str) -> None:
    """Exists, readable, within the pixel budget (data.max_pixels)."""
    w, h = image_pixels(image, where)
    name = f"image {image}" if isinstance(image, (str, Path, EncodedImage)) else "the image"
    if max_pixels is not None and w * h > max_pixels:
        raise VisionError(f"{where}: {name} has {w}x{h} = {w * h} pixels, more than the pixel budget "
                          f"data.max_pixels={max_pixels}; resize the image or raise data.max_pixels (the processor "
                          f"would shrink it silently, and the answer may depend on the detail lost)")


def open_image(image: Any, where: str):
    """An RGB PIL image from a path or a PIL image (alpha dropped, as SGLang's loader does)."""
    from PIL import Image, UnidentifiedImageError

    if hasattr(image, "to_pil"):
        image = image.to_pil()
    if isinstance(image, Image.Image):
        return image if image.mode == "RGB" else image.convert("RGB")
    try:
        with Image.open(image) as im:
            return im.convert("RGB")
    except FileNotFoundError:
        raise VisionError(f"{where}: image file not found: {image}") from None
    except (UnidentifiedImageError, OSError) as e:
        raise VisionError(f"{where}: cannot read image {image}: {e}") from None


@dataclass(frozen=True, eq=False)
class EncodedImage:
    """An image stored inside a data file (HF datasets' Image feature, verl's parquet: {"bytes": ..., "path": ...}):
    decoded when the processor opens it; `name` (its path field, if any) appears in messages."""
    data: bytes
    name: str = ""

    def __str__(self) -> str:
        return f"<embedded image {self.name or f'of {len(self.data)} bytes'}>"

    def _open(self):
        import io

        from PIL import Image

        return Image.open(io.BytesIO(self.data))

    @property
    def size(self) -> tuple[int, int]:
        with self._open() as im:
            return im.size

    def to_pil(self):
        with self._open() as im:
            return im.convert("RGB")


def resolve_images(value: Any, base_dir: Path, where: str, key: str) -> tuple[Any, ...]:
    """A record's images: a path string or a list of them (relative paths are relative to the data file), or
    embedded images as HF datasets / verl parquet files hold them ({"bytes": ..., "path": ...}; bytes win, a dict
    with only a path is a path)."""
    if value is None:
        return ()
    items = [value] if isinstance(value, (str, dict)) else value
    if not isinstance(items, (list, tuple)):
        items = [None]  # refused below
    out: list[Any] = []
    for item in items:
        if isinstance(item, dict) and isinstance(item.get("bytes"), (bytes, bytearray)) and item["bytes"]:
            out.append(EncodedImage(bytes(item["bytes"]), str(item.get("path") or "")))
            continue
        if isinstance(item, dict) and isinstance(item.get("path"), str):
            item = item["path"]
        if not isinstance(item, str) or not item:
            raise VisionError(f"{where}: '{key}' must be an image path, a list of image paths or embedded images "
                              f"({{'bytes': ..., 'path': ...}}), got {value!r:.120}")
        out.append(str(item if Path(item).is_absolute() else base_dir / item))
    return tuple(out)


def to_content_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages whose string content holds `<image>` markers -> HF multimodal content lists
    ([{"type": "image"}, {"type": "text", "text": ...}]) that Qwen-VL-style chat templates render."""
    out = []
    for m in messages:
        content = m.get("content")
        if not isinstance(content, str) or IMAGE_PLACEHOLDER not in content:
            out.append(m)
            continue
        parts: list[dict[str, Any]] = []
        for i, piece in enumerate(content.split(IMAGE_PLACEHOLDER)):
            if i:
                parts.append({"type": "image"})
            if piece:
                parts.append({"type": "text", "text": piece})
        out.append(dict(m, content=parts))
    return out


# ---------------------------------------------------------------- the processor

class VisionProcessor:
    """A tokenizer plus the model's image processor. Anything else (encode, decode, eos_token_id, pad_token_id,
    chat_template, ...) is the tokenizer's: the rollout and trainer code that takes "a tokenizer" takes this.

    image_token / vision_start / vision_end: the model's marker strings (Qwen2-VL/2.5-VL names by default); they
    must be single tokens of the tokenizer, image_token with id `image_token_id` (from the model's config).
    max_pixels: the pixel budget per image; the image processor is configured with it, so an image within the
    budget is never shrunk below its own resolution, and one above it is refused (check_image).
    """

    def __init__(self, tokenizer: Any, image_processor: Any, *, image_token_id: int, max_pixels: int | None = None,
                 image_token: str = "<|image_pad|>", vision_start: str = "<|vision_start|>",
                 vision_end: str = "<|vision_end|>"):
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.image_token_id = int(image_token_id)
        self.merge_size = int(getattr(image_processor, "merge_size", 2))
        self.max_pixels = max_pixels
        self.image_markup = vision_start + image_token + vision_end
        for token in (image_token, vision_start, vision_end):
            ids = tokenizer.encode(token, add_special_tokens=False)
            if len(ids) != 1:
                raise VisionError(f"VisionProcessor: {token!r} is not one token of the tokenizer (ids {ids})")
        got = tokenizer.encode(image_token, add_special_tokens=False)[0]
        if got != self.image_token_id:
            raise VisionError(f"VisionProcessor: {image_token!r} is token {got} in the tokenizer but the model's "
                              f"image_token_id is {self.image_token_id}")

    def __getattr__(self, name: str) -> Any:  # only called for names this class lacks: the tokenizer's
        if name == "tokenizer":
            raise AttributeError(name)
        return getattr(self.tokenizer, name)

    def __len__(self) -> int:
        return len(self.tokenizer)

    def vision_inputs(self, images: Sequence[Any], where: str) -> VisionInputs:
        pil = []
        for image in images:
            check_image(image, self.max_pixels, where)
            pil.append(open_image(image, where))
        try:
            out = self.image_processor(images=pil, return_tensors="pt")
        except ValueError as e:  # e.g. an aspect ratio above 200
            raise VisionError(f"{where}: the image processor refused an image: {e}") from None
        return VisionInputs(out["pixel_values"].to(torch.float32).contiguous(),
                            out["image_grid_thw"].to(torch.long).contiguous(), self.image_token_id, self.merge_size)

    def render(self, prompt: str | list[dict[str, Any]], images: Sequence[Any], *, apply_chat_template: bool = True,
               system_prompt: str | None = None, sample_id: Any = None) -> tuple[str, list[int], VisionInputs]:
        """(text, expanded ids, VisionInputs) of one prompt with images; text has one image_token per image."""
        from mtrain.data.chat import PromptError, to_messages

        where = f"sample {sample_id}"
        check_placeholders(prompt, len(images), where)
        if apply_chat_template:
            if not getattr(self.tokenizer, "chat_template", None):
                raise PromptError(f"{where}: the tokenizer has no chat template; set data.apply_chat_template=false")
            messages = to_content_messages(to_messages(prompt, system_prompt))
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            ids = list(self.tokenizer.encode(text, add_special_tokens=False))
        else:
            if not isinstance(prompt, str):
                raise PromptError(f"{where}: plain text mode (data.apply_chat_template=false) needs a string prompt")
            text = prompt.replace(IMAGE_PLACEHOLDER, self.image_markup)
            text = f"{system_prompt}\n\n{text}" if system_prompt else text
            ids = list(self.tokenizer.encode(text, add_special_tokens=True))
        vision = self.vision_inputs(images, where)
        if ids.count(self.image_token_id) != vision.num_images:
            raise VisionError(f"{where}: the rendered prompt has {ids.count(self.image_token_id)} image tokens for "
                              f"{vision.num_images} images; the chat template does not render image content as "
                              f"{self.image_markup!r}")
        expanded = vision.expand(ids, where)
        return text, expanded, vision

    def render_messages(self, messages: list[dict[str, Any]], images: Sequence[Any], tools: list[dict] | None = None,
                        *, sample_id: Any = None) -> tuple[list[dict[str, Any]], str, list[int], VisionInputs]:
        """A multi-turn rollout's first prompt: chat messages with `<image>` markers (system prompt included) ->
        (the messages with HF image content, the rendered text, expanded ids, VisionInputs); `tools`: the schemas
        for the template (apply_chat_template(tools=...))."""
        where = f"sample {sample_id}"
        check_placeholders(messages, len(images), where)
        content = to_content_messages(messages)
        kwargs = {"tools": tools} if tools else {}
        text = self.tokenizer.apply_chat_template(content, tokenize=False, add_generation_prompt=True, **kwargs)
        ids = list(self.tokenizer.encode(text, add_special_tokens=False))
        vision = self.vision_inputs(images, where)
        return content, text, vision.expand(ids, where), vision


def check_samples(samples: Sequence[Any], max_pixels: int | None) -> None:
    """Every sample's images against its placeholders and the pixel budget (datasets check files as they read)."""
    for s in samples:
        where = f"sample {s.index}"
        check_placeholders(s.prompt, len(s.images), where)
        for image in s.images:
            check_image(image, max_pixels, where)


def pixel_budget(cfg: Any) -> int | None:
    """The per-image pixel budget of a run: data.max_pixels, else the model folder's preprocessor_config.json
    max_pixels (its `size.longest_edge`), else None (a text model: nothing to check)."""
    if cfg.data.max_pixels is not None:
        if cfg.data.max_pixels < 28 * 28:
            raise VisionError(f"data.max_pixels={cfg.data.max_pixels}: must be at least 784 (one 28x28 token)")
        return int(cfg.data.max_pixels)
    pre = Path(cfg.model.hf_path or ".") / "preprocessor_config.json"
    if not cfg.model.hf_path or not pre.is_file():
        return None
    data = json.loads(pre.read_text())
    value = (data.get("size") or {}).get("longest_edge", data.get("max_pixels"))
    return int(value) if value is not None else None


def is_vision_config(hf_config: dict[str, Any]) -> bool:
    """A VLM config.json: it declares a vision tower and an image token."""
    return isinstance(hf_config.get("vision_config"), dict) and hf_config.get("image_token_id") is not None


def load_vision_processor(hf_dir: str | Path, hf_config: dict[str, Any], max_pixels: int | None) -> VisionProcessor:
    """The model folder's tokenizer and Qwen2-VL image processor (preprocessor_config.json), with the pixel budget
    data.max_pixels (None: the folder's own max_pixels)."""
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    hf_dir = Path(hf_dir)
    pre_path = hf_dir / "preprocessor_config.json"
    if not pre_path.is_file():
        raise VisionError(f"{hf_dir}: no preprocessor_config.json; a vision model needs its image processor files")
    pre = json.loads(pre_path.read_text())
    size = dict(pre.get("size") or {})
    size.setdefault("shortest_edge", pre.get("min_pixels", 56 * 56))
    size.setdefault("longest_edge", pre.get("max_pixels", 28 * 28 * 1280))
    if max_pixels is not None:
        size["longest_edge"] = int(max_pixels)
    budget = int(size["longest_edge"])
    keys = ("patch_size", "temporal_patch_size", "merge_size", "image_mean", "image_std", "do_convert_rgb",
            "do_rescale", "rescale_factor", "do_normalize", "do_resize", "resample")
    kwargs = {k: copy.deepcopy(pre[k]) for k in keys if k in pre}
    # The PIL backend: the same math as the torchvision class (tests compare against HF's processor), no torchvision.
    image_processor = Qwen2VLImageProcessorPil(size={"shortest_edge": int(size["shortest_edge"]),
                                                     "longest_edge": budget}, **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(str(hf_dir))
    return VisionProcessor(tokenizer, image_processor, image_token_id=hf_config["image_token_id"], max_pixels=budget)
