"""Image prompts: the processor's outputs equal HF's Qwen2.5-VL processor, and bad input is one clear error early.

HF's reference is `transformers.Qwen2_5_VLProcessor`, assembled from the tiny model folder's own files
(AutoTokenizer, Qwen2VLImageProcessorPil.from_pretrained): independent of mtrain.data.vision's loader.
"""
import json
import math

import pytest
import torch
from PIL import Image

from mtrain.config import load_config
from mtrain.data import DatasetError, PromptSample, load_datasets, load_prompts
from mtrain.data.chat import PromptError, tokenize_prompts
from mtrain.data.tiny_tokenizer import CharTokenizer
from mtrain.data.vision import EncodedImage, VisionError, VisionInputs, VisionRows, load_vision_processor
from mtrain.tiny_vlm import TINY_MAX_PIXELS, tiny_vlm_config, write_tiny_vlm


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    return write_tiny_vlm(tmp_path_factory.mktemp("tiny_vlm"))


def hf_processor(vlm_dir):
    import transformers
    from transformers import AutoTokenizer, Qwen2_5_VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    # No torchvision on CI: transformers' BaseVideoProcessor is then a placeholder class that refuses to be built.
    # The processor only checks the type, and no video passes through it here.
    video = object.__new__(transformers.BaseVideoProcessor)
    return Qwen2_5_VLProcessor(image_processor=Qwen2VLImageProcessorPil.from_pretrained(str(vlm_dir)),
                               tokenizer=AutoTokenizer.from_pretrained(str(vlm_dir)), video_processor=video,
                               chat_template=(vlm_dir / "chat_template.jinja").read_text())


def picture(w, h, seed):
    g = torch.Generator().manual_seed(seed)
    return Image.fromarray(torch.randint(0, 256, (h, w, 3), generator=g, dtype=torch.uint8).numpy())


def test_outputs_equal_hf_processor_with_images_of_different_sizes(vlm_dir):
    proc = load_vision_processor(vlm_dir, tiny_vlm_config(), None)
    hf = hf_processor(vlm_dir)
    images = [picture(90, 60, 0), picture(40, 130, 1), picture(200, 200, 2)]  # the last is shrunk: 40000 < budget
    sample = PromptSample(0, "Compare <image> and <image>, then <image>: which is largest?", "x", images=tuple(images))
    [p] = tokenize_prompts([sample], proc, max_prompt_len=1000)
    messages = [{"role": "user", "content": [{"type": "text", "text": "Compare "}, {"type": "image"},
                                             {"type": "text", "text": " and "}, {"type": "image"},
                                             {"type": "text", "text": ", then "}, {"type": "image"},
                                             {"type": "text", "text": ": which is largest?"}]}]
    text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert p.text == text
    want = hf(text=[text], images=images, return_tensors="pt")
    assert p.ids == want["input_ids"][0].tolist()
    assert torch.equal(p.vision.pixel_values, want["pixel_values"].float())
    assert torch.equal(p.vision.image_grid_thw, want["image_grid_thw"])
    assert len({tuple(g) for g in p.vision.image_grid_thw.tolist()}) == 3  # three different grids
    assert p.vision.tokens_per_image == (want["image_grid_thw"].prod(-1) // 4).tolist()
    p.vision.check_ids(p.ids)
    assert torch.equal(p.vision.mm_token_type_ids(p.ids), want["mm_token_type_ids"][0].int())


def test_pixel_budget_is_the_processors_resize_budget(vlm_dir):
    """data.max_pixels above the folder's budget: an image between the two is kept at its own resolution (Qwen's
    smart_resize with the new budget, recomputed here from its definition), and one above it is refused."""
    budget = 4 * TINY_MAX_PIXELS
    proc = load_vision_processor(vlm_dir, tiny_vlm_config(), budget)
    w, h = 300, 250  # 75000 pixels: above the folder's 50176, below 200704
    v = proc.vision_inputs([picture(w, h, 3)], "sample 0")
    assert v.image_grid_thw.tolist() == [[1, round(h / 28) * 2, round(w / 28) * 2]]
    assert round(h / 28) * round(w / 28) * 784 <= budget
    big = picture(500, 500, 4)
    with pytest.raises(VisionError, match=r"sample 7: the image has 500x500 = 250000 pixels.*data.max_pixels=200704"):
        proc.vision_inputs([big], "sample 7")


def test_plain_text_prompt_gets_the_models_markup(vlm_dir):
    proc = load_vision_processor(vlm_dir, tiny_vlm_config(), None)
    text, ids, v = proc.render("look: <image>!", [picture(56, 56, 5)], apply_chat_template=False)
    assert text == "look: <|vision_start|><|image_pad|><|vision_end|>!"
    assert ids.count(tiny_vlm_config()["image_token_id"]) == v.tokens_per_image[0] == 4


def write_png(path, w, h, seed=0):
    path.parent.mkdir(parents=True, exist_ok=True)
    picture(w, h, seed).save(path)
    return path


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_jsonl_images_resolve_relative_to_the_file(tmp_path, monkeypatch, vlm_dir):
    write_png(tmp_path / "data" / "imgs" / "a.png", 60, 50)
    write_png(tmp_path / "data" / "imgs" / "b.png", 70, 40, seed=1)
    f = write_jsonl(tmp_path / "data" / "train.jsonl", [
        {"prompt": "<image> vs <image>?", "answer": "1", "images": ["imgs/a.png", "imgs/b.png"], "extra": 3},
        {"prompt": [{"role": "user", "content": "<image> count?"}], "answer": "2", "images": "imgs/b.png"},
        {"prompt": "text only", "answer": "0"}])
    monkeypatch.chdir(tmp_path)  # not the data folder: paths must not depend on the working directory
    samples = load_prompts(f, image_key="images", max_pixels=10_000)
    assert samples[0].images == (str(tmp_path / "data/imgs/a.png"), str(tmp_path / "data/imgs/b.png"))
    assert samples[0].metadata == {"extra": 3} and samples[2].images == ()
    proc = load_vision_processor(vlm_dir, tiny_vlm_config(), None)
    prompts = tokenize_prompts(samples, proc, max_prompt_len=1000)
    assert [p.vision.num_images if p.vision else 0 for p in prompts] == [2, 1, 0]


@pytest.mark.parametrize("record, message", [
    ({"prompt": "<image>?", "answer": "1", "images": ["nowhere.png"]}, r"train.jsonl:1: image file not found: .*nowhere.png"),
    ({"prompt": "<image>?", "answer": "1", "images": ["big.png"]},
     r"train.jsonl:1: image .*big.png has 120x100 = 12000 pixels, more than the pixel budget data.max_pixels=10000"),
    ({"prompt": "<image> and <image>?", "answer": "1", "images": ["ok.png"]},
     r"train.jsonl:1: the prompt has 2 image placeholder\(s\) '<image>' but the sample has 1 image\(s\) \(more placeholders"),
    ({"prompt": "how many?", "answer": "1", "images": ["ok.png"]},
     r"the prompt has 0 image placeholder\(s\) '<image>' but the sample has 1 image\(s\) \(fewer placeholders"),
    ({"prompt": "<image>?", "answer": "1"}, r"has 1 image placeholder\(s\).*but the sample has 0 image\(s\)"),
    ({"prompt": "<image>?", "answer": "1", "images": ["not_image.png"]}, r"train.jsonl:1: cannot read image"),
    ({"prompt": "<image>?", "answer": "1", "images": [3]}, r"'images' must be an image path, a list of image paths or embedded images"),
])
def test_bad_image_records_are_one_error_naming_file_and_line(tmp_path, record, message):
    write_png(tmp_path / "ok.png", 50, 50)
    write_png(tmp_path / "big.png", 120, 100)
    (tmp_path / "not_image.png").write_text("hello")
    f = write_jsonl(tmp_path / "train.jsonl", [record])
    with pytest.raises(DatasetError, match=message):
        load_prompts(f, image_key="images", max_pixels=10_000)


def test_config_budget_and_generated_task(tmp_path, vlm_dir):
    write_png(tmp_path / "img.png", 100, 100)
    f = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "<image>?", "answer": "1", "images": ["img.png"]}])
    cfg = load_config(None, [f"model.hf_path={vlm_dir}", f"data.train_path={f}", "data.max_pixels=9000"])
    with pytest.raises(DatasetError, match="data.max_pixels=9000"):
        load_datasets(cfg)
    cfg = load_config(None, [f"model.hf_path={vlm_dir}", f"data.train_path={f}"])  # the folder's budget: 50176
    assert load_datasets(cfg)[0][0].images == (str(tmp_path / "img.png"),)
    cfg = load_config(None, [f"model.hf_path={vlm_dir}", "data.task=count_shapes", "data.count_shapes.num_train=3",
                             "data.count_shapes.min_size=100", "data.count_shapes.max_size=120", "data.max_pixels=9000"])
    with pytest.raises(VisionError, match=r"sample \d+: the image has \d+x\d+ = \d+ pixels.*data.max_pixels=9000"):
        load_datasets(cfg)


def test_images_need_a_vision_model_and_tokens_must_match(vlm_dir):
    sample = PromptSample(3, "<image>?", "1", images=(picture(56, 56, 0),))
    with pytest.raises(PromptError, match="sample 3: the sample has 1 image.*no vision tower"):
        tokenize_prompts([sample], CharTokenizer(), max_prompt_len=100)
    proc = load_vision_processor(vlm_dir, tiny_vlm_config(), None)
    [p] = tokenize_prompts([sample], proc, max_prompt_len=100)
    with pytest.raises(VisionError, match=r"image token runs \[3\] do not match the images' token counts \[4\]"):
        p.vision.check_ids([t for t in p.ids if t != 5] + [5, 5, 5])
    with pytest.raises(PromptError, match="sample 3: prompt has .* tokens > rollout.max_prompt_len=20"):
        tokenize_prompts([sample], proc, max_prompt_len=20)  # image tokens count toward the prompt length


def test_vision_rows_follow_batch_rows():
    a = VisionInputs(torch.randn(16, 1176), torch.tensor([[1, 4, 4]]), 5)
    b = VisionInputs(torch.randn(24, 1176), torch.tensor([[1, 4, 6]]), 5)
    rows = VisionRows([a, None, b, a])
    assert rows[1:3].items == [None, b]
    assert rows[torch.tensor([True, False, True, False])].items == [a, b]
    assert rows[torch.tensor([3, 0])].items == [a, a]
    merged = VisionInputs.concat(rows[0:3].items)
    assert merged.image_grid_thw.tolist() == [[1, 4, 4], [1, 4, 6]] and merged.tokens_per_image == [4, 6]
    assert torch.equal(merged.pixel_values, torch.cat([a.pixel_values, b.pixel_values]))
    with pytest.raises(VisionError, match="pixel_values must be"):
        VisionInputs(torch.randn(10, 1176), torch.tensor([[1, 4, 4]]), 5)


def test_batches_carry_vision_rows():
    from mtrain.rollout.protocol import Completion
    from mtrain.rollout.trajectory import Segment, Trajectory, to_batch
    from mtrain.trainer.batch import RolloutBatch, build_batch

    v = VisionInputs(torch.randn(16, 1176), torch.tensor([[1, 4, 4]]), 5)
    cs = [Completion("a", [1, 5, 5, 5, 5, 2], [7, 8], [-1.0, -2.0], "stop", 0, vision=v),
          Completion("b", [1, 3], [7], [-1.0], "stop", 0)]
    batch = build_batch(cs, [1.0, 0.0], pad_id=0)
    assert batch.vision.items == [v, None]
    assert batch.select(torch.tensor([1, 0])).vision.items == [None, v]
    assert RolloutBatch.concat([batch, batch.select(slice(1, 2))]).vision.items == [v, None, None]
    text_only = build_batch(cs[1:], [0.0], pad_id=0, pad_to_multiple=8)  # concat needs equal widths
    assert text_only.vision is None and text_only.select(slice(0, 1)).vision is None
    assert RolloutBatch.concat([text_only, batch]).vision.items == [None, v, None]
    t = Trajectory("t", [Segment("prompt", [1, 5, 5, 5, 5]), Segment("model", [7], [-1.0], [0])], reward=1.0, vision=v)
    assert to_batch([t], pad_id=0).vision.items == [v]


def test_released_style_preprocessor_config(tmp_path, vlm_dir):
    """A folder whose preprocessor_config.json is written as Qwen2.5-VL's release writes it (min/max_pixels, no
    `size`): the budget and the resize follow it (Qwen's smart_resize, restated here), data.max_pixels overrides."""
    import shutil

    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(vlm_dir / f, tmp_path / f)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({
        "min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
        "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
        "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2_5_VLProcessor"}))
    proc = load_vision_processor(tmp_path, tiny_vlm_config(), None)
    assert proc.max_pixels == 12845056
    w, h = 1000, 700  # 700000 pixels: kept near its size (multiples of 28)
    v = proc.vision_inputs([picture(w, h, 9)], "s")
    assert v.image_grid_thw.tolist() == [[1, round(h / 28) * 2, round(w / 28) * 2]]
    small = load_vision_processor(tmp_path, tiny_vlm_config(), 100_000)
    with pytest.raises(VisionError, match="more than the pixel budget data.max_pixels=100000"):
        small.vision_inputs([picture(w, h, 9)], "s")
    # within the budget, but rounding to multiples of 28 overshoots it (448 x 448 > 200000): floored into it
    mid = load_vision_processor(tmp_path, tiny_vlm_config(), 200_000)
    beta = math.sqrt(447 * 447 / 200_000)
    side = math.floor(447 / beta / 28) * 28  # 420
    assert mid.vision_inputs([picture(447, 447, 1)], "s").image_grid_thw.tolist() == [[1, side // 14, side // 14]]


def test_parquet_with_embedded_images_as_verl_writes_them(tmp_path, vlm_dir):
    """verl / HF datasets parquet: images as [{"bytes": <png>, "path": name}]; decoded by the processor exactly as
    the same file read from disk; a corrupt one is one error naming the row."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    png = write_png(tmp_path / "a.png", 70, 50)
    data = png.read_bytes()
    rows = [{"prompt": "<image>how many?", "answer": "2", "images": [{"bytes": data, "path": "a.png"}]},
            {"prompt": "<image>again?", "answer": "1", "images": [{"bytes": None, "path": str(png)}]}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    samples = load_prompts(tmp_path / "train.parquet", image_key="images", max_pixels=10_000)
    proc = load_vision_processor(vlm_dir, tiny_vlm_config(), None)
    embedded, on_disk = tokenize_prompts(samples, proc, max_prompt_len=1000)
    assert samples[1].images == (str(png),) and isinstance(samples[0].images[0], EncodedImage)
    assert torch.equal(embedded.vision.pixel_values, on_disk.vision.pixel_values)
    buf = io.BytesIO()
    picture(200, 100, 0).save(buf, format="PNG")
    for bad, message in ((b"not a png", r"row 0: cannot read <embedded image x.png>"),
                         (buf.getvalue(), r"row 0: image <embedded image x.png> has 200x100 = 20000 pixels")):
        pq.write_table(pa.Table.from_pylist([{"prompt": "<image>?", "answer": "1",
                                              "images": [{"bytes": bad, "path": "x.png"}]}]), tmp_path / "bad.parquet")
        with pytest.raises(DatasetError, match=message):
            load_prompts(tmp_path / "bad.parquet", image_key="images", max_pixels=10_000)
