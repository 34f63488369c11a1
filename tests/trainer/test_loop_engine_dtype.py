"""engine.weight_dtype=bfloat16: a bf16 engine under a float32 trainer (the GPU recipe's way to a float32-exact
trainer side, since SGLang has no float32 RMSNorm). 2 real gloo ranks, training TP2, the reference engine; the sync
casts as it copies, in pull and in push."""
from __future__ import annotations

import pytest
import torch

from loop_harness import CONFIG, base_overrides, without_time
from mtrain.dist import run_on_ranks


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from mtrain.tiny_hf import write_tiny_hf
    return write_tiny_hf("llama", tmp_path_factory.mktemp("hf") / "llama", seed=0)


def _engine_weights(engine) -> dict[str, torch.Tensor]:
    from mtrain.rollout.reference_engine import hf_disk_views
    return {k: v.detach().clone() for k, v in hf_disk_views(engine._model).items()}


def _steps(rank, world, hf, run_dir, mode):
    from mtrain.config import load_config
    from mtrain.trainer.loop import Trainer
    t = Trainer(load_config(CONFIG, base_overrides(hf, run_dir, **{"train.steps": 2, "sync.mode": mode,
                                                                     "engine.weight_dtype": "bfloat16"})))
    assert t.actor.dtype == torch.float32 and t.sync.mode == mode
    initial = _engine_weights(t.engine) if rank == 0 else None
    records = [t.train_step() for _ in range(2)]
    weights = _engine_weights(t.engine) if rank == 0 else None
    t.close()
    return records, initial, weights


def test_bf16_engine_under_a_float32_trainer_pull_and_push(tiny_llama, tmp_path):
    from safetensors.torch import load_file
    disk = {}
    for f in sorted(tiny_llama.glob("*.safetensors")):
        disk.update(load_file(f))
    push = run_on_ranks(_steps, 2, tiny_llama, tmp_path / "push", "push", timeout=240)[0]
    pull = run_on_ranks(_steps, 2, tiny_llama, tmp_path / "pull", "pull", timeout=240)[0]
    for records, initial, weights in (push, pull):
        assert {v.dtype for v in initial.values()} == {torch.bfloat16}
        # the first sync is the float32 checkpoint rounded to bf16 (round to nearest even, as torch casts)
        assert initial.keys() == disk.keys()
        assert all(torch.equal(initial[k], disk[k].to(torch.bfloat16)) for k in disk)
        assert sum(not torch.equal(weights[k], initial[k]) for k in weights) > len(weights) // 2  # training moved them
        for r in records:  # the engine's bf16 rounding shows in its logprobs; the float32 trainer has none of it
            assert 1e-5 < r["logprob_diff/mean_abs"] < 0.05, r["logprob_diff/mean_abs"]
    assert [without_time(r) for r in pull[0]] == [without_time(r) for r in push[0]]
    assert all(torch.equal(pull[2][k], push[2][k]) for k in push[2])
