"""engine.server_args: which SGLang engine arguments a run may add to mtrain's, and which it may not.

mtrain starts every SGLang engine with its own arguments (rollout/sglang_wire.engine_server_args). Some of them
come from other config keys, and a second way to set them would let the two disagree. Others fix the weight
layout or the protocol that the loader, the resharding tables and the rollout client rest on. Both kinds are
refused here, before any process group exists, with the reason and, where there is one, the key to use. The rest
go to SGLang as given; names SGLang does not know are refused when the engine is built
(rollout/sglang_preflight.unknown_server_args), where SGLang's ServerArgs can be read.
"""
from __future__ import annotations

from typing import Any, Mapping

from mtrain.config_error import ConfigError

# SGLang argument -> the mtrain config key that decides it
FROM_CONFIG = {
    "model_path": "model.hf_path",
    "tp_size": "engine.tp",
    "ep_size": "engine.ep",
    "dtype": "model.dtype and engine.weight_dtype",
    "mem_fraction_static": "engine.mem_fraction_static",
    "attention_backend": "engine.attention_backend",
    "random_seed": "train.seed",
    "quantization": "engine.weight_dtype",
    "nnodes": "engine.nnodes",
    "node_rank": "engine.nnodes",
    "dist_init_addr": "engine.nnodes",
    "base_gpu_id": "engine.tp (each engine takes its group's GPUs)",
    "enable_return_routed_experts": "algo.routing_replay",
    "disable_cuda_graph": "engine.cuda_graphs",
    "cuda_graph_max_bs_decode": "engine.cuda_graph_max_bs",
    "enable_fp32_lm_head": "model.fp32_lm_head",
    "enable_lora": "model.lora.targets",
    "lora_target_modules": "model.lora.targets",
}
# SGLang argument -> why mtrain fixes it
FIXED = {
    "load_format": "engines start from dummy weights and get every weight from the first sync",
    "skip_tokenizer_init": "requests and completions are token ids",
    "enable_memory_saver": "colocated engines release and resume their memory by tag",
    "custom_weight_loader": "mtrain's loader receives the syncs",
    "weight_version": "mtrain counts weight versions",
    "moe_runner_backend": "the sync writes w13 in the triton runner's [gate; up] layout",
    "disable_shared_experts_fusion": "the layout tables keep shared experts apart from the routed ones",
    "custom_sigquit_handler": "mtrain handles a scheduler's death",
    "incremental_streaming_output": "mtrain's streaming reads SGLang's cumulative chunks",
}


def server_args_problems(server_args: Mapping[str, Any], engine_kind: str) -> list[str]:
    """One message per entry of engine.server_args that cannot be honoured; [] when all can."""
    if server_args and engine_kind == "reference":
        return [f"applies to SGLang engines only, and engine.kind is reference (got {sorted(server_args)})"]
    out = []
    for name in server_args:
        if name in FROM_CONFIG:
            out.append(f"{name!r} is set by {FROM_CONFIG[name]}")
        elif name in FIXED:
            out.append(f"{name!r} is fixed by mtrain: {FIXED[name]}")
    return out


def refuse_on_reference_engine(server_args: Mapping[str, Any]) -> None:
    """engine.kind=auto resolved to the CPU reference engine: engine.server_args would be read by nothing."""
    if server_args:
        raise ConfigError(f"engine.server_args: applies to SGLang engines only, and this machine's engine is the "
                          f"CPU reference engine (got {sorted(server_args)})")
