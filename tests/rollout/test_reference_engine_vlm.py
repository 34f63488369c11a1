"""The CPU reference engine on a tiny random Qwen2.5-VL: real generation with images, logprobs equal to a direct
transformers forward of prompt + output (float32; transformers computes its own mRoPE positions there), and image
requests that cannot run refused before any work. Also the SGLang image item, checked against an independent
statement of how SGLang 0.5.17 splits it (runs of image tokens, patches per grid)."""
import pytest
import torch
from PIL import Image

from mtrain.data.chat import tokenize_prompts
from mtrain.data.datasets import PromptSample
from mtrain.data.vision import load_vision_processor
from mtrain.rollout.protocol import EngineError, Request, SamplingParams
from mtrain.rollout.reference_engine import ReferenceEngine
from mtrain.rollout.sglang_wire import completion_from_output, sglang_image_data
from mtrain.tiny_configs import tiny_config
from mtrain.tiny_vlm import tiny_vlm_config, write_tiny_vlm

IMAGE_TOKEN = tiny_vlm_config()["image_token_id"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = write_tiny_vlm(tmp_path_factory.mktemp("vlm"), seed=1)
    proc = load_vision_processor(d, tiny_vlm_config(), None)
    return d, proc, ReferenceEngine.from_pretrained(str(d))


def noise(w, h, seed):
    g = torch.Generator().manual_seed(seed)
    return Image.fromarray(torch.randint(0, 256, (h, w, 3), generator=g, dtype=torch.uint8).numpy())


def prompts(proc):
    samples = [
        PromptSample(0, "<image>How many?", "1", images=(noise(90, 60, 0),)),
        PromptSample(1, "<image>How many?", "1", images=(noise(90, 60, 1),)),  # same length, other pixels: batched
        PromptSample(2, "Left <image> right <image> which?", "1", images=(noise(40, 130, 2), noise(150, 110, 3))),
        PromptSample(3, "no image here", "1"),
    ]
    return tokenize_prompts(samples, proc, max_prompt_len=1000)


def hf_logprobs(model, prompt_ids, output_ids, vision):
    """transformers' forward of prompt + output. A random model may sample <|image_pad|>: such a token is text (the
    engines embed it as text), which transformers' forward cannot express from ids (it counts every image token as
    an image slot), so that case goes through its embeddings, get_image_features and get_rope_index directly."""
    full = torch.tensor([prompt_ids + output_ids])
    p = len(prompt_ids)
    with torch.no_grad():
        if vision is not None and IMAGE_TOKEN in output_ids:
            emb = model.get_input_embeddings()(full)
            mask = full == IMAGE_TOKEN
            mask[:, p:] = False
            emb[mask] = torch.cat(model.model.get_image_features(vision.pixel_values, vision.image_grid_thw)
                                  .pooler_output).to(emb.dtype)
            pos, _ = model.model.get_rope_index(full, mm_token_type_ids=vision.mm_token_type_ids(full, p),
                                                image_grid_thw=vision.image_grid_thw)
            logits = model(inputs_embeds=emb, position_ids=pos).logits[0].double()
        elif vision is not None:
            logits = model(input_ids=full, pixel_values=vision.pixel_values, image_grid_thw=vision.image_grid_thw,
                           mm_token_type_ids=vision.mm_token_type_ids(full)).logits[0].double()
        else:
            logits = model(input_ids=full).logits[0].double()
    lp = torch.log_softmax(logits, -1)
    return [float(lp[p - 1 + k, t]) for k, t in enumerate(output_ids)]


def test_generates_with_images_and_logprobs_equal_hf_forward(setup):
    from transformers import AutoModelForImageTextToText

    d, proc, engine = setup
    ps = prompts(proc)
    assert len(ps[0].ids) == len(ps[1].ids)
    reqs = [Request(f"r{i}-", p.ids, SamplingParams(max_new_tokens=8, seed=100 + i), vision=p.vision)
            for i, p in enumerate(ps)]
    reqs.append(Request("g-", ps[2].ids, SamplingParams(max_new_tokens=5, temperature=0.0), vision=ps[2].vision))
    outs = engine.generate(reqs)
    model = AutoModelForImageTextToText.from_pretrained(str(d), dtype=torch.float32,
                                                        attn_implementation="eager").eval()
    for r, c in zip(reqs, outs):
        assert c.vision is r.vision and c.prompt_ids == r.prompt_ids
        assert len(c.output_ids) == r.params.max_new_tokens
        ref = hf_logprobs(model, r.prompt_ids, c.output_ids, r.vision)
        assert max(abs(a - b) for a, b in zip(ref, c.logprobs)) <= 1e-5, r.rid
    # the images matter: two prompts with identical ids but different pixels give different next-token logprobs
    a = hf_logprobs(model, ps[0].ids, outs[0].output_ids[:1], ps[0].vision)
    b = hf_logprobs(model, ps[0].ids, outs[0].output_ids[:1], ps[1].vision)
    assert abs(a[0] - b[0]) > 1e-4
    # batching does not change a request's tokens (seeded per request)
    alone = engine.generate([reqs[1]])[0]
    assert alone.output_ids == outs[1].output_ids and alone.logprobs == pytest.approx(outs[1].logprobs, abs=1e-5)


def test_sampled_image_token_is_text(setup):
    """A response holding <|image_pad|>: the engine embedded it as text; the HF statement above agrees, and it
    agrees with transformers' plain forward on a response without one."""
    from transformers import AutoModelForImageTextToText

    d, proc, engine = setup
    p = prompts(proc)[0]
    model = AutoModelForImageTextToText.from_pretrained(str(d), dtype=torch.float32,
                                                        attn_implementation="eager").eval()
    found = None
    for seed in range(200):  # sample until a response holds the image token (a random model emits it at ~1/104)
        c = engine.generate([Request("x-", p.ids, SamplingParams(max_new_tokens=8, seed=seed), vision=p.vision)])[0]
        if IMAGE_TOKEN in c.output_ids[:-1]:
            found = c
            break
    assert found is not None
    ref = hf_logprobs(model, p.ids, found.output_ids, p.vision)
    assert max(abs(a - b) for a, b in zip(ref, found.logprobs)) <= 1e-5
    clean = found.output_ids[:found.output_ids.index(IMAGE_TOKEN)]
    if clean:  # the manual path equals transformers' own forward where both apply
        full = torch.tensor([p.ids + clean])
        with torch.no_grad():
            plain = model(input_ids=full, pixel_values=p.vision.pixel_values, image_grid_thw=p.vision.image_grid_thw,
                          mm_token_type_ids=p.vision.mm_token_type_ids(full)).logits[0, len(p.ids) - 1:-1]
        lp = torch.log_softmax(plain.double(), -1)
        want = [float(lp[k, t]) for k, t in enumerate(clean)]
        assert max(abs(a - b) for a, b in zip(want, found.logprobs)) <= 1e-5


def test_image_requests_that_cannot_run_are_refused(setup, tmp_path):
    _, proc, engine = setup
    p = prompts(proc)[0]
    with pytest.raises(EngineError, match="has image tokens .* but no vision inputs"):
        engine.generate([Request("a-", p.ids, SamplingParams(max_new_tokens=2))])
    short = [t for t in p.ids if t != IMAGE_TOKEN] + [IMAGE_TOKEN] * 2
    with pytest.raises(EngineError, match=r"image token runs \[2\] do not match the images' token counts \[6\]"):
        engine.generate([Request("b-", short, SamplingParams(max_new_tokens=2), vision=p.vision)])
    with pytest.raises(EngineError, match="vision must be a VisionInputs"):
        engine.generate([Request("c-", p.ids, SamplingParams(max_new_tokens=2), vision={"pixel_values": 1})])
    fut = engine.submit(Request("d-", short, SamplingParams(max_new_tokens=2), vision=p.vision))
    with pytest.raises(EngineError, match="image token runs"):
        fut.result(timeout=60)
    text_engine = ReferenceEngine(tiny_config("qwen2", vocab_size=120))
    with pytest.raises(EngineError, match="carries images but the model \\(qwen2\\) has no vision tower"):
        text_engine.generate([Request("e-", p.ids, SamplingParams(max_new_tokens=2), vision=p.vision)])


def test_sglang_image_item_splits_back_into_each_images_own_inputs(setup):
    """SGLang keeps our ids and finds image i as the i-th run of image tokens (base_processor.get_mm_items_offset),
    then slices the one item's pixel_values by prod(grid) patches per image (mm_utils.get_new_expanded_mm_items).
    Stated independently here: every slice equals that image processed alone, every run is its token count."""
    _, proc, _ = setup
    p = prompts(proc)[2]
    req = Request("s-", p.ids, SamplingParams(), vision=p.vision)
    [item] = sglang_image_data(req)
    assert item["format"] == "processor_output" and set(item) == {"format", "pixel_values", "image_grid_thw"}
    ids = torch.tensor(p.ids)
    mask = ids == IMAGE_TOKEN
    starts = (mask & ~torch.roll(mask, 1)).nonzero().flatten().tolist()
    ends = (mask & ~torch.roll(mask, -1)).nonzero().flatten().tolist()
    offset = 0
    for i, image in enumerate(p.sample.images):
        alone = proc.vision_inputs([image], "x")
        n = int(item["image_grid_thw"][i].prod())
        assert torch.equal(item["pixel_values"][offset:offset + n], alone.pixel_values)
        assert torch.equal(item["image_grid_thw"][i:i + 1], alone.image_grid_thw)
        assert ends[i] - starts[i] + 1 == n // 4
        offset += n
    assert offset == item["pixel_values"].shape[0] and len(starts) == 2
    assert sglang_image_data(Request("t-", [1, 2], SamplingParams())) is None
    bad = Request("u-", [t for t in p.ids if t != IMAGE_TOKEN], SamplingParams(), vision=p.vision)
    with pytest.raises(EngineError, match="request 'u-': image token runs \\[\\] do not match"):
        sglang_image_data(bad)
    out = {"output_ids": [7], "meta_info": {"output_token_logprobs": [(-0.5, 7, None)], "finish_reason": "length"}}
    assert completion_from_output(req, out, 0).vision is p.vision


def test_sglang_engine_reads_the_models_image_token(setup, tmp_path):
    """The SGLang engine refuses the same image requests as the reference engine (check_vision_request before
    SGLang sees them); it learns the image token from the folder's config.json, without importing SGLang."""
    from mtrain.rollout.sglang_engine import _vision_of
    from mtrain.tiny_hf import write_tiny_hf

    d, _, _ = setup
    assert _vision_of(str(d)) == (IMAGE_TOKEN, "qwen2_5_vl")
    assert _vision_of(str(write_tiny_hf("qwen2", tmp_path / "q"))) == (None, "qwen2")
