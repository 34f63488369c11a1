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
    (HybridDeviceOptimizer: fp32 master copies + Adam moments in host memory, Adam on the CPU, updated weights
    copied back into the bf16 parameters). It offloads CUDA parameters only and looks every host copy up by its
    GPU parameter, so a CPU-only job (whose optimizer state is in host memory anyway) cannot use it: refused here.

    `use_precision_aware_optimizer` goes with it, as megatron-core's cpu_offloading README says and Megatron-LM's
    argument check requires: the distributed optimizer then hands the hybrid optimizer the bf16 parameter shards
    and keeps no fp32 main-parameter copy on the GPU. Without it (megatron-core 0.16.1) the hybrid optimizer gets
    the distributed optimizer's fp32 GPU main shards, which (a) stay on the GPU next to their host copies (4 bytes
    per parameter the offload was meant to free) and (b) make every checkpoint LOAD fail:
    `HybridDeviceOptimizer._update_fp32_params_by_new_state` looks each parameter up in `param_to_fp32_param`,
    which holds only non-fp32 parameters (KeyError), and the loaded main parameters would never reach the host
    copies the CPU Adam steps."""
    if not on:
        return {}
    if not torch.cuda.is_available():
        raise ModelConfigError("optim.cpu_offload=true needs a GPU: megatron-core's HybridDeviceOptimizer moves "
                               "CUDA parameters to the host (here every tensor is on the host already); set "
                               "optim.cpu_offload=false on a CPU-only machine")
    return dict(optimizer_cpu_offload=True, optimizer_offload_fraction=1.0, use_precision_aware_optimizer=True)


def optimizer_config(**fields):
    """megatron-core's OptimizerConfig(**fields), also where Transformer Engine is absent.

    With `use_precision_aware_optimizer`, megatron-core 0.16.1's `__post_init__` asks `is_te_min_version("2.1.0")`,
    which compares None with a version (TypeError) when TE is not installed, before it reaches the line that
    returns early for `optimizer_cpu_offload` (the hybrid optimizer needs nothing from TE). So without TE the
    config is built with the flag off and then given exactly the values `__post_init__` would have set: the flag,
    `use_precision_aware_optimizer_no_fp8_or_ds_fp8` (true whenever `optimizer_cpu_offload`), and
    `store_param_remainders=False` (what it sets for TE < 2.1). Only the CPU-offload case is handled that way."""
    from megatron.core.optimizer import OptimizerConfig
    from mtrain.compat.no_te import te_installed
    if not (fields.get("use_precision_aware_optimizer") and fields.get("optimizer_cpu_offload")) or te_installed():
        return OptimizerConfig(**fields)
    oc = OptimizerConfig(**{**fields, "use_precision_aware_optimizer": False})
    if not oc.use_distributed_optimizer or oc.optimizer != "adam":  # the checks __post_init__ would make
        raise ModelConfigError("optim.cpu_offload needs Adam and optim.use_distributed_optimizer=true")
    oc.use_precision_aware_optimizer = True
    oc.use_precision_aware_optimizer_no_fp8_or_ds_fp8 = True
    oc.store_param_remainders = False
    return oc
