"""Multi-turn tool rollouts with an image, on the CPU reference engine running transformers' Qwen2.5-VL (a tiny
random one taught a scripted calculator conversation, scripted_vlm.py): the image is in the first user message, a
tool turn follows, and every turn's request carries the same image inputs (the engine prefills the whole trajectory
each turn).

Checked against transformers directly: the engine's logprobs of every model token (both turns) equal one forward
of the whole final sequence with the image (float32, <= 1e-5) -- so the image reached every turn; the batch's MRoPE
positions (mtrain's own function over the full multi-turn sequence) equal transformers' get_rope_index; token-in-
token-out (each request's prompt is the trajectory so far), no drift; and an image token after the prompt ends a
trajectory instead of being fed back as an image slot.
"""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch

from mtrain.data.datasets import PromptSample
from mtrain.data.vision import load_vision_processor
from mtrain.rollout import SamplingParams
from mtrain.rollout.agents.multi_turn import RolloutContext, rollout_group
from mtrain.rollout.client import RecordingClient
from mtrain.rollout.reference_engine import ReferenceEngine
from mtrain.rollout.trajectory import to_batch
from mtrain.tiny_vlm import tiny_vlm_config, write_tiny_vlm
from mtrain.tools.calculator import CalculatorTool
from mtrain.tools.parsers import ToolCallParser
from mtrain.tools.server import ToolServer
from mtrain.trainer.vision_inputs import VisionBatcher
from scripted_vlm import ANSWER, QUESTION, REPLIES, REPLY, TURN1, picture, script, train_scripted_vlm

IMAGE_TOKEN = tiny_vlm_config()["image_token_id"]


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    d = write_tiny_vlm(tmp_path_factory.mktemp("vlm_mt") / "hf", seed=0)
    proc = load_vision_processor(d, tiny_vlm_config(), None)
    tools = ToolServer([CalculatorTool()])
    ids, mask, vision = script(proc, QUESTION, [picture()], [TURN1, ANSWER], [REPLIES], tools.schemas)
    train_scripted_vlm(d, ids, mask, vision)
    return d, proc, ids


def ctx_for(proc, **kw):
    tools = ToolServer([CalculatorTool()])
    kw.setdefault("params", SamplingParams(max_new_tokens=120, temperature=0.0, stop_token_ids=(proc.eos_token_id,)))
    return RolloutContext(tokenizer=proc, tools=tools, parser=ToolCallParser("qwen25", tools.schemas, backend="mtrain"),
                          reward_fn=lambda response, answer, **_: float(str(answer) in response), system_prompt=None,
                          rid_prefix="v0", max_positions=1024, **kw)


def test_two_turn_calculator_trajectory_with_an_image_equals_transformers(scripted):
    from transformers import AutoModelForImageTextToText

    d, proc, script_ids = scripted
    engine = ReferenceEngine.from_pretrained(str(d))
    client = RecordingClient(engine)
    sample = PromptSample(0, QUESTION, REPLY, images=(picture(),))
    (traj,) = asyncio.run(rollout_group(sample, 1, client, ctx_for(proc)))
    engine.shutdown()

    assert [s.kind for s in traj.segments] == ["prompt", "model", "env", "model"], traj.finish_reason
    assert traj.finish_reason == "stop" and traj.turns == 2 and traj.reward == 1.0
    assert [c["output"] for c in traj.tool_calls] == ["36"]
    assert proc.decode(traj.segments[3].ids, skip_special_tokens=True) == ANSWER
    assert traj.tokens == script_ids and traj.metrics["drift/tokens"] == 0.0
    assert traj.vision is not None and traj.vision.num_images == 1
    # every turn's request: the trajectory so far and the same image inputs (the prompt's expanded image tokens)
    assert len(client.log) == 2
    for (req, comp), seg in zip(client.log, [traj.segments[1], traj.segments[3]]):
        assert req.vision is traj.vision and comp.vision is traj.vision
        assert req.prompt_ids == traj.tokens[:len(req.prompt_ids)]
        assert comp.output_ids == seg.ids and comp.logprobs == seg.logprobs

    # the engine's logprobs of every model token == one transformers forward of the whole sequence with the image
    model = AutoModelForImageTextToText.from_pretrained(str(d), dtype=torch.float32, attn_implementation="eager").eval()
    full = torch.tensor([traj.tokens])
    v = traj.vision
    with torch.no_grad():
        logits = model(input_ids=full, pixel_values=v.pixel_values, image_grid_thw=v.image_grid_thw,
                       mm_token_type_ids=v.mm_token_type_ids(full)).logits[0].double()
    lp = torch.log_softmax(logits, -1)
    batch = to_batch([traj], pad_id=proc.pad_token_id)
    mask = batch.response_mask[0].bool()
    want = lp[:-1].gather(-1, full[0, 1:, None])[:, 0][mask]
    got = batch.engine_logprobs[0][mask].double()
    assert mask.sum() == traj.num_model_tokens and (got - want).abs().max() <= 1e-5, (got - want).abs().max()

    # the trainer's batch: the images per row, the prompt's image tokens only, MRoPE over the full multi-turn sequence
    assert batch.vision.items == [traj.vision]
    assert int(batch.seq_lens[0] - batch.response_lens[0]) == traj.prompt_len
    ours, _ = VisionBatcher(json.loads((Path(d) / "config.json").read_text())).batch_inputs(batch)  # the trainer's
    theirs, _ = model.model.get_rope_index(full, mm_token_type_ids=v.mm_token_type_ids(full),
                                           image_grid_thw=v.image_grid_thw)
    assert torch.equal(ours.long(), theirs.long())
    assert int(ours[0, 0, -1]) < len(traj.tokens) - 1  # the image's positions are compressed: text continues after


def test_a_sampled_image_token_ends_the_trajectory_and_images_need_a_vision_model(scripted):
    """An image token after the prompt (a random model may sample <|image_pad|>; here a client returns one) ends
    the trajectory: fed back, the engines would take it for an image slot. It is trained as text."""
    from mtrain.data import CharTokenizer
    from mtrain.rollout.protocol import Completion

    d, proc, _ = scripted

    class ImageTokenClient:  # a real engine's completion with an image token in it (as a random model may sample)
        weight_version = 1

        def __init__(self):
            self.requests = []

        async def generate(self, req):
            self.requests.append(req)
            return Completion(req.rid, list(req.prompt_ids), [70, IMAGE_TOKEN, 71], [-1.0, -2.0, -3.0], "stop", 1,
                              vision=req.vision)

    client = ImageTokenClient()
    sample = PromptSample(0, QUESTION, REPLY, images=(picture(),))
    (traj,) = asyncio.run(rollout_group(sample, 1, client, ctx_for(proc)))
    assert traj.finish_reason == "image_token" and len(client.requests) == 1 and traj.reward is not None
    batch = to_batch([traj], pad_id=proc.pad_token_id)  # trained as text: not in the image mask
    assert int(batch.seq_lens[0] - batch.response_lens[0]) == traj.prompt_len

    text_ctx = RolloutContext(tokenizer=CharTokenizer(128), tools=ToolServer([CalculatorTool()]),
                              parser=ToolCallParser("qwen25", ToolServer([CalculatorTool()]).schemas, backend="mtrain"),
                              params=SamplingParams(max_new_tokens=4, stop_token_ids=(1,)), reward_fn=None,
                              system_prompt=None)
    with pytest.raises(ValueError, match="sample 0: the sample has 1 image.*no vision tower"):
        asyncio.run(rollout_group(sample, 1, client, text_ctx))


def test_aborted_image_trajectory_resumes_with_its_image_across_a_checkpoint(scripted):
    """Aborted in its second turn (after the tool call), checkpointed (the buffer's plain data through torch.save)
    and resumed at the same turn with the same image inputs: token for token the uninterrupted trajectory."""
    import io

    from mtrain.rollout import partial_multi_turn as pmt
    from mtrain.rollout.agents.multi_turn import resume_group

    d, proc, script_ids = scripted
    engine = ReferenceEngine.from_pretrained(str(d), decode_delay_s=0.005)
    sample = PromptSample(0, QUESTION, REPLY, images=(picture(),))
    ctx = ctx_for(proc)
    turn1 = len(proc.encode(TURN1, add_special_tokens=False)) + 1
    try:
        async def abort_in_turn_two():
            client = RecordingClient(engine)
            task = asyncio.create_task(rollout_group(sample, 1, client, ctx))
            while not any(r.endswith("t1-0-") and n >= 2 for r, n in engine.active_requests().items()):
                await asyncio.sleep(0.002)
            client.abort(ctx.rid_prefix)
            return await task
        (t,) = asyncio.run(abort_in_turn_two())
        assert t.finish_reason == "abort" and t.turns == 1 and [s.kind for s in t.segments][-2:] == ["env", "model"]
        done = len(t.segments[-1].ids)
        buf = io.BytesIO()
        torch.save(pmt.to_state([pmt.TrajectoryGroup(0, 0, [t])]), buf)
        buf.seek(0)
        (group,) = pmt.from_state(torch.load(buf, weights_only=False), [sample])
        engine.finish_weight_update(2)
        client = RecordingClient(engine)
        (t,) = asyncio.run(resume_group(group.trajectories, client, ctx))
    finally:
        engine.shutdown()
    assert t.finish_reason == "stop" and t.turns == 2 and t.reward == 1.0
    assert t.tokens == script_ids  # the uninterrupted trajectory (greedy), image tokens included
    (req, _), = client.log
    assert req.vision is t.vision and req.prompt_ids == script_ids[:len(req.prompt_ids)]
    assert torch.equal(t.vision.pixel_values, proc.vision_inputs([picture()], "x").pixel_values)
    v0 = t.segments[1].versions[0]  # the weights before the sync
    assert v0 != 2 and t.segments[1].versions == [v0] * turn1
    assert t.segments[3].versions == [v0] * done + [2] * (len(t.segments[3].ids) - done)
    assert [c["output"] for c in t.tool_calls] == ["36"]  # replayed into the fresh session, logged once
