"""The generated image task: real pictures whose answer is right, counted back from the pixels independently."""
from collections import deque

import numpy as np
import pytest

from mtrain.data.count_shapes import COLORS, count_shapes_reward, make_count_shapes_splits


def components(mask: np.ndarray) -> int:
    """4-connected components of a boolean mask (plain BFS: no code shared with the task)."""
    seen = np.zeros_like(mask)
    h, w = mask.shape
    n = 0
    for y, x in zip(*np.nonzero(mask)):
        if seen[y, x]:
            continue
        n += 1
        seen[y, x] = True
        todo = deque([(y, x)])
        while todo:
            cy, cx = todo.popleft()
            for ny, nx in ((cy + 1, cx), (cy - 1, cx), (cy, cx + 1), (cy, cx - 1)):
                if 0 <= ny < h and 0 <= nx < w and mask[ny, nx] and not seen[ny, nx]:
                    seen[ny, nx] = True
                    todo.append((ny, nx))
    return n


def test_answers_equal_the_shapes_counted_from_pixels():
    train, evals = make_count_shapes_splits(24, 8, seed=3)
    sizes = set()
    for s in train + evals:
        [picture] = s.images
        pixels = np.asarray(picture.to_pil())
        assert pixels.shape == (picture.height, picture.width, 3)
        sizes.add(pixels.shape[:2])
        per_color = {name: components((pixels == rgb).all(-1)) for name, rgb in COLORS.items()}
        known = np.zeros(pixels.shape[:2], dtype=bool)
        for rgb in list(COLORS.values()) + [(255, 255, 255)]:
            known |= (pixels == rgb).all(-1)
        assert known.all(), "a pixel of no task colour: anti-aliasing or overlap would break counting"
        color = s.metadata["color"]
        want = sum(per_color.values()) if color is None else per_color[color]
        assert s.answer == str(want), (s.prompt, per_color)
        assert s.prompt.startswith("<image>") and (color is None or f" {color} " in s.prompt)
    assert len(sizes) > 10  # images of many sizes
    assert {s.metadata["color"] is None for s in train} == {True, False}  # both question kinds


def test_deterministic_and_seed_dependent():
    a, _ = make_count_shapes_splits(5, 2, seed=0)
    b, _ = make_count_shapes_splits(5, 2, seed=0)
    c, _ = make_count_shapes_splits(5, 2, seed=1)
    assert a == b and a != c
    assert np.array_equal(np.asarray(a[0].images[0].to_pil()), np.asarray(b[0].images[0].to_pil()))


def test_reward_and_bad_settings():
    assert count_shapes_reward("There are 3 shapes. Final: 4", "4") == 1.0
    assert count_shapes_reward("2", "4") == pytest.approx(1 / 3)
    assert count_shapes_reward("none", "4") == 0.0
    with pytest.raises(ValueError, match="count_shapes task"):
        make_count_shapes_splits(5, 0, seed=0, min_size=20)


def test_shipped_jsonl_with_image_files_is_right():
    """examples/data/shapes/train.jsonl: image paths relative to the file; each answer counted from the PNG pixels."""
    import re
    from pathlib import Path

    from PIL import Image

    from mtrain.data.datasets import load_prompts

    path = Path(__file__).resolve().parents[2] / "examples" / "data" / "shapes" / "train.jsonl"
    samples = load_prompts(path, image_key="images", max_pixels=140 * 140)
    assert len(samples) == 9 and max(len(s.images) for s in samples) == 2
    for s in samples:
        color = (re.search(r"How many (\w+ )?shapes", s.prompt).group(1) or "").strip()
        total = 0
        for image in s.images:
            pixels = np.asarray(Image.open(image).convert("RGB"))
            names = [color] if color in COLORS else list(COLORS)
            total += sum(components((pixels == COLORS[c]).all(-1)) for c in names)
        assert s.answer == str(total), s
