"""GRPO with multi-turn tool rollouts about an image, end to end on CPU (1 rank): a tiny Qwen2.5-VL taught a
scripted calculator conversation (tests/rollout/scripted_vlm.py) on the reference engine, a jsonl dataset whose
prompts hold an image file, `multi_turn.rollout_fn` with the calculator, and Megatron recomputing the logprobs of the
multi-turn batch with the image (MRoPE positions over the whole sequence, image features on the prompt's image
tokens only). Checked: the rollouts really call the tool (two model turns), first-step KL 0 and clip fraction 0,
and the trainer's logprobs equal the engine's (<= 1e-5, float32) in both steps, the second after a weight sync.
Partial rollout with images: multi-turn image trajectories wait in the buffer, survive a checkpoint and resume; the
single-turn count_shapes task with rollout.partial keeps its images in the buffer and trains."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from mtrain.dist import run_on_ranks

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "examples" / "qwen2_5_vl" / "tiny_cpu.yaml"
REWARD = REPO / "tests" / "trainer" / "rewards_for_tests.py"


def _scripted_vlm():
    sys.path.insert(0, str(REPO / "tests" / "rollout"))  # scripted_vlm and the scripted_model it builds on
    import scripted_vlm
    return scripted_vlm


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    from mtrain.data.vision import load_vision_processor
    from mtrain.tiny_vlm import tiny_vlm_config, write_tiny_vlm
    from mtrain.tools.calculator import CalculatorTool
    from mtrain.tools.server import ToolServer

    sv = _scripted_vlm()
    root = tmp_path_factory.mktemp("vlm_mt_loop")
    hf = write_tiny_vlm(root / "hf", seed=0)
    proc = load_vision_processor(hf, tiny_vlm_config(), None)
    ids, mask, vision = sv.script(proc, sv.QUESTION, [sv.picture()], [sv.TURN1, sv.ANSWER], [sv.REPLIES],
                                  ToolServer([CalculatorTool()]).schemas)
    sv.train_scripted_vlm(hf, ids, mask, vision)
    sv.picture().save(root / "pic.png")
    data = root / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": sv.QUESTION, "answer": sv.REPLY, "images": "pic.png"}) + "\n"
                            for _ in range(4)))
    return hf, data


def _steps(rank, world, hf, data, run_dir):
    from mtrain.config import load_config
    from mtrain.trainer.loop import Trainer
    over = {"model.hf_path": hf, "train.run_dir": run_dir, "train.steps": 2, "data.train_path": data,
            "data.shuffle": "false", "reward.fn": f"{REWARD}:right_answer_plus_first_sample",
            "rollout.prompts_per_step": 2, "rollout.samples_per_prompt": 2, "rollout.max_new_tokens": 120,
            "train.micro_batch_size": 2, "multi_turn.rollout_fn": "mtrain.rollout.agents.multi_turn:rollout_group",
            "multi_turn.tools": "calculator", "multi_turn.parser_backend": "mtrain", "multi_turn.max_turns": 2,
            "multi_turn.max_total_tokens": 400, "multi_turn.system_prompt": ""}
    t = Trainer(load_config(CONFIG, [f"{k}={v}" for k, v in over.items()]))
    records = [t.train_step() for _ in range(2)]
    t.close()
    return records


def test_multi_turn_vlm_grpo_kl0_logprobs_match_engine(scripted, tmp_path):
    hf, data = scripted
    (records,) = run_on_ranks(_steps, 1, hf, data, tmp_path / "run", timeout=400)
    first = records[0]
    assert first["kl/mean"] == 0.0 and first["ppo/approx_kl"] == 0.0 and first["ppo/clipfrac"] == 0.0, first
    for step, r in enumerate(records, 1):
        assert r["logprob_diff/max_abs"] <= 1e-5, (step, r["logprob_diff/max_abs"])
        assert r["grad_norm"] > 0
    turns = [v for k, v in first.items() if k.endswith("traj/turns")]
    calls = [v for k, v in first.items() if k.endswith("calls_per_traj")]
    assert turns and turns[0] > 1.0 and calls[0] > 0, {k: v for k, v in first.items() if "tools/" in k}


def _partial_steps(rank, world, hf, data, run_dir):
    import torch

    from mtrain.config import load_config
    from mtrain.data.vision import VisionInputs
    from mtrain.trainer.loop import Trainer
    over = {"model.hf_path": hf, "train.run_dir": run_dir, "train.steps": 2, "data.train_path": data,
            "data.shuffle": "false", "reward.fn": f"{REWARD}:right_answer_plus_first_sample",
            "rollout.prompts_per_step": 1, "rollout.samples_per_prompt": 2, "rollout.max_new_tokens": 120,
            "rollout.partial": "true", "rollout.over_sample": 3, "train.micro_batch_size": 2,
            "multi_turn.rollout_fn": "mtrain.rollout.agents.multi_turn:rollout_group", "multi_turn.tools": "calculator",
            "multi_turn.parser_backend": "mtrain", "multi_turn.max_turns": 2, "multi_turn.max_total_tokens": 400,
            "multi_turn.system_prompt": ""}
    # Whether a group is still generating when the quota is met (aborted, so it resumes after the restart) or has
    # just finished depends on how the tool calls interleave on a loaded host: all scripted groups follow the same
    # script nearly in step. A run whose buffer holds no aborted trajectory cannot show the resume; run again.
    for attempt in range(3):
        over["train.run_dir"] = f"{run_dir}/attempt{attempt}"
        t = Trainer(load_config(CONFIG, [f"{k}={v}" for k, v in over.items()]))
        t.run()  # 2 steps, then a checkpoint holding the buffer
        saved = [(g.uid, [(x.tokens, x.vision.pixel_values.clone()) for x in g.trajectories or []])
                 for g in t.source.partial.buffer]
        aborted = sum(x.finish_reason == "abort" for g in t.source.partial.buffer for x in g.trajectories or [])
        t.close()
        if aborted:
            break
    over["train.steps"] = 3
    t = Trainer(load_config(CONFIG, [f"{k}={v}" for k, v in over.items()]))  # resumes from the checkpoint
    restored = [(g.uid, [(x.tokens, x.vision) for x in g.trajectories or []]) for g in t.source.partial.buffer]
    same = [u for u, _ in saved] == [u for u, _ in restored] and all(
        a == c and isinstance(d, VisionInputs) and torch.equal(b, d.pixel_values)
        for (_, xs), (_, ys) in zip(saved, restored) for (a, b), (c, d) in zip(xs, ys))
    records = [t.train_step()]
    t.close()
    return same, saved, aborted, records


def test_partial_multi_turn_vlm_buffer_checkpoints_and_resumes(scripted, tmp_path):
    """rollout.partial with image trajectories: 3 groups in flight for a quota of 1, the rest wait in the buffer
    with their images, which survive the end-of-run checkpoint (tokens and pixel values equal after the restart);
    the resumed run finishes the aborted trajectories on the engine with their images and trains on them."""
    hf, data = scripted
    (res,) = run_on_ranks(_partial_steps, 1, hf, data, tmp_path / "run", timeout=400)
    same, saved, aborted, records = res
    assert saved and any(xs for _, xs in saved), saved  # the buffer held started (aborted or finished) trajectories
    assert aborted >= 1, "three runs without an aborted trajectory in the buffer"
    assert same
    (r,) = records
    assert r["rollout/resumed"] == aborted  # every aborted trajectory of the checkpoint resumed, no other
    # the buffered trajectories resumed on the engine (a request with image tokens but no images is refused) and the
    # step trained on a batch of them (the VLM forward needs every prompt's images for its image tokens). Their tokens
    # are older-version (masked by rollout.offpolicy=mask): a gap is reported only when some are current.
    assert r["rollout/resumed"] >= 1 and r["tools/traj/turns"] >= 1.0 and "grad_norm" in r
    assert r.get("logprob_diff/max_abs", 0.0) <= 1e-5


def _single_turn_partial_steps(rank, world, hf, run_dir):
    from mtrain.config import load_config
    from mtrain.trainer.loop import Trainer
    over = {"model.hf_path": hf, "train.run_dir": run_dir, "train.steps": 2, "rollout.partial": "true",
            "rollout.prompts_per_step": 1, "rollout.over_sample": 3, "rollout.max_new_tokens": 24,
            "reward.fn": f"{REWARD}:right_answer_plus_first_sample"}
    t = Trainer(load_config(CONFIG, [f"{k}={v}" for k, v in over.items()]))
    records = [t.train_step() for _ in range(2)]
    buffered = [g.vision is not None for g in t.source.partial.buffer]
    state = t.source.partial.state_dict()
    t.close()
    return records, buffered, [g["vision"] is not None for g in state["buffer"]]


def test_partial_single_turn_vlm_trains(scripted, tmp_path):
    """rollout.partial on the single-turn count_shapes task (images in every prompt): groups keep their images in
    the buffer and its state; the trainer's logprobs equal the engine's on the current-version tokens."""
    hf, _ = scripted
    (res,) = run_on_ranks(_single_turn_partial_steps, 1, hf, tmp_path / "run", timeout=400)
    records, buffered, in_state = res
    assert records[0]["logprob_diff/max_abs"] <= 1e-5 and records[0]["kl/mean"] == 0.0
    assert all(r.get("logprob_diff/max_abs", 0.0) <= 1e-5 for r in records)
    assert buffered and all(buffered) and in_state == buffered
