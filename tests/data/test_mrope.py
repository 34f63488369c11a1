"""mRoPE positions from ids + VisionInputs equal transformers' Qwen2.5-VL get_rope_index (the reference)."""
import pytest
import torch
from PIL import Image

from mtrain.data.datasets import PromptSample
from mtrain.data.chat import tokenize_prompts
from mtrain.data.mrope import batch_mrope_positions, mrope_positions
from mtrain.data.vision import VisionError, load_vision_processor
from mtrain.tiny_vlm import tiny_vlm_config, write_tiny_vlm


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import AutoConfig, AutoModelForImageTextToText

    d = write_tiny_vlm(tmp_path_factory.mktemp("vlm"))
    proc = load_vision_processor(d, tiny_vlm_config(), None)
    model = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(str(d)))
    return proc, model.model


def noise(w, h, seed):
    g = torch.Generator().manual_seed(seed)
    return Image.fromarray(torch.randint(0, 256, (h, w, 3), generator=g, dtype=torch.uint8).numpy())


def test_positions_equal_transformers_get_rope_index(setup):
    proc, model = setup
    samples = [PromptSample(0, "<image> count", "1", images=(noise(90, 60, 0),)),
               PromptSample(1, "a <image> b <image> c", "1", images=(noise(40, 130, 1), noise(200, 160, 2))),
               PromptSample(2, "<image>", "1", images=(noise(300, 20, 3),))]  # wide: h grid < w grid
    deltas = []
    for p in tokenize_prompts(samples, proc, max_prompt_len=1000):
        ids = p.ids + [40, 41, 42]  # a response after the prompt continues the text positions
        full = torch.tensor([ids])
        want, want_delta = model.get_rope_index(full, mm_token_type_ids=p.vision.mm_token_type_ids(full),
                                                image_grid_thw=p.vision.image_grid_thw)
        got, delta = mrope_positions(ids, p.vision)
        assert torch.equal(got, want[:, 0]) and delta == int(want_delta)
        deltas.append(delta)
    assert deltas[0] < 0 and deltas[2] == 0  # a 2x3 image spans 3 positions for 6 tokens; a 1x11 one 11 for 11
    text, delta = mrope_positions([40, 41, 42], None)
    assert text.tolist() == [[0, 1, 2]] * 3 and delta == 0


def test_batch_positions_and_bad_runs(setup):
    proc, _ = setup
    [p] = tokenize_prompts([PromptSample(0, "<image>?", "1", images=(noise(56, 84, 0),))], proc, max_prompt_len=1000)
    tokens = torch.zeros((2, len(p.ids) + 4), dtype=torch.long)
    tokens[0, :len(p.ids)] = torch.tensor(p.ids)
    tokens[1, :3] = torch.tensor([40, 41, 42])
    pos = batch_mrope_positions(tokens, torch.tensor([len(p.ids), 3]), [p.vision, None])
    own, delta = mrope_positions(p.ids, p.vision)
    assert torch.equal(pos[:, 0, :len(p.ids)], own)
    assert pos[:, 0, len(p.ids)].tolist() == [len(p.ids) + delta] * 3
    assert pos[:, 1].tolist() == [list(range(tokens.shape[1]))] * 3
    with pytest.raises(VisionError, match="mrope_positions: image token runs"):
        mrope_positions(p.ids[:-3] + [p.vision.image_token_id], p.vision)


def test_image_token_sampled_in_the_response_is_text(setup):
    """prompt_len: a response's <|image_pad|> takes text positions (as in the engines), equal to transformers'
    get_rope_index told by mm_token_type_ids that it is text."""
    from mtrain.models.mrope import image_mask

    proc, model = setup
    [p] = tokenize_prompts([PromptSample(0, "<image>?", "1", images=(noise(84, 56, 1),))], proc, max_prompt_len=1000)
    img = p.vision.image_token_id
    ids = p.ids + [40, img, img, 41]
    full = torch.tensor([ids])
    want, want_delta = model.get_rope_index(full, mm_token_type_ids=p.vision.mm_token_type_ids(full, len(p.ids)),
                                            image_grid_thw=p.vision.image_grid_thw)
    got, delta = mrope_positions(ids, p.vision, prompt_len=len(p.ids))
    assert torch.equal(got, want[:, 0]) and delta == int(want_delta)
    assert got[:, -3:].tolist() == [[len(p.ids) + delta + k for k in (1, 2, 3)]] * 3
    with pytest.raises(VisionError):  # without prompt_len the response's tokens would be a third image run
        mrope_positions(ids, p.vision)
    mask = image_mask(full, img, torch.tensor([len(p.ids)]))
    assert int(mask.sum()) == sum(p.vision.tokens_per_image) and not mask[0, len(p.ids):].any()
