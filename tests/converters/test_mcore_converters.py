"""The Megatron converters on tiny random models (CPU, gloo ranks):

- HF -> Megatron dist checkpoint at TP2 / PP2 / EP2 / TP2xEP2 -> HF is bit-identical (every tensor, its dtype);
- a dist checkpoint saved at TP2 or TP2xEP2 loads at TP1 and gives transformers' logits (verify's code path);
- mcore-to-sglang equals an independent slicing of the HF tensors the way SGLang's loaders do it;
- the real SmolLM2-135M (slow): hf-to-mcore at TP1, then verify against transformers.

DeepSeek-V3 runs with its MTP layer: transformers' save_pretrained drops MTP weights, so `add_mtp_layer` adds
them (random, with the embedding/head copies equal to the main ones, as in the real release).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mtrain.converters.__main__ import main
from mtrain.converters.hf_to_mcore import hf_to_mcore
from mtrain.converters.mcore_io import hf_expected, normalized_config, tied_copies
from mtrain.converters.mcore_to_hf import mcore_to_hf
from mtrain.converters.mcore_to_sglang import mcore_to_sglang, rank_file
from mtrain.converters.safetensors_io import HFCheckpoint
from mtrain.converters.verify import verify
from mtrain.layouts import model_layout
from mtrain.tiny_hf import write_tiny_hf

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "reshard"))
from sglang_reference import sglang_rank_params  # noqa: E402


def hf_state(hf_dir: Path) -> dict[str, torch.Tensor]:
    ckpt = HFCheckpoint(hf_dir)
    return {n: ckpt.get(n).clone() for n in ckpt.names()}


def randomize(hf_dir: Path, seed: int) -> None:
    """transformers initialises norms to 1 and biases to 0: a permutation bug would not show. Fill every tensor
    with random values (same names, shapes, dtypes)."""
    g = torch.Generator().manual_seed(seed)
    state = load_file(hf_dir / "model.safetensors")
    state = {n: (torch.randn(t.shape, generator=g) * 0.1 + (1.0 if t.dim() == 1 else 0.0)).to(t.dtype)
             for n, t in state.items()}
    save_file(state, str(hf_dir / "model.safetensors"), metadata={"format": "pt"})


def add_mtp_layer(hf_dir: Path, seed: int = 5) -> None:
    """Give a tiny DeepSeek-V3 dir the MTP tensors the table names (as the real release carries them)."""
    cfg = json.loads((hf_dir / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 1
    full = model_layout(cfg, mtp=True)
    main_names = set(hf_expected(model_layout(dict(cfg, num_nextn_predict_layers=0), mtp=False)))
    state = load_file(hf_dir / "model.safetensors")
    copies = dict(tied_copies(full))
    g = torch.Generator().manual_seed(seed)
    for name, shape in hf_expected(full).items():
        if name in main_names:
            continue
        state[name] = state[copies[name]].clone() if name in copies else torch.randn(shape, generator=g) * 0.1
    save_file(state, str(hf_dir / "model.safetensors"), metadata={"format": "pt"})
    (hf_dir / "config.json").write_text(json.dumps(cfg, indent=2))


def make_hf(root: Path, arch: str, seed: int = 0) -> Path:
    d = write_tiny_hf(arch, root / f"{arch}-{seed}", seed=seed)
    randomize(d, seed + 100)
    if arch == "deepseek_v3":
        add_mtp_layer(d)
    return d


# (arch, layout) -> a converted dist checkpoint, made once per module and shared by the tests below.
CASES = {
    "llama-tp2": ("llama", dict(tp=2)),
    "mistral-tp2": ("mistral", dict(tp=2)),
    "qwen2-pp2": ("qwen2", dict(pp=2)),
    "qwen3_moe-ep2": ("qwen3_moe", dict(ep=2)),
    "deepseek_v3-tp2xep2": ("deepseek_v3", dict(tp=2, ep=2, etp=1)),
}


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("mcore_conv")
    cache: dict = {}

    def get(case: str) -> tuple[Path, Path]:
        if case not in cache:
            arch, par = CASES[case]
            hf = make_hf(root, arch)
            cache[case] = (hf, hf_to_mcore(hf, root / f"{case}-mcore", **par))
        return cache[case]
    get.root = root
    return get


@pytest.mark.parametrize("case", sorted(CASES))
def test_round_trip_is_bit_identical(store, case):
    hf, mcore = store(case)
    meta = json.loads((mcore / "mtrain_meta.json").read_text())
    assert meta["layout"]["tp"] == CASES[case][1].get("tp", 1)
    assert meta["mtp_layers"] == (1 if case.startswith("deepseek") else 0)
    back = mcore_to_hf(mcore, store.root / f"{case}-back")
    want, got = hf_state(hf), hf_state(back)
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype, name
        assert torch.equal(got[name], t), f"{case}: {name} differs after the round trip"
    assert json.loads((back / "config.json").read_text()) == json.loads((hf / "config.json").read_text())


@pytest.mark.parametrize("case", ["deepseek_v3-tp2xep2", "qwen2-pp2"])
def test_saved_layout_loads_at_tp1_with_transformers_logits(store, case):
    hf, mcore = store(case)
    r = verify(hf, mcore)  # TP1/PP1/EP1: Megatron reshards the TP2xEP2 / PP2 checkpoint on load
    assert r.max_rel < 1e-4, f"{case}: relative logit error {r.max_rel:.2e}"
    assert r.ok


def test_verify_cli_passes_and_fails(store, capsys):
    hf, mcore = store("llama-tp2")
    assert main(["verify", "--hf", str(hf), "--mcore", str(mcore), "--tp", "2"]) == 0
    assert "OK: logits [2, 16, 101]" in capsys.readouterr().out
    other = make_hf(store.root, "llama", seed=1)  # same shapes, other weights: verify must notice
    assert main(["verify", "--hf", str(other), "--mcore", str(mcore)]) == 1
    assert "FAIL" in capsys.readouterr().out


@pytest.mark.parametrize("case, tp, ep", [("deepseek_v3-tp2xep2", 2, 2), ("llama-tp2", 4, 1)])
def test_sglang_shards_equal_sglang_slicing(store, case, tp, ep):
    hf, mcore = store(case)
    out = mcore_to_sglang(mcore, store.root / f"{case}-sglang-tp{tp}ep{ep}", engine_tp=tp, engine_ep=ep)
    cfg = normalized_config(json.loads((hf / "config.json").read_text()))
    state = hf_state(hf)
    for r in range(tp):
        want = sglang_rank_params(state, cfg, r, tp, ep)
        got = load_file(out / rank_file(r))
        assert sorted(got) == sorted(want), f"rank {r}: names differ: {sorted(set(got) ^ set(want))[:5]}"
        for name, t in want.items():
            assert got[name].shape == t.shape, f"rank {r} {name}: {tuple(got[name].shape)} vs {tuple(t.shape)}"
            assert torch.equal(got[name], t.to(got[name].dtype)), f"rank {r} {name} differs"


def quantize_fp8(hf_dir: Path, block: int = 32) -> dict[str, torch.Tensor]:
    """Store every 2-D tensor as float8_e4m3fn + block scales (the DeepSeek-V3 release format, small blocks);
    returns what a correct converter must produce: the float32 dequantisation, other tensors unchanged."""
    from mtrain.converters.fp8 import dequant_fp8_blockwise
    state = load_file(hf_dir / "model.safetensors")
    cfg = json.loads((hf_dir / "config.json").read_text())
    # the release keeps the embedding and head (and their MTP copies, which must stay equal) unquantised
    keep = {n for pair in tied_copies(model_layout(cfg, mtp=True)) for n in pair}
    stored, want = {}, {}
    for name, t in state.items():
        if t.dim() != 2 or name in keep:
            stored[name] = want[name] = t
            continue
        rows, cols = t.shape
        scale = torch.rand(-(-rows // block), -(-cols // block)) * 0.01 + 0.001
        s_full = scale.repeat_interleave(block, 0)[:rows].repeat_interleave(block, 1)[:, :cols]
        stored[name] = (t / s_full).to(torch.float8_e4m3fn)
        stored[name + "_scale_inv"] = scale
        want[name] = dequant_fp8_blockwise(stored[name], scale, block, out_dtype=torch.float32)
    save_file(stored, str(hf_dir / "model.safetensors"), metadata={"format": "pt"})
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [block, block]}
    (hf_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    return want


def test_fp8_release_is_dequantised(store):
    hf = make_hf(store.root, "deepseek_v3", seed=7)
    want = quantize_fp8(hf)
    mcore = hf_to_mcore(hf, store.root / "fp8-mcore", dtype=torch.float32)
    got = hf_state(mcore_to_hf(mcore, store.root / "fp8-back"))
    assert sorted(got) == sorted(want)  # no *_scale_inv names in the output
    for name, t in want.items():
        assert torch.equal(got[name], t), f"{name} is not the float32 dequantisation"


@pytest.mark.slow
def test_smollm2_hf_to_mcore_then_verify(tmp_path):
    from mtrain.converters.smollm2 import smollm2_hf_dir
    hf = smollm2_hf_dir()
    mcore = hf_to_mcore(hf, tmp_path / "smollm2-mcore")
    assert (mcore / "tokenizer.json").is_file() and (mcore / "config.json").is_file()
    r = verify(hf, mcore)
    assert r.ok and r.max_rel < 1e-4, f"SmolLM2: relative logit error {r.max_rel:.2e}"
