"""Bad input to the Megatron converters: one clear error naming the tensor or setting, and nothing left at --out.

All HF-side checks run in the converting process before any rank starts, so only the half-written dist
checkpoint cases need one real conversion (made once for the module).
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mtrain.converters.__main__ import main
from mtrain.converters.errors import CheckpointError, ConvertError, OutputExistsError, TensorMismatchError
from mtrain.converters.hf_to_mcore import check_input, hf_to_mcore
from mtrain.converters.mcore_io import ParallelSizeError
from mtrain.converters.mcore_to_hf import mcore_to_hf
from mtrain.converters.mcore_to_sglang import mcore_to_sglang
from mtrain.tiny_hf import write_tiny_hf

from test_mcore_converters import add_mtp_layer  # noqa: E402  (tests/converters is on sys.path under pytest)


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bad_src")
    return {arch: write_tiny_hf(arch, root / arch) for arch in ("llama", "qwen3_moe", "deepseek_v3")}


@pytest.fixture(scope="module")
def good_mcore(sources, tmp_path_factory) -> Path:
    return hf_to_mcore(sources["llama"], tmp_path_factory.mktemp("bad_mcore") / "llama-tp1")


def copy_of(src: Path, tmp_path: Path, name: str = "src") -> Path:
    return Path(shutil.copytree(src, tmp_path / name))


def edit_weights(hf_dir: Path, fn) -> None:
    state = load_file(hf_dir / "model.safetensors")
    fn(state)
    save_file(state, str(hf_dir / "model.safetensors"), metadata={"format": "pt"})


def assert_nothing_left(out: Path) -> None:
    assert not out.exists(), f"{out} was created by a failed conversion"
    leftovers = [p.name for p in out.parent.iterdir() if p.name.startswith(out.name + ".")]
    assert not leftovers, f"temp directories left behind: {leftovers}"


def convert_fails(hf: Path, out: Path, exc: type, match: str, **par) -> None:
    with pytest.raises(exc, match=match):
        hf_to_mcore(hf, out, **par)
    assert_nothing_left(out)


Q = "model.layers.0.self_attn.q_proj.weight"


def test_missing_tensor(sources, tmp_path):
    hf = copy_of(sources["llama"], tmp_path)
    edit_weights(hf, lambda s: s.pop("model.layers.1.mlp.up_proj.weight"))
    convert_fails(hf, tmp_path / "out", CheckpointError, r"missing tensor\(s\).*model\.layers\.1\.mlp\.up_proj\.weight")


def test_unexpected_tensor(sources, tmp_path):
    hf = copy_of(sources["llama"], tmp_path)
    edit_weights(hf, lambda s: s.update({"model.layers.0.mlp.extra_proj.weight": torch.zeros(4, 4)}))
    convert_fails(hf, tmp_path / "out", CheckpointError,
                  r"unexpected tensor.*model\.layers\.0\.mlp\.extra_proj\.weight")


def test_shape_mismatch(sources, tmp_path):
    hf = copy_of(sources["llama"], tmp_path)
    edit_weights(hf, lambda s: s.update({Q: torch.zeros(127, 64)}))
    convert_fails(hf, tmp_path / "out", TensorMismatchError, rf"'{Q}' has shape \[127, 64\].*\[128, 64\]")


def test_integer_tensor_is_refused(sources, tmp_path):
    hf = copy_of(sources["llama"], tmp_path)
    edit_weights(hf, lambda s: s.update({"model.norm.weight": torch.ones(64, dtype=torch.int32)}))
    convert_fails(hf, tmp_path / "out", TensorMismatchError, r"'model\.norm\.weight' has dtype torch\.int32")


def test_other_float_width_is_accepted(sources, tmp_path):
    """A float16 tensor in a float32 checkpoint is cast on conversion, not refused (checked without ranks)."""
    hf = copy_of(sources["llama"], tmp_path)
    edit_weights(hf, lambda s: s.update({Q: s[Q].to(torch.float16)}))
    check_input(hf, 1, 1, 1, None)


def test_truncated_safetensors(sources, tmp_path):
    hf = copy_of(sources["llama"], tmp_path)
    f = hf / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    convert_fails(hf, tmp_path / "out", CheckpointError, r"model\.safetensors: truncated file")


def test_tp_not_dividing_heads(sources, tmp_path):
    convert_fails(sources["llama"], tmp_path / "out", ParallelSizeError,
                  r"tp=3 .*num_key_value_heads\) \(2\) is not divisible by the parallel size \(3\)", tp=3)


def test_ep_not_dividing_experts(sources, tmp_path):
    convert_fails(sources["qwen3_moe"], tmp_path / "out", ParallelSizeError,
                  r"num experts \(4\) is not divisible by expert parallel size \(3\)", ep=3)


def test_ep_for_a_dense_model(sources, tmp_path):
    convert_fails(sources["llama"], tmp_path / "out", ParallelSizeError, r"expert parallel size 2 given for a model "
                  r"without experts", ep=2)


def test_mtp_copy_that_differs_from_the_embedding(sources, tmp_path):
    hf = copy_of(sources["deepseek_v3"], tmp_path)
    add_mtp_layer(hf)
    edit_weights(hf, lambda s: s["model.layers.4.embed_tokens.weight"].add_(1.0))
    convert_fails(hf, tmp_path / "out", CheckpointError,
                  r"'model\.layers\.4\.embed_tokens\.weight' differs from 'model\.embed_tokens\.weight'")


def test_output_already_holds_a_checkpoint(sources, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text("{}")
    with pytest.raises(OutputExistsError, match=r"already holds a checkpoint \(config\.json\).*--force"):
        hf_to_mcore(sources["llama"], out)
    assert [p.name for p in out.iterdir()] == ["config.json"] and (out / "config.json").read_text() == "{}"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("out.")]


def test_cli_prints_one_line_and_exits_2(sources, tmp_path, capsys):
    assert main(["hf-to-mcore", "--hf", str(sources["qwen3_moe"]), "--out", str(tmp_path / "out"), "--ep", "3"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("mtrain-convert: error:") and "expert parallel size (3)" in err
    assert_nothing_left(tmp_path / "out")


@pytest.mark.parametrize("damage, match", [
    ("metadata.json", r"incomplete Megatron dist checkpoint \(half-written\?\): missing metadata\.json"),
    (".metadata", r"incomplete Megatron dist checkpoint \(half-written\?\): missing \.metadata"),
    ("shard", r"shard file __0_0\.distcp is missing"),
    ("truncate", r"__0_0\.distcp: truncated shard"),
])
def test_half_written_dist_checkpoint(good_mcore, tmp_path, damage, match):
    mcore = copy_of(good_mcore, tmp_path, "mcore")
    if damage == "shard":
        (mcore / "__0_0.distcp").unlink()
    elif damage == "truncate":
        f = mcore / "__0_0.distcp"
        f.write_bytes(f.read_bytes()[:100])
    else:
        (mcore / damage).unlink()
    with pytest.raises(CheckpointError, match=match):
        mcore_to_hf(mcore, tmp_path / "out")
    assert_nothing_left(tmp_path / "out")
    with pytest.raises(CheckpointError, match=match):
        mcore_to_sglang(mcore, tmp_path / "sgl", engine_tp=1)
    assert_nothing_left(tmp_path / "sgl")


def test_mcore_to_hf_output_exists(good_mcore, sources, tmp_path):
    out = copy_of(sources["llama"], tmp_path, "out")
    with pytest.raises(OutputExistsError, match="already holds a checkpoint"):
        mcore_to_hf(good_mcore, out)
    assert (out / "model.safetensors").is_file()


def test_sglang_engine_tp_not_dividing_heads(good_mcore, tmp_path):
    with pytest.raises(ConvertError, match=r"engine tp=3 .*not divisible by the parallel size \(3\)"):
        mcore_to_sglang(good_mcore, tmp_path / "sgl", engine_tp=3)
    assert_nothing_left(tmp_path / "sgl")
