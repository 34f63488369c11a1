"""export-lora: a LoRA model saved at TP2 (2 gloo ranks) -> PEFT adapter dir that peft.PeftModel.from_pretrained
loads on the HF base with the same logits as the PEFT model the adapters came from; --merge -> a HF checkpoint
with those logits; a checkpoint without adapters is refused in one line."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mtrain.dist import run_on_ranks

REPO = Path(__file__).resolve().parents[2]
TARGETS, RANK, ALPHA = ("qkv", "o_proj", "gate_up", "down"), 4, 8.0
ARCH = "qwen3"


def _save_tp2(rank, world, root):
    sys.path.insert(0, str(REPO / "tests" / "models"))
    from hf_reference import make_hf_model
    from lora_reference import make_peft_model, plain_state
    from megatron.core import dist_checkpointing

    from mtrain.dist import init_distributed
    from mtrain.layouts import model_layout
    from mtrain.layouts.lora import LoraSpec, with_adapters, write_meta
    from mtrain.models import build_model, model_sharded_state_dict
    from mtrain.models.lora import attach_lora
    from mtrain.reshard.megatron_side import load_hf_into_megatron
    from mtrain.tiny_configs import numerics_config

    init_distributed(tp=2)
    cfg = numerics_config(ARCH)
    spec = LoraSpec(RANK, ALPHA, TARGETS)
    if rank == 0:
        make_hf_model(cfg).save_pretrained(f"{root}/hf")
    chunks, _ = build_model(cfg)
    attach_lora(chunks, cfg, spec)
    load_hf_into_megatron(with_adapters(model_layout(cfg, mtp=False), spec), chunks,
                          plain_state(make_peft_model(cfg, TARGETS, RANK, ALPHA)).__getitem__, rank)
    dist_checkpointing.save(model_sharded_state_dict(chunks), f"{root}/mcore")
    if rank == 0:
        write_meta(f"{root}/mcore", spec)
    return True


def _cli(*args) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", TORCHDYNAMO_DISABLE="1")
    return subprocess.run([sys.executable, "-m", "mtrain.converters", *args], env=env, capture_output=True,
                          text=True, timeout=300)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_tp2")
    os.makedirs(root / "mcore")
    run_on_ranks(_save_tp2, 2, str(root), timeout=300)
    return root


def _reference_logits(tokens):
    sys.path.insert(0, str(REPO / "tests" / "models"))
    from lora_reference import make_peft_model
    from mtrain.tiny_configs import numerics_config
    with torch.no_grad():
        return make_peft_model(numerics_config(ARCH), TARGETS, RANK, ALPHA)(tokens).logits


def test_export_adapter_loads_in_peft(saved, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    p = _cli("export-lora", "--mcore", str(saved / "mcore"), "--hf", str(saved / "hf"), "--out", str(tmp_path / "a"))
    assert p.returncode == 0, p.stderr[-3000:]
    assert sorted(os.listdir(tmp_path / "a")) == ["adapter_config.json", "adapter_model.safetensors"]
    tokens = torch.randint(0, 250, (2, 9), generator=torch.Generator().manual_seed(1))
    base = AutoModelForCausalLM.from_pretrained(saved / "hf", dtype=torch.float32, attn_implementation="eager")
    model = PeftModel.from_pretrained(base, tmp_path / "a").eval()
    with torch.no_grad():
        got = model(tokens).logits
    want = _reference_logits(tokens)
    assert float((got - want).abs().max()) <= 1e-5
    # the adapter is not a no-op: the base alone differs
    with torch.no_grad(), model.disable_adapter():
        assert float((model(tokens).logits - want).abs().max()) > 1e-3


@pytest.mark.slow  # PEFT's merge and a HF save on top of the adapter export
def test_export_merged_checkpoint(saved, tmp_path):
    from transformers import AutoModelForCausalLM

    p = _cli("export-lora", "--mcore", str(saved / "mcore"), "--hf", str(saved / "hf"), "--out", str(tmp_path / "m"),
             "--merge")
    assert p.returncode == 0, p.stderr[-3000:]
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float32, attn_implementation="eager")
    assert not any("lora" in n for n, _ in merged.named_parameters())
    tokens = torch.randint(0, 250, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert float((merged.eval()(tokens).logits - _reference_logits(tokens)).abs().max()) <= 1e-5


def test_export_refuses_checkpoint_without_adapters(saved, tmp_path):
    import shutil
    plain = tmp_path / "plain"
    shutil.copytree(saved / "mcore", plain)
    (plain / "lora.json").unlink()
    p = _cli("export-lora", "--mcore", str(plain), "--hf", str(saved / "hf"), "--out", str(tmp_path / "x"))
    assert p.returncode == 2 and "no lora.json" in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr


def test_export_refuses_a_vision_language_model_in_one_line(saved, tmp_path):
    """LoRA on Qwen2.5-VL (with a trained vision tower) runs; its PEFT export is not built: one line, no output."""
    from mtrain.tiny_vlm import write_tiny_vlm
    hf = write_tiny_vlm(tmp_path / "vlm", seed=0)
    p = _cli("export-lora", "--mcore", str(saved / "mcore"), "--hf", str(hf), "--out", str(tmp_path / "x"))
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert "export-lora of a vision-language model (qwen2_5_vl) is not built yet" in p.stderr, p.stderr
    assert not (tmp_path / "x").exists()


def _cli_seed(seed: str, *args) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", TORCHDYNAMO_DISABLE="1", PYTHONHASHSEED=seed)
    return subprocess.run([sys.executable, "-m", "mtrain.converters", *args], env=env, capture_output=True,
                          text=True, timeout=300)


def test_export_is_byte_reproducible_and_takes_a_trainer_checkpoint_as_named(saved, tmp_path):
    """Two exports of one checkpoint are the same bytes (PEFT wrote target_modules in set order, which follows the
    process's hash seed); the second names the checkpoint as a run writes it (RUN_DIR/checkpoints/step_N, weights
    in its mcore/), which used to be refused as 'incomplete'. No library warnings on the way."""
    import shutil
    step = tmp_path / "run" / "checkpoints" / "step_2"
    shutil.copytree(saved / "mcore", step / "mcore")
    (step / "COMPLETE").write_text("2")
    a = _cli_seed("1", "export-lora", "--mcore", str(saved / "mcore"), "--hf", str(saved / "hf"), "--out",
                  str(tmp_path / "a"))
    b = _cli_seed("2", "export-lora", "--mcore", str(step), "--hf", str(saved / "hf"), "--out", str(tmp_path / "b"))
    assert a.returncode == 0 and b.returncode == 0, a.stderr[-2000:] + b.stderr[-2000:]
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    assert "warnings.warn" not in a.stderr + b.stderr, a.stderr


def test_mcore_to_hf_refuses_a_lora_checkpoint(saved, tmp_path):
    """It used to write the base model alone, silently dropping the trained adapters."""
    p = _cli("mcore-to-hf", "--mcore", str(saved / "mcore"), "--hf-config", str(saved / "hf"), "--out",
             str(tmp_path / "x"))
    assert p.returncode == 2, p.stderr[-3000:]
    (line,) = p.stderr.strip().splitlines()
    assert "is a LoRA checkpoint" in line and "mtrain-convert export-lora" in line and "--merge" in line, line
    assert not (tmp_path / "x").exists()
