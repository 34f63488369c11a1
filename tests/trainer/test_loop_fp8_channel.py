"""engine.weight_dtype=fp8 on a model block FP8 cannot take (hidden 96: no part's rows a multiple of 128): the run
resolves engine.fp8_scaling=auto to per-channel FP8, and the CPU reference engine holds the per-row
dequant(quant) of the trainer's weights. 2 real gloo ranks (training TP2), pull sync.

Checked: after the first sync (the trainer's start) every linear weight of the engine equals an independent
per-row quantization of the checkpoint's weight (float64 formula, tests/kernels/test_fp8_channel.py's), every other
weight the checkpoint's own; then the loop runs with a logprob gap that is nonzero (the engine runs the FP8 values)
and small."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from loop_harness import CONFIG, base_overrides
from mtrain.dist import run_on_ranks

# q/k/v rows 96/96/96, gate/up 160: block FP8 needs multiples of 128
CHANNEL_LLAMA = {"hidden_size": 96, "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 48,
                 "intermediate_size": 160, "num_hidden_layers": 2}


def fake_quant_rows(t: torch.Tensor) -> torch.Tensor:
    """dequant(quant(t)) per row, float64 from the formula (kernels/fp8_channel.py's docstring): float32 result."""
    x = t.to(torch.float32).double().numpy()
    tiny, c = np.finfo(np.float32).tiny, float(np.float32(1 / 448))
    out = np.empty(x.shape, np.float32)
    for i, row in enumerate(x):
        row = np.where(np.abs(row) < tiny, row * 0.0, row)
        scale = np.float32(np.abs(row).max() * c)
        scale = np.float32(0.0) if scale < tiny else scale
        v = np.clip((row * float(np.float32(1 / scale))).astype(np.float32), -448, 448) if scale > 0 else row * 0
        q = torch.from_numpy(np.asarray(v, np.float32)).to(torch.float8_e4m3fn).float().numpy()
        out[i] = (q.astype(np.float64) * float(scale)).astype(np.float32)
    return torch.from_numpy(out)


def _run(rank, world, hf, run_dir):
    from mtrain.config import load_config
    from mtrain.rollout.reference_engine_hf import hf_disk_views
    from mtrain.trainer.loop import Trainer
    t = Trainer(load_config(CONFIG, base_overrides(hf, run_dir, **{"train.steps": 2, "sync.mode": "pull",
                                                                     "engine.weight_dtype": "fp8"})))
    first = {k: v.detach().clone() for k, v in hf_disk_views(t.engine._model).items()} if rank == 0 else None
    scaling = (t.decisions.fp8_scaling, type(t.engine).__name__) if rank == 0 else None
    records = [t.train_step() for _ in range(2)]
    t.close()
    return records, first, scaling


@pytest.mark.slow  # one 2-rank run, ~15-60 s on the shared 2-core box
def test_channel_fp8_engine_in_the_loop(tmp_path):
    from safetensors.torch import load_file
    from mtrain.tiny_hf import write_tiny_hf
    hf = write_tiny_hf("llama", tmp_path / "hf", seed=0, overrides=CHANNEL_LLAMA)
    records, first, scaling = run_on_ranks(_run, 2, hf, tmp_path / "run", timeout=300)[0]
    assert scaling == ("channel", "Fp8ReferenceEngine")
    disk = {}
    for f in sorted(hf.glob("*.safetensors")):
        disk.update(load_file(str(f)))
    linear = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    n_fp8 = 0
    for name, got in first.items():
        want = disk[name].float()
        if any(f".{p}." in name for p in linear):
            want, n_fp8 = fake_quant_rows(want), n_fp8 + 1
            assert not torch.equal(want, disk[name].float()), name  # the quantization shows
        assert torch.equal(got.float(), want.to(got.dtype).float()), name
    assert n_fp8 == 7 * CHANNEL_LLAMA["num_hidden_layers"]
    for r in records:
        assert 0 < r["logprob_diff/mean_abs"] < 0.1, r["logprob_diff/mean_abs"]
