"""The Megatron converters on a tiny random Qwen2.5-VL written by transformers' save_pretrained (CPU, gloo ranks):
HF -> Megatron at TP2 -> HF is bit-identical (vision tower included); `verify` runs rows with images through both
models (TP1 loading the TP2 checkpoint, and TP2) within 1e-4; mcore-to-sglang equals an independent slicing of the
HF tensors the way SGLang's loaders do it, padded vision MLP included."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mtrain.converters.__main__ import main
from mtrain.converters.hf_to_mcore import hf_to_mcore
from mtrain.converters.mcore_io import normalized_config
from mtrain.converters.mcore_to_hf import mcore_to_hf
from mtrain.converters.mcore_to_sglang import mcore_to_sglang, rank_file
from mtrain.converters.safetensors_io import HFCheckpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "reshard"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from sglang_reference import sglang_rank_params, sglang_vision_params  # noqa: E402
from vlm_reference import hf_vlm  # noqa: E402


def hf_state(hf_dir: Path) -> dict[str, torch.Tensor]:
    ckpt = HFCheckpoint(hf_dir)
    return {n: ckpt.get(n).clone() for n in ckpt.names()}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlm_conv")
    _, model, _ = hf_vlm(seed=3)
    hf = root / "hf"
    model.save_pretrained(str(hf))
    return root, hf, hf_to_mcore(hf, root / "mcore-tp2", tp=2)


def test_vlm_round_trip_is_bit_identical(converted):
    root, hf, mcore = converted
    back = mcore_to_hf(mcore, root / "back")
    want, got = hf_state(hf), hf_state(back)
    assert sorted(got) == sorted(want) and any(n.startswith("visual.") for n in got)
    for name, t in want.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), f"{name} differs after the round trip"


def test_vlm_verify_with_images_at_tp1(converted, capsys):
    _, hf, mcore = converted  # saved at TP2, loaded at TP1: Megatron reshards on load
    assert main(["verify", "--hf", str(hf), "--mcore", str(mcore)]) == 0
    assert "OK: logits [2, " in capsys.readouterr().out


@pytest.mark.slow
def test_vlm_verify_with_images_at_tp2(converted, capsys):
    _, hf, mcore = converted
    assert main(["verify", "--hf", str(hf), "--mcore", str(mcore), "--tp", "2"]) == 0
    assert "OK: logits [2, " in capsys.readouterr().out


def test_vlm_sglang_shards_equal_sglang_slicing(converted):
    root, hf, mcore = converted
    tp = 2
    out = mcore_to_sglang(mcore, root / "sglang-tp2", engine_tp=tp)
    cfg = normalized_config(json.loads((hf / "config.json").read_text()))
    state = hf_state(hf)
    for r in range(tp):
        want = {**sglang_rank_params(state, cfg, r, tp), **sglang_vision_params(state, cfg, r, tp)}
        got = load_file(out / rank_file(r))
        assert sorted(got) == sorted(want), sorted(set(got) ^ set(want))[:5]
        for name, t in want.items():
            assert got[name].shape == t.shape and torch.equal(got[name], t.to(got[name].dtype)), f"rank {r} {name}"
