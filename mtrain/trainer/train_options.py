"""Run-config options that become megatron-core settings where the Actor builds the model and the optimizer
(docs/deepseek_v3_recipe.md, "Config keys")."""
from __future__ import annotations

import torch

from mtrain.models.hf_config import ModelConfigError


def recompute_overrides(rc) -> dict:
    """train.recompute as megatron-core TransformerConfig fields (none: no recomputation)."""
    if rc.granularity == "none":
        return {}
    if rc.granularity == "selective":  # Megatron's default module list: core attention
        return {"recompute_granularity": "selective"}
    return {"recompute_granularity": "full", "recompute_method": rc.method, "recompute_num_layers": rc.num_layers}


def cpu_offload_options(on: bool) -> dict:
    """optim.cpu_offload as megatron-core OptimizerConfig fields: the whole optimizer (fraction 1) on the host
    (HybridDeviceOptimizer: fp32 master copies + Adam moments in pinned host memory, Adam on the CPU, updated
    weights copied back). It offloads CUDA parameters only and looks every host copy up by its GPU parameter,
    so a CPU-only job (whose optimizer state is in host memory anyway) cannot use it: refused here."""
    if not on:
        return {}
    if not torch.cuda.is_available():
        raise ModelConfigError("optim.cpu_offload=true needs a GPU: megatron-core's HybridDeviceOptimizer moves "
                               "CUDA parameters to the host (here every tensor is on the host already); set "
                               "optim.cpu_offload=false on a CPU-only machine")
    return dict(optimizer_cpu_offload=True, optimizer_offload_fraction=1.0)
