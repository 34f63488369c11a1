"""engine.weight_dtype=fp8 in the RL loop on CPU: 2 real gloo ranks (training TP2), the FP8-emulating reference
engine, pull and push. Both modes leave the engine with the same bits; the engine-vs-trainer logprob gap shows
the quantization (nonzero, small) where the bf16-exact run has none (max 1e-5, test_loop_in_process)."""
from __future__ import annotations

import pytest
import torch

from loop_harness import CONFIG, base_overrides
from mtrain.dist import run_on_ranks

# 128-block-friendly tiny Llama: q, k, v of 128 rows each, intermediate 256 (SGLang's FP8 rules at engine TP 1)
FP8_LLAMA = {"hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 64,
             "intermediate_size": 256, "num_hidden_layers": 2}


@pytest.fixture(scope="module")
def fp8_llama(tmp_path_factory):
    from mtrain.tiny_hf import write_tiny_hf
    return write_tiny_hf("llama", tmp_path_factory.mktemp("hf") / "llama", seed=0, overrides=FP8_LLAMA)


def _steps(rank, world, hf, run_dir, mode):
    from mtrain.config import load_config
    from mtrain.rollout.reference_engine import hf_disk_views
    from mtrain.trainer.loop import Trainer
    t = Trainer(load_config(CONFIG, base_overrides(hf, run_dir, **{"train.steps": 2, "sync.mode": mode,
                                                                     "engine.weight_dtype": "fp8"})))
    records = [t.train_step() for _ in range(2)]
    weights = {k: v.detach().clone() for k, v in hf_disk_views(t.engine._model).items()} if rank == 0 else None
    kind = type(t.engine).__name__ if rank == 0 else None
    t.close()
    return records, weights, kind


@pytest.mark.slow  # four 2-rank runs, ~90 s on the 2-core box
def test_fp8_engine_in_the_loop_pull_and_push(fp8_llama, tmp_path):
    push = run_on_ranks(_steps, 2, fp8_llama, tmp_path / "push", "push", timeout=240)[0]
    pull = run_on_ranks(_steps, 2, fp8_llama, tmp_path / "pull", "pull", timeout=240)[0]
    assert push[2] == pull[2] == "Fp8ReferenceEngine"
    assert all(torch.equal(pull[1][k], push[1][k]) for k in push[1])
    for r in push[0] + pull[0]:
        assert 0 < r["logprob_diff/mean_abs"] < 0.1, r["logprob_diff/mean_abs"]


@pytest.mark.slow  # ~130 s on the shared 2-core box; tests/rollout/test_lora_adapters.py checks the engine's numbers
def test_fp8_engine_with_lora_torchrun(fp8_llama, tmp_path):
    """engine.weight_dtype=fp8 with LoRA under torchrun (2 gloo ranks, TP2, the CPU FP8 engine): the base arrives
    quantized once, every step's sync is adapters only, and the engine-vs-trainer gap is the quantization's (nonzero,
    small), as for full fine-tuning above."""
    from loop_harness import launch, train_records
    run = tmp_path / "run"
    launch(base_overrides(fp8_llama, run, **{"train.steps": 2, "engine.weight_dtype": "fp8",
                                             "model.lora.targets": "qkv,o_proj,gate_up,down", "model.lora.rank": 4,
                                             "model.lora.alpha": 8, "model.lora.lr": 1e-2}), tmp_path, timeout=400)
    recs = train_records(run)
    assert sorted(recs) == [1, 2]
    for r in recs.values():
        assert r["sync/adapters_only"] == 1.0
        assert 0 < r["logprob_diff/mean_abs"] < 0.1, r["logprob_diff/mean_abs"]
