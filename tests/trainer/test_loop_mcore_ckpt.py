"""model.mcore_ckpt: a Megatron dist checkpoint from `hf-to-mcore` (saved at TP1, loaded at TP2: megatron reshards
on load) starts the loop from exactly the weights an HF start loads — the two runs log identical metrics."""
from __future__ import annotations

from loop_harness import base_overrides, launch, train_records, without_time


def test_start_from_converted_checkpoint_equals_start_from_hf(tmp_path):
    from mtrain.converters.hf_to_mcore import hf_to_mcore
    from mtrain.tiny_hf import write_tiny_hf
    hf = write_tiny_hf("qwen2", tmp_path / "hf", seed=3)
    mcore = hf_to_mcore(hf, tmp_path / "mcore", tp=1)
    from_hf, from_mcore = tmp_path / "from_hf", tmp_path / "from_mcore"
    launch(base_overrides(hf, from_hf, **{"train.steps": 1}), cwd=tmp_path)
    launch(base_overrides(hf, from_mcore, **{"train.steps": 1, "model.mcore_ckpt": mcore}), cwd=tmp_path)
    a, b = train_records(from_hf), train_records(from_mcore)
    assert sorted(a) == [1] and without_time(a[1]) == without_time(b[1])
