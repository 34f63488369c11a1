"""export-lora of a MoE model's MLP adapters: DeepSeek-V3's shared experts, a dense layer's MLP (DeepSeek's
first_k_dense_replace layer, a Qwen3-MoE mlp_only_layers layer), beside the routed experts. The PEFT directory loads
with peft.PeftModel.from_pretrained on the transformers model and gives the logits of mtrain's own model carrying
the same adapters (float32, <= 5e-6); --merge gives a HF checkpoint with those logits.

PEFT under transformers 5 rewrites gate_proj / up_proj / down_proj targets on a MoE model into the fused experts'
parameters: exported as plain target_modules, the dense and shared linears lost their adapters on load (PEFT gave
the base model's logits there) while the routed experts took adapters no one had trained.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mtrain.dist import run_on_ranks

REPO = Path(__file__).resolve().parents[2]
RANK, ALPHA, TOL = 4, 8.0, 5e-6
CASES = {  # id: (architecture, config.json changes, targets)
    "deepseek_v3-shared": ("deepseek_v3", {}, ("experts", "shared.gate_up", "shared.down")),
    "deepseek_v3-dense_layer": ("deepseek_v3", {}, ("gate_up", "down")),
    "qwen3_moe-dense_layer": ("qwen3_moe", {"mlp_only_layers": [0]}, ("gate_up", "down", "experts")),
}


def _tokens() -> torch.Tensor:
    return torch.randint(0, 90, (2, 9), generator=torch.Generator().manual_seed(1))


def _save(rank, world, hf, root, targets):
    """mtrain's model with random adapters on every target: saved as a LoRA dist checkpoint; returns its logits."""
    from megatron.core import dist_checkpointing
    from transformers import AutoModelForCausalLM

    from mtrain.dist import init_distributed
    from mtrain.layouts import model_layout
    from mtrain.layouts.lora import LoraSpec, lora_layout, with_adapters, write_meta
    from mtrain.models import build_model, forward_logits, model_sharded_state_dict
    from mtrain.models.lora import attach_lora
    from mtrain.reshard.megatron_side import load_hf_into_megatron
    from mtrain.rollout.reference_engine import hf_disk_views

    init_distributed()
    cfg = dict(json.loads((Path(hf) / "config.json").read_text()), num_nextn_predict_layers=0)
    spec = LoraSpec(RANK, ALPHA, tuple(targets))
    base = model_layout(cfg, mtp=False)
    gen = torch.Generator().manual_seed(9)
    adapters = {w.hf[0].name: 0.1 * torch.randn(w.shape, generator=gen) for w in lora_layout(base, spec).weights}
    disk = {k: v.detach().clone() for k, v in
            hf_disk_views(AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)).items()}
    chunks, _ = build_model(cfg, params_dtype=torch.float32)
    attach_lora(chunks, cfg, spec)
    load_hf_into_megatron(with_adapters(base, spec), chunks, {**disk, **adapters}.__getitem__, rank)
    logits = forward_logits(chunks, _tokens())
    dist_checkpointing.save(model_sharded_state_dict(chunks), f"{root}/mcore")
    write_meta(f"{root}/mcore", spec)
    return logits[..., : cfg["vocab_size"]].clone()


# the dense-layer path on DeepSeek-V3 is the same code as Qwen3-MoE's (kept in the default run) on another model
SLOW_CASES = ("deepseek_v3-dense_layer",)


@pytest.fixture(scope="module", params=[pytest.param(c, marks=pytest.mark.slow) if c in SLOW_CASES else c
                                        for c in CASES])
def saved(request, tmp_path_factory):
    from mtrain.tiny_hf import write_tiny_hf
    arch, changes, targets = CASES[request.param]
    root = tmp_path_factory.mktemp(request.param)
    os.makedirs(root / "mcore")
    hf = write_tiny_hf(arch, root / "hf", seed=0, overrides=changes)
    (logits,) = run_on_ranks(_save, 1, str(hf), str(root), list(targets), timeout=300)
    return root, hf, logits


def _export(saved, out, *extra) -> Path:
    root, hf, _ = saved
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", TORCHDYNAMO_DISABLE="1")
    p = subprocess.run([sys.executable, "-m", "mtrain.converters", "export-lora", "--mcore", str(root / "mcore"),
                        "--hf", str(hf), "--out", str(out), *extra], env=env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return out


def _hf(path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")


def test_exported_adapter_gives_mtrains_logits_in_peft(saved, tmp_path):
    from peft import PeftModel
    want = saved[2]
    model = PeftModel.from_pretrained(_hf(saved[1]), _export(saved, tmp_path / "a")).eval()
    with torch.no_grad():
        got = model(_tokens()).logits
        with model.disable_adapter():
            base = model(_tokens()).logits
    assert float((got - want).abs().max()) <= TOL
    assert float((base - want).abs().max()) > 1e-2  # the adapters are not a no-op


@pytest.mark.slow  # PEFT's merge and a HF save on top of the adapter export
def test_merged_export_gives_mtrains_logits(saved, tmp_path):
    merged = _hf(_export(saved, tmp_path / "m", "--merge")).eval()
    assert not any("lora" in n for n, _ in merged.named_parameters())
    with torch.no_grad():
        assert float((merged(_tokens()).logits - saved[2]).abs().max()) <= TOL
