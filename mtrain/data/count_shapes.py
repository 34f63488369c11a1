"""A generated image task: "How many red shapes are in the image?" over PIL-rendered pictures of coloured shapes.

Every picture is drawn from a seed: a white canvas of random size (data.count_shapes.min_size..max_size pixels a
side, so the processor yields grids of different shapes), 1..max_shapes circles, squares and triangles in a few
pure colours, drawn without anti-aliasing and at least `GAP` pixels apart (a colour's shapes are its connected
components: tests count them back from the pixels). The question asks for all shapes or those of one colour
(possibly zero). Images are described by a small spec and rendered when the processor opens them, so a dataset of
thousands costs kilobytes and pickles cheaply to other ranks.
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Any

from mtrain.data.datasets import PromptSample
from mtrain.data.vision import IMAGE_PLACEHOLDER

COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30), "green": (30, 170, 60), "blue": (40, 60, 220), "yellow": (235, 200, 20),
    "black": (0, 0, 0)}
BACKGROUND = (255, 255, 255)
KINDS = ("circle", "square", "triangle")
GAP = 3  # pixels between the bounding boxes of two shapes: components never touch
PROMPT_ALL = IMAGE_PLACEHOLDER + "How many shapes are in the image? Answer with just the number."
PROMPT_COLOR = IMAGE_PLACEHOLDER + "How many {color} shapes are in the image? Answer with just the number."


@dataclass(frozen=True)
class Shape:
    kind: str
    color: str
    box: tuple[int, int, int, int]  # left, top, right, bottom (inclusive)


@dataclass(frozen=True)
class ShapesImage:
    """A picture as data; `to_pil()` draws it (the same pixels every time)."""
    width: int
    height: int
    shapes: tuple[Shape, ...]

    @property
    def size(self) -> tuple[int, int]:
        return self.width, self.height

    def to_pil(self):
        from PIL import Image, ImageDraw

        image = Image.new("RGB", self.size, BACKGROUND)
        draw = ImageDraw.Draw(image)
        for s in self.shapes:
            fill = COLORS[s.color]
            x0, y0, x1, y1 = s.box
            if s.kind == "circle":
                draw.ellipse(s.box, fill=fill)
            elif s.kind == "square":
                draw.rectangle(s.box, fill=fill)
            else:
                draw.polygon([((x0 + x1) // 2, y0), (x0, y1), (x1, y1)], fill=fill)
        return image


def _picture(rng: random.Random, *, min_size: int, max_size: int, max_shapes: int, min_shape: int,
             max_shape: int) -> ShapesImage:
    w, h = rng.randint(min_size, max_size), rng.randint(min_size, max_size)
    want = rng.randint(1, max_shapes)
    shapes: list[Shape] = []
    for _ in range(want * 50):  # rejection sampling; a crowded canvas just gets fewer shapes
        if len(shapes) == want:
            break
        d = rng.randint(min_shape, min(max_shape, w - 1, h - 1))
        x0, y0 = rng.randint(0, w - d), rng.randint(0, h - d)
        box = (x0, y0, x0 + d - 1, y0 + d - 1)
        if all(box[2] + GAP < b[0] or b[2] + GAP < box[0] or box[3] + GAP < b[1] or b[3] + GAP < box[1]
               for b in (s.box for s in shapes)):
            shapes.append(Shape(rng.choice(KINDS), rng.choice(sorted(COLORS)), box))
    return ShapesImage(w, h, tuple(shapes))


def _sample(rng: random.Random, index: int, **picture_kwargs: Any) -> PromptSample:
    picture = _picture(rng, **picture_kwargs)
    if rng.random() < 0.5:
        prompt, color = PROMPT_ALL, None
        count = len(picture.shapes)
    else:
        color = rng.choice(sorted(COLORS))
        prompt = PROMPT_COLOR.format(color=color)
        count = sum(s.color == color for s in picture.shapes)
    return PromptSample(index=index, prompt=prompt, answer=str(count), images=(picture,),
                        metadata={"task": "count_shapes", "color": color, "size": list(picture.size)})


def make_count_shapes_splits(num_train: int, num_eval: int, *, seed: int, min_size: int = 56, max_size: int = 112,
                             max_shapes: int = 6, min_shape: int = 8, max_shape: int = 20
                             ) -> tuple[list[PromptSample], list[PromptSample]]:
    """(train, eval) samples, eval drawn first from the same seed (a different seed gives different pictures)."""
    if num_train < 1 or num_eval < 0 or max_shapes < 1 or not 4 <= min_shape <= max_shape or \
            min_size < max(min_shape + 1, 28) or max_size < min_size:
        raise ValueError(f"count_shapes task: need num_train >= 1, num_eval >= 0, max_shapes >= 1, 4 <= min_shape <= "
                         f"max_shape, min_size >= max(min_shape + 1, 28), max_size >= min_size (got {num_train}, "
                         f"{num_eval}, {max_shapes}, {min_shape}, {max_shape}, {min_size}, {max_size})")
    rng = random.Random(f"count_shapes-{seed}")
    kw = dict(min_size=min_size, max_size=max_size, max_shapes=max_shapes, min_shape=min_shape, max_shape=max_shape)
    evals = [_sample(rng, i, **kw) for i in range(num_eval)]
    train = [_sample(rng, i, **kw) for i in range(num_train)]
    return train, evals


_INT = re.compile(r"-?\d+")


def count_shapes_reward(response: str, answer: Any, **_: Any) -> float:
    """1 for the right count (the last integer in the response), 1 / (1 + |error|) for a wrong one, 0 without a
    number: a near miss is worth more than a far one, which gives a small model a gradient to climb."""
    found = _INT.findall(response)
    if not found:
        return 0.0
    return 1.0 / (1.0 + abs(int(found[-1]) - int(str(answer).strip())))
