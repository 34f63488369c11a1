"""FP8 rollout engines (`engine.weight_dtype=fp8`): what each engine kind needs to hold FP8 weights, in the two
formats of `engine.fp8_scaling` (layouts/fp8.py): block (below) and channel (after it).

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

Per-channel (fp8_scaling "channel"): that bf16 path is the format. The model dir holds the trainer's config.json
unchanged, the engine starts with quantization="fp8" and dummy weights, and SGLang quantizes them per output row
after load (Fp8LinearMethod.process_weights_after_loading, non-block branch): each linear's `weight` becomes a
[K, N] transposed view of float8_e4m3fn [N, K] storage and `weight_scale` a float32 [1, N], plain Parameters
without weight loaders, which the pull sync writes in place (reshard/targets.fp8_spec takes the storage view). The
reference engine emulates it row by row with kernels.fp8_channel.quantize_channels (exactly SGLang at engine TP 1:
at TP > 1 a row-parallel layer's rows are quantized per rank, over its K / tp columns).
"""
from __future__ import annotations

import json
import os
import tempfile
from typing import Any

import torch

from mtrain.kernels import dequantize_blocks, quantize_blocks
from mtrain.kernels.fp8_channel import dequantize_channels, quantize_channels
from mtrain.layouts import LayoutError, model_layout
from mtrain.layouts.fp8 import BLOCK, check_block_split, check_channel_split
from mtrain.rollout.protocol import EngineError
from mtrain.rollout.reference_engine import ReferenceEngine

QUANTIZATION_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                       "weight_block_size": list(BLOCK)}
SERVER_ARGS = {"quantization": "fp8", "fp8_gemm_runner_backend": "triton"}
# per-channel: SGLang's default runner for a non-block FP8 linear (cutlass on Hopper), nothing to choose
CHANNEL_SERVER_ARGS = {"quantization": "fp8"}


def server_args(scaling: str) -> dict:
    """The SGLang arguments of an FP8 engine in `scaling` (layouts.fp8.SCALINGS)."""
    return dict(CHANNEL_SERVER_ARGS if scaling == "channel" else SERVER_ARGS)


_CONFIG_ONLY = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                "generation_config.json", "vocab.json", "merges.txt")


def fp8_config(hf_config: dict, scaling: str = "block") -> dict:
    """The trainer's config.json as an FP8 checkpoint's (DeepSeek-V3's release format); per-channel: as it is (a
    bf16 model that SGLang quantizes itself)."""
    existing = hf_config.get("quantization_config")
    if existing and (scaling == "channel" or existing != QUANTIZATION_CONFIG):
        raise EngineError(f"engine.weight_dtype=fp8: the model already has quantization_config {existing}; "
                          "mtrain trains bf16 weights and quantizes them itself")
    if scaling == "channel":
        return dict(hf_config)
    return dict(hf_config, quantization_config=dict(QUANTIZATION_CONFIG))


def fp8_model_dir(hf_dir: str, hf_config: dict, out_dir: str | None = None, scaling: str = "block") -> str:
    """A model dir for a dummy-loaded FP8 SGLang engine: the FP8 config.json plus links to the tokenizer files."""
    out = out_dir or tempfile.mkdtemp(prefix="mtrain-fp8-model-")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(fp8_config(hf_config, scaling), f, indent=1)
    for name in _CONFIG_ONLY:
        src, dst = os.path.join(hf_dir, name), os.path.join(out, name)
        if os.path.exists(src) and not os.path.exists(dst):
            os.symlink(os.path.abspath(src), dst)
    return out


def fp8_groups(layout, names: set[str], scaling: str = "block") -> list[list[str]]:
    """HF names of every FP8 weight, grouped as SGLang fuses them (one group = one canonical tensor), after
    checking what SGLang's engine-TP-1 layers refuse for each. Weights the engine does not hold are skipped."""
    groups = []
    for w in layout.weights:
        if not (w.block_fp8 and w.sglang):
            continue
        for part in w.sglang:
            try:
                if scaling == "channel":
                    check_channel_split(w, part)
                else:
                    check_block_split(w, part, w.shape2d, 1)
            except LayoutError as e:
                raise EngineError(f"engine.weight_dtype=fp8: {e}") from None
        group = [p.name for p in w.hf if p.write]
        if group and all(n in names for n in group):
            groups.append(group)
    return groups


def fake_quantize(w: torch.Tensor, scaling: str = "block") -> torch.Tensor:
    """dequant(quant(w)) in float32: what an FP8 engine's linear computes with, for a canonical tensor w."""
    if scaling == "channel":
        return dequantize_channels(*quantize_channels(w))
    return dequantize_blocks(*quantize_blocks(w, BLOCK), BLOCK)


class Fp8ReferenceEngine(ReferenceEngine):
    """The CPU reference engine holding FP8-emulated linear weights (see the module docstring)."""

    def __init__(self, config: dict[str, Any], scaling: str = "block", **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self._scaling = scaling  # layouts.fp8.SCALINGS
        self._fp8_groups = fp8_groups(model_layout(self._config.to_dict()), set(self._views), scaling)

    @torch.no_grad()
    def finish_weight_update(self, version: int) -> None:
        with self._model_lock:
            # only the weights this sync wrote are quantized: a LoRA adapter-only sync, or one that writes only a
            # trained vision tower, leaves the base on its grid (re-quantizing FP8 values need not give back the same
            # bits: the block scale is recomputed).
            for group in [g for g in self._fp8_groups if any(n in self._written for n in g)] if self._sync_open else ():
                views = [self._views[n] for n in group]
                full = torch.cat(views) if len(views) > 1 else views[0]
                deq = fake_quantize(full, self._scaling)
                start = 0
                for v in views:
                    v.copy_(deq[start:start + v.shape[0]])
                    start += v.shape[0]
        super().finish_weight_update(version)
