"""Block-FP8 checkpoints of the text architectures the layout table knows, not only DeepSeek-V3's: Qwen3 and
Qwen3-MoE FP8 releases use the same format (float8_e4m3fn + `weight_scale_inv` per 128x128 block). Each is written
by `make-fp8` (small blocks: several per matrix, partial edge blocks), converted to Megatron in float32 and exported
back; the export must equal the checkpoint's float32 dequantisation (computed by the test, not by the converters'
reader) bit for bit, every tensor present.
"""
from __future__ import annotations

import json

import pytest
import torch

from mtrain.converters.__main__ import main
from mtrain.converters.fp8_release import make_fp8
from mtrain.converters.safetensors_io import HFCheckpoint
from mtrain.tiny_configs import tiny_config
from test_stage_split_fp8 import dequantized  # noqa: E402  (tests/converters is on sys.path under pytest)


# ~10 s each (two conversions with their rank processes): the dense three run with MTRAIN_SLOW=1
@pytest.mark.parametrize("name", [*(pytest.param(n, marks=pytest.mark.slow) for n in ("llama", "qwen2", "qwen3")),
                                  "qwen3_moe", "deepseek_v3_no_qlora"])
def test_fp8_checkpoint_round_trips_exactly(tmp_path, name):
    (tmp_path / "config.json").write_text(json.dumps(tiny_config(name)))
    release = make_fp8(tmp_path / "release", config=tmp_path / "config.json", seed=1, block=32)
    ckpt = HFCheckpoint(release)
    assert any(ckpt.dtype(n) == torch.float8_e4m3fn for n in ckpt.names())
    assert main(["hf-to-mcore", "--hf", str(release), "--out", str(tmp_path / "mcore"), "--dtype", "float32"]) == 0
    assert main(["mcore-to-hf", "--mcore", str(tmp_path / "mcore"), "--out", str(tmp_path / "back")]) == 0
    want = dequantized(release)  # independent of the converters' FP8 reader
    got = dict(HFCheckpoint(tmp_path / "back").items())
    assert sorted(got) == sorted(want)
    for n, t in want.items():
        assert torch.equal(got[n], t), f"{name}: {n} is not the float32 dequantisation"
