"""FP8 rollout engines (`engine.weight_dtype=fp8`): what each engine kind needs to hold block-FP8 weights.

SGLang (GPU): block FP8 exists in SGLang 0.5.17 only for a *serialized* FP8 checkpoint: a config.json carrying
`quantization_config` with `weight_block_size` makes it build float8_e4m3fn weights + float32 weight_scale_inv
for every linear layer (layers/quantization/fp8.py:262-266, 305-340). A bf16 config with quantization="fp8"
gives per-channel FP8 instead, re-created without weight loaders, which no sync can fill (SGLANG-NEXT.md
section 2). Our engines start from `load_format="dummy"` and get every weight from the first sync, so the model
dir only needs that config.json: `fp8_model_dir` writes one next to the trainer's. GEMMs run on SGLang's triton
block-FP8 kernels (`fp8_gemm_runner_backend="triton"`): no DeepGEMM JIT, float32 scales used as stored.

CPU reference engine: `Fp8ReferenceEngine` emulates the FP8 engine: after every sync each linear weight is
replaced by dequant(quant(w)) with the kernels' block math, on the weight's canonical tensor (HF parts stacked
as SGLang fuses them: q;k;v, gate;up, q_a;kv_a), i.e. exactly SGLang's blocks at engine TP 1 (and at any TP the
divisibility rules admit, whose blocks coincide). Its logprobs then differ from the trainer's by the weights'
quantization alone: SGLang also quantizes each linear layer's input per token and 128 channels, which is not
emulated (on the GPU model of docs/archive/results-2026-11.md section 40, whose step-1 weights are on the FP8 grid, that part alone
is a 0.06 mean logprob gap). It refuses shapes SGLang's FP8 layers refuse. With model.lora the adapters stay
unquantized in the engine's dtype on top of the FP8 base (PEFT's layers; SGLang's LoRA layers wrap its FP8 linears
the same way), written by adapter-only syncs that leave the base as it is.
"""
from __future__ import annotations

import json
import os
import tempfile
from typing import Any

import torch

from mtrain.kernels import dequantize_blocks, quantize_blocks
from mtrain.layouts import LayoutError, model_layout
from mtrain.layouts.fp8 import BLOCK, check_block_split
from mtrain.rollout.protocol import EngineError
from mtrain.rollout.reference_engine import ReferenceEngine

QUANTIZATION_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                       "weight_block_size": list(BLOCK)}
SERVER_ARGS = {"quantization": "fp8", "fp8_gemm_runner_backend": "triton"}
_CONFIG_ONLY = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                "generation_config.json", "vocab.json", "merges.txt")


def fp8_config(hf_config: dict) -> dict:
    """The trainer's config.json as an FP8 checkpoint's (DeepSeek-V3's release format)."""
    existing = hf_config.get("quantization_config")
    if existing and existing != QUANTIZATION_CONFIG:
        raise EngineError(f"engine.weight_dtype=fp8: the model already has quantization_config {existing}; "
                          "mtrain trains bf16 weights and quantizes them itself")
    return dict(hf_config, quantization_config=dict(QUANTIZATION_CONFIG))


def fp8_model_dir(hf_dir: str, hf_config: dict, out_dir: str | None = None) -> str:
    """A model dir for a dummy-loaded FP8 SGLang engine: the FP8 config.json plus links to the tokenizer files."""
    out = out_dir or tempfile.mkdtemp(prefix="mtrain-fp8-model-")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(fp8_config(hf_config), f, indent=1)
    for name in _CONFIG_ONLY:
        src, dst = os.path.join(hf_dir, name), os.path.join(out, name)
        if os.path.exists(src) and not os.path.exists(dst):
            os.symlink(os.path.abspath(src), dst)
    return out


def fp8_groups(layout, names: set[str]) -> list[list[str]]:
    """HF names of every block-FP8 weight, grouped as SGLang fuses them (one group = one canonical tensor), after
    checking SGLang's engine-TP-1 divisibility rules for each. Weights the engine does not hold are skipped."""
    groups = []
    for w in layout.weights:
        if not (w.block_fp8 and w.sglang):
            continue
        for part in w.sglang:
            try:
                check_block_split(w, part, w.shape2d, 1)
            except LayoutError as e:
                raise EngineError(f"engine.weight_dtype=fp8: {e}") from None
        group = [p.name for p in w.hf if p.write]
        if group and all(n in names for n in group):
            groups.append(group)
    return groups


class Fp8ReferenceEngine(ReferenceEngine):
    """The CPU reference engine holding FP8-emulated linear weights (see the module docstring)."""

    def __init__(self, config: dict[str, Any], **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self._fp8_groups = fp8_groups(model_layout(self._config.to_dict()), set(self._views))

    @torch.no_grad()
    def finish_weight_update(self, version: int) -> None:
        with self._model_lock:
            # only the weights this sync wrote are quantized: a LoRA adapter-only sync, or one that writes only a
            # trained vision tower, leaves the base on its grid (re-quantizing FP8 values need not give back the same
            # bits: the block scale is recomputed).
            for group in [g for g in self._fp8_groups if any(n in self._written for n in g)] if self._sync_open else ():
                views = [self._views[n] for n in group]
                full = torch.cat(views) if len(views) > 1 else views[0]
                q, s = quantize_blocks(full, BLOCK)
                deq = dequantize_blocks(q, s, BLOCK)
                start = 0
                for v in views:
                    v.copy_(deq[start:start + v.shape[0]])
                    start += v.shape[0]
        super().finish_weight_update(version)
