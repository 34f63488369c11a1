"""A GRPO rollout with images through the real path: count_shapes samples -> run_rollout (VisionProcessor renders
once, group_requests carries the vision inputs) -> the pool over 2 gloo ranks with 2 reference engines -> every rank
gets every completion with its images -> build_batch keeps them per row, as the trainer reads them."""
from __future__ import annotations

import torch

from mtrain.models.mrope import image_mask
from mtrain.dist import run_on_ranks

N_PROMPTS, N = 4, 2


def _rollout(rank, world, model_dir):
    import torch.distributed as dist

    from mtrain.config import load_config
    from mtrain.data import load_datasets
    from mtrain.data.count_shapes import count_shapes_reward
    from mtrain.rollout.groups import EngineGroups
    from mtrain.rollout.pool import RolloutPool
    from mtrain.rollout.reference_engine import ReferenceEngine
    from mtrain.trainer.batch import build_batch
    from mtrain.trainer.engines import load_tokenizer
    import json
    from pathlib import Path

    dist.init_process_group("gloo", rank=rank, world_size=world)
    cfg = load_config(None, [f"model.hf_path={model_dir}", "data.task=count_shapes",
                             f"data.count_shapes.num_train={N_PROMPTS}", "data.count_shapes.num_eval=0",
                             "rollout.max_new_tokens=6", f"rollout.samples_per_prompt={N}",
                             "rollout.max_prompt_len=300"])
    hf_config = json.loads((Path(model_dir) / "config.json").read_text())
    proc = load_tokenizer(Path(model_dir), hf_config, max_pixels=cfg.data.max_pixels)
    train, _ = load_datasets(cfg)
    groups = EngineGroups(world, 1, world)
    engine = ReferenceEngine.from_pretrained(model_dir)
    pool = RolloutPool(groups, rank, engine, max_groups_in_flight=1)
    from mtrain.trainer.generation.rollouts import run_rollout
    res = run_rollout(pool, proc, train, cfg, count_shapes_reward, n=N, seed=5, rid_prefix="s0")
    batch = build_batch(res.completions, res.rewards, pad_id=proc.pad_token_id)
    engine.shutdown()
    rows = batch.vision.items
    return dict(served=res.metrics.get("rollout/engines"), rewards=res.rewards,
                grids=[r.image_grid_thw.tolist() for r in rows],
                pixel_sums=[float(r.pixel_values.double().sum()) for r in rows],
                tokens=batch.tokens.tolist(), image_token=proc.image_token_id,
                prompt_lens=(batch.seq_lens - batch.response_lens).tolist(),
                prompts_ok=all(c.vision.tokens_per_image == [c.prompt_ids.count(proc.image_token_id)]
                               for c in res.completions))


def test_image_rollout_over_two_engines(tmp_path):
    from mtrain.tiny_vlm import write_tiny_vlm

    model_dir = str(write_tiny_vlm(tmp_path / "vlm"))
    a, b = run_on_ranks(_rollout, 2, model_dir, timeout=240)
    assert a == b  # every rank holds every group, images included
    assert a["served"] == 2.0 and a["prompts_ok"]
    assert len(a["grids"]) == N_PROMPTS * N and len({str(g) for g in a["grids"]}) > 1
    for i in range(0, N_PROMPTS * N, N):  # a group's rows share one prompt and its images
        assert a["grids"][i] == a["grids"][i + 1] and a["pixel_sums"][i] == a["pixel_sums"][i + 1]
    assert all(0.0 <= r <= 1.0 for r in a["rewards"])
    counts = image_mask(torch.tensor(a["tokens"]), a["image_token"], torch.tensor(a["prompt_lens"])).sum(1)
    assert counts.tolist() == [g[0][1] * g[0][2] // 4 for g in a["grids"]]
    assert torch.tensor(a["tokens"]).shape[0] == N_PROMPTS * N
