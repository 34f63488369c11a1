"""Partial rollout with images on the CPU reference engine (a tiny random Qwen2.5-VL): an aborted sample keeps its
prompt's images in the buffer and in the checkpointed buffer state (torch.save, as trainer_state.pt holds it), and
resumes with them; greedy, the resumed sample equals the uninterrupted one token for token. The same for a
multi-turn trajectory's buffer (its VisionInputs survive a checkpoint), and a sample that sampled the image token
before its abort ends there instead of feeding it back as an image slot."""
from __future__ import annotations

import asyncio
import io
import random

import pytest
import torch

from mtrain.data.chat import tokenize_prompts
from mtrain.data.datasets import PromptSample
from mtrain.data.vision import VisionInputs, load_vision_processor
from mtrain.rollout import partial
from mtrain.rollout import partial_multi_turn as pmt
from mtrain.rollout.client import LocalClient
from mtrain.rollout.protocol import Request, SamplingParams
from mtrain.rollout.reference_engine import ReferenceEngine
from mtrain.tiny_vlm import tiny_vlm_config, write_tiny_vlm
from aborts import abort_after

IMAGE_TOKEN = tiny_vlm_config()["image_token_id"]
GREEDY = SamplingParams(max_new_tokens=30, temperature=0.0)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from scripted_vlm import picture
    d = write_tiny_vlm(tmp_path_factory.mktemp("vlm_partial") / "hf", seed=3)
    proc = load_vision_processor(d, tiny_vlm_config(), None)
    sample = PromptSample(0, "Count <image> the shapes.", "2", images=(picture(112, 84, seed=4),))
    (prompt,) = tokenize_prompts([sample], proc, max_prompt_len=1000)
    return d, proc, prompt


def checkpointed(state):
    """What a checkpoint keeps and a restart reads back (trainer_state.pt is written with torch.save)."""
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def same_images(a: VisionInputs, b: VisionInputs) -> bool:
    return torch.equal(a.pixel_values, b.pixel_values) and torch.equal(a.image_grid_thw, b.image_grid_thw) and \
        (a.image_token_id, a.merge_size) == (b.image_token_id, b.merge_size)


def test_aborted_vlm_sample_resumes_with_its_image_across_a_checkpoint(setup):
    d, proc, prompt = setup
    engine = ReferenceEngine.from_pretrained(str(d), decode_delay_s=0.002)
    engine.finish_weight_update(3)
    client = LocalClient(engine)
    whole = engine.generate([Request("whole-", prompt.ids, GREEDY, vision=prompt.vision)])[0]
    assert whole.finish_reason == "length" and IMAGE_TOKEN not in whole.output_ids  # the case under test
    cut = random.Random(0).randint(5, 20)
    g = partial.new_group(uid=0, sample_index=0, prompt_ids=prompt.ids, n=1, base_seed=0, vision=prompt.vision)

    async def first():
        abort_after(engine, "s0-", cut)
        return await partial.advance(g, client, GREEDY, "s0", score=lambda grp: ([0.0], [""]), filter_uniform=False,
                                     image_token_id=IMAGE_TOKEN)

    counts, g = asyncio.run(first())
    k = len(g.samples[0].output_ids)
    assert not counts and g.samples[0].finish_reason is None and cut <= k < 30
    state = checkpointed(partial.to_state([g]))
    assert isinstance(state[0]["vision"]["pixel_values"], torch.Tensor)  # the pixel values themselves are kept
    (g2,) = partial.from_state(state)
    assert isinstance(g2.vision, VisionInputs) and same_images(g2.vision, prompt.vision)
    engine.finish_weight_update(4)
    counts, g2 = asyncio.run(partial.advance(g2, client, GREEDY, "s1", score=lambda grp: ([1.0], ["x"]),
                                             filter_uniform=False, image_token_id=IMAGE_TOKEN))
    engine.shutdown()
    s = g2.samples[0]
    assert counts and s.finish_reason == "length"
    assert s.output_ids == whole.output_ids  # token-exact continuation: the resumed request had the image
    assert torch.allclose(torch.tensor(s.logprobs), torch.tensor(whole.logprobs), atol=1e-5)
    assert s.versions == [3] * k + [4] * (30 - k)
    (c,) = g2.completions()  # what the trainer's batch is built from keeps the images
    assert same_images(c.vision, prompt.vision) and c.prompt_ids == prompt.ids


def test_a_sample_that_sampled_the_image_token_ends_at_its_abort(setup):
    _, _, prompt = setup
    g = partial.new_group(uid=0, sample_index=0, prompt_ids=prompt.ids, n=2, base_seed=0, vision=prompt.vision)
    g.samples[0].output_ids, g.samples[0].logprobs, g.samples[0].versions = [70, IMAGE_TOKEN], [-1.0, -1.0], [1, 1]
    g.samples[1].output_ids, g.samples[1].logprobs, g.samples[1].versions = [70, 71], [-1.0, -1.0], [1, 1]
    assert partial.resume_request(g, 0, GREEDY, "s", IMAGE_TOKEN) is None and g.samples[0].finish_reason == "length"
    req = partial.resume_request(g, 1, GREEDY, "s", IMAGE_TOKEN)
    assert req.prompt_ids == prompt.ids + [70, 71] and req.vision is prompt.vision and req.params.max_new_tokens == 28


def test_multi_turn_buffer_with_images_survives_a_checkpoint(setup):
    from mtrain.rollout.trajectory import Segment, Trajectory
    _, proc, prompt = setup
    t = Trajectory(rid="s0-g0-0-", segments=[Segment("prompt", list(prompt.ids), text=prompt.text),
                                             Segment("model", [70, 71], [-0.5, -0.25], [1, 1], "ab")],
                   messages=[{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Count"}]}],
                   finish_reason="abort", vision=prompt.vision, metrics={"aborts": 1.0})
    group = pmt.TrajectoryGroup(uid=0, sample_index=0, trajectories=[t])
    dataset = [prompt.sample]
    (back,) = pmt.from_state(checkpointed(pmt.to_state([group])), dataset)
    (t2,) = back.trajectories
    assert isinstance(t2.vision, VisionInputs) and same_images(t2.vision, prompt.vision)
    assert t2.tokens == t.tokens and t2.finish_reason == "abort" and t2.sample is prompt.sample
    assert t2.segments[1].logprobs == [-0.5, -0.25] and t2.messages == t.messages
