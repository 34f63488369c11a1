"""The DeepSeek-V3 release path at reduced size: an FP8 (block-scaled) checkpoint with an MTP layer, written by
`make-fp8`, converted at an uneven pipeline split (`--first-stage-layers/--last-stage-layers`), exported back
and checked against transformers; and the bad input of that path, each with one clear error and nothing
written (no output directory, no temp directory left beside it).
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mtrain.converters.__main__ import main
from mtrain.converters.fp8_release import make_fp8, quantize_fp8_blockwise, release_quantizes
from mtrain.converters.safetensors_io import HFCheckpoint
from mtrain.tiny_configs import tiny_config

BLOCK = 32  # small blocks: several per matrix, partial edge blocks


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("fp8")
    (root / "config.json").write_text(json.dumps(tiny_config("deepseek_v3")))
    return make_fp8(root / "release", config=root / "config.json", seed=3, block=BLOCK)


def dequantized(d: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's float32 dequantisation, written here independently of the converters' reader (which
    hf-to-mcore uses): every float8 element times its block's scale, exact in float64, rounded once to float32."""
    ckpt = HFCheckpoint(d)
    br, bc = ckpt.config["quantization_config"]["weight_block_size"]
    names = set(ckpt.names())
    out = {}
    for n in sorted(x for x in names if not x.endswith("_scale_inv")):
        t = ckpt.get(n).double()
        if n + "_scale_inv" in names:
            rows, cols = t.shape
            scale = ckpt.get(n + "_scale_inv").double()
            t = t * scale.repeat_interleave(br, 0)[:rows].repeat_interleave(bc, 1)[:, :cols]
        out[n] = t.float()
    return out


def leftovers(parent: Path, name: str) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith(name))


# ------------------------------------------------------------------------------------------ the writer

def test_quantiser_against_float64_blocks():
    g = torch.Generator().manual_seed(0)
    t = torch.randn(70, 45, generator=g) * torch.logspace(-3, 1, 45)  # columns of very different magnitudes
    t[:32, :32] = 0.0  # an all-zero block
    q, s = quantize_fp8_blockwise(t, (32, 16))
    assert q.dtype == torch.float8_e4m3fn and s.shape == (3, 3) and s.dtype == torch.float32
    t64 = t.double()
    for bi in range(3):
        for bj in range(3):
            blk = t64[bi * 32:(bi + 1) * 32, bj * 16:(bj + 1) * 16]
            amax = blk.abs().max().item()
            want = amax / 448.0 if amax > 0 else 1.0
            assert s[bi, bj].item() == pytest.approx(want, rel=1e-6)
            deq = q[bi * 32:(bi + 1) * 32, bj * 16:(bj + 1) * 16].double() * s[bi, bj].double()
            # e4m3 keeps 3 mantissa bits: relative rounding error <= 2^-4 above its subnormal range
            tol = blk.abs() * 2.0 ** -4 + s[bi, bj].double() * 2.0 ** -9
            assert (deq - blk).abs().le(tol).all(), (bi, bj)
            if amax > 0:
                assert deq.abs().max().item() == pytest.approx(amax, rel=1e-6)  # the block max maps to 448


def test_release_format(fp8_dir):
    ckpt = HFCheckpoint(fp8_dir)
    cfg = ckpt.config
    assert cfg["quantization_config"]["weight_block_size"] == [BLOCK, BLOCK]
    names = set(ckpt.names())
    fp8 = {n for n in names if ckpt.dtype(n) == torch.float8_e4m3fn}
    assert fp8 and all(n + "_scale_inv" in names for n in fp8)
    assert fp8 == {n for n in names if release_quantizes(n, ckpt.shape(n))}
    # the release's FP8 tensors of an attention layer (its index: q_a, q_b, kv_a_proj_with_mqa, kv_b, o)
    assert {n.removeprefix("model.layers.0.self_attn.") for n in fp8 if n.startswith("model.layers.0.self_attn.")} \
        == {"q_a_proj.weight", "q_b_proj.weight", "kv_a_proj_with_mqa.weight", "kv_b_proj.weight", "o_proj.weight"}
    for n in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.1.mlp.gate.weight",
              "model.layers.4.eh_proj.weight", "model.layers.4.embed_tokens.weight"):
        assert n in names and ckpt.dtype(n) == torch.bfloat16, n
    assert ckpt.dtype("model.layers.1.mlp.gate.e_score_correction_bias") == torch.float32
    # the MTP copies of the embedding and head equal the main ones (Megatron shares one tensor for both)
    assert torch.equal(ckpt.get("model.layers.4.embed_tokens.weight"), ckpt.get("model.embed_tokens.weight"))
    assert torch.equal(ckpt.get("model.layers.4.shared_head.head.weight"), ckpt.get("lm_head.weight"))


# ------------------------------------------------------------------------------------------ uneven PP, FP8 in, HF out

@pytest.fixture(scope="module")
def converted(fp8_dir, tmp_path_factory) -> tuple[Path, Path]:
    """4 layers on PP2 as 1 | 3 (the release: 61 on PP16 as 3 | 4 x 14 | 2), the MTP layer on the last stage,
    through the CLI; then exported back to HF."""
    from mtrain.converters.mcore_to_hf import mcore_to_hf
    root = tmp_path_factory.mktemp("split")
    mcore = root / "mcore"
    assert main(["hf-to-mcore", "--hf", str(fp8_dir), "--out", str(mcore), "--pp", "2", "--first-stage-layers", "1",
                 "--last-stage-layers", "3", "--dtype", "float32"]) == 0
    return mcore, mcore_to_hf(mcore, root / "back")


def test_fp8_release_at_uneven_pp_round_trips(fp8_dir, converted):
    mcore, back = converted
    meta = json.loads((mcore / "mtrain_meta.json").read_text())
    assert meta["layout"]["first_stage_layers"] == 1 and meta["layout"]["last_stage_layers"] == 3
    assert meta["mtp_layers"] == 1
    want, got = dequantized(fp8_dir), {n: t for n, t in HFCheckpoint(back).items()}
    assert sorted(got) == sorted(want)  # MTP tensors kept, no *_scale_inv
    for n, t in want.items():
        assert torch.equal(got[n], t), f"{n} is not the float32 dequantisation"
    assert "quantization_config" not in json.loads((back / "config.json").read_text())  # plain weights now


@pytest.mark.slow
def test_uneven_pp_checkpoint_matches_transformers(converted, capsys):
    mcore, back = converted  # transformers loads the export; Megatron runs the checkpoint at PP2 1 | 3
    assert main(["verify", "--hf", str(back), "--mcore", str(mcore), "--pp", "2", "--first-stage-layers", "1",
                 "--last-stage-layers", "3"]) == 0
    assert "OK: logits" in capsys.readouterr().out


def test_verify_in_float32_checks_a_bf16_conversion_exactly(fp8_dir, tmp_path, capsys):
    """A bf16 checkpoint verified with Megatron's forward in float32 (its values upcast exactly) meets the float32
    tolerance: what is left is float32 arithmetic, not bf16's (which flips expert choices on a random MoE)."""
    from mtrain.converters.verify import verify
    mcore = tmp_path / "bf16"
    assert _convert(fp8_dir, mcore, "--dtype", "bfloat16") == 0
    back = tmp_path / "back"
    assert main(["mcore-to-hf", "--mcore", str(mcore), "--out", str(back)]) == 0
    capsys.readouterr()
    assert main(["verify", "--hf", str(back), "--mcore", str(mcore), "--dtype", "fp32"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("OK: logits") and "tolerance 1.0e-04, forward float32" in out, out
    exact = float(re.search(r"relative ([0-9.e+-]+)", out).group(1))
    assert exact < 1e-5, out
    noisy = verify(back, mcore)  # the checkpoint's own dtype: a bf16 forward
    assert noisy.dtype == "bfloat16" and noisy.tol == 2e-2 and noisy.max_rel > 100 * exact, (noisy, exact)


# ------------------------------------------------------------------------------------------ bad input

def _convert(src: Path, out: Path, *extra: str) -> int:
    return main(["hf-to-mcore", "--hf", str(src), "--out", str(out), *extra])


def _one_error_line(capsys, *words: str) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("mtrain-convert: error:"), err
    for w in words:
        assert w in err, (w, err)
    return err


@pytest.mark.parametrize("split, words", [
    (["--pp", "2", "--first-stage-layers", "1", "--last-stage-layers", "2"], ["first_stage_layers=1", "4 layers"]),
    (["--pp", "2", "--first-stage-layers", "5"], ["first_stage_layers=5", "do not fit"]),
    (["--pp", "3", "--first-stage-layers", "1"], ["middle layers"]),
    (["--first-stage-layers", "2"], ["need --pp > 1"]),
])
def test_a_split_that_does_not_add_up_is_refused(fp8_dir, tmp_path, capsys, split, words):
    out = tmp_path / "out"
    assert _convert(fp8_dir, out, *split) == 2
    _one_error_line(capsys, *words)
    assert leftovers(tmp_path, "out") == []
    assert main(["verify", "--hf", str(fp8_dir), "--mcore", str(fp8_dir), *split]) == 2


def test_a_split_below_one_is_an_argument_error(fp8_dir, tmp_path):
    with pytest.raises(SystemExit) as e:
        _convert(fp8_dir, tmp_path / "out", "--pp", "2", "--first-stage-layers", "0")
    assert e.value.code == 2


def test_truncated_fp8_shard(fp8_dir, tmp_path, capsys):
    src = Path(shutil.copytree(fp8_dir, tmp_path / "src"))
    f = src / "model.safetensors"
    with open(f, "r+b") as fh:
        fh.truncate(f.stat().st_size - 1000)
    assert _convert(src, tmp_path / "out", "--pp", "2", "--first-stage-layers", "1", "--last-stage-layers", "3") == 2
    _one_error_line(capsys, "truncated", "model.safetensors")
    assert leftovers(tmp_path, "out") == []


def _rewrite(src: Path, change) -> None:
    state = load_file(src / "model.safetensors")
    change(state)
    save_file(state, str(src / "model.safetensors"), metadata={"format": "pt"})


def test_scale_of_the_wrong_shape(fp8_dir, tmp_path, capsys):
    src = Path(shutil.copytree(fp8_dir, tmp_path / "src"))
    name = "model.layers.2.self_attn.kv_b_proj.weight_scale_inv"

    def grow(state):
        state[name] = torch.ones(state[name].shape[0] + 1, state[name].shape[1])
    _rewrite(src, grow)
    assert _convert(src, tmp_path / "out") == 2
    _one_error_line(capsys, name, "expected")
    assert leftovers(tmp_path, "out") == []


def test_fp8_weight_without_scale_and_scale_without_weight(fp8_dir, tmp_path, capsys):
    src = Path(shutil.copytree(fp8_dir, tmp_path / "src"))
    _rewrite(src, lambda s: s.pop("model.layers.0.mlp.down_proj.weight_scale_inv"))
    assert _convert(src, tmp_path / "out") == 2
    _one_error_line(capsys, "model.layers.0.mlp.down_proj.weight", "without")
    src2 = Path(shutil.copytree(fp8_dir, tmp_path / "src2"))
    _rewrite(src2, lambda s: s.pop("model.layers.0.mlp.up_proj.weight"))
    assert _convert(src2, tmp_path / "out") == 2
    _one_error_line(capsys, "model.layers.0.mlp.up_proj.weight_scale_inv", "without a weight")
    assert leftovers(tmp_path, "out") == []


def test_make_fp8_bad_input(fp8_dir, tmp_path, capsys):
    assert main(["make-fp8", "--hf", str(fp8_dir), "--out", str(tmp_path / "again")]) == 2
    _one_error_line(capsys, "already an FP8")
    (tmp_path / "bad.json").write_text("{not json")
    assert main(["make-fp8", "--config", str(tmp_path / "bad.json"), "--out", str(tmp_path / "x")]) == 2
    _one_error_line(capsys, "bad.json")
    assert main(["make-fp8", "--config", str(fp8_dir / "config.json"), "--out", str(fp8_dir)]) == 2
    _one_error_line(capsys, "already holds a checkpoint")
    assert leftovers(tmp_path, "again") == [] and leftovers(tmp_path, "x") == []


def test_killed_conversion_leaves_nothing_that_looks_complete(fp8_dir, tmp_path):
    """SIGKILL to the whole conversion (parent and ranks, no handler runs) once the ranks are converting."""
    import os
    import signal
    import subprocess
    import sys
    import time

    import psutil
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "mtrain.converters", "hf-to-mcore", "--hf", str(fp8_dir), "--out", str(out),
           "--pp", "2", "--first-stage-layers", "1", "--last-stage-layers", "3"]
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCHDYNAMO_DISABLE="1")
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while len(psutil.Process(p.pid).children(recursive=True)) < 2:  # the spawned ranks are up
            assert p.poll() is None and time.monotonic() < deadline, "conversion ended before it could be killed"
            time.sleep(0.1)
        time.sleep(2.0)
        assert p.poll() is None
    finally:
        procs = psutil.Process(p.pid).children(recursive=True) if p.poll() is None else []
        os.killpg(p.pid, signal.SIGKILL)
        for q in procs:
            try:
                q.kill()
            except psutil.NoSuchProcess:
                pass
        p.wait()
        psutil.wait_procs(procs, timeout=30)
    assert not out.exists()
    left = leftovers(tmp_path, "out")
    assert all(".tmp-" in n for n in left), left  # staging only: never taken for a checkpoint
    from mtrain.converters.output_dir import checkpoint_marker
    assert checkpoint_marker(out) is None
