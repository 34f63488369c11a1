"""HF-model helpers of the CPU reference engine: a config from a dict, and the live model's weights by their on-disk
(checkpoint) names, as views the engine writes in place."""
from __future__ import annotations

from typing import Any

import torch
from transformers import AutoConfig, PretrainedConfig
from transformers.core_model_loading import revert_weight_conversion

from mtrain.rollout.protocol import EngineError


def as_hf_config(config: dict[str, Any] | PretrainedConfig) -> PretrainedConfig:
    """A HF config from a `config.json` dict (or a PretrainedConfig, returned as is)."""
    if isinstance(config, PretrainedConfig):
        return config
    if not isinstance(config, dict) or "model_type" not in config:
        raise EngineError(f"ReferenceEngine needs a HF config dict with a 'model_type' or a PretrainedConfig, "
                          f"got {type(config).__name__}")
    rest = {k: v for k, v in config.items() if k != "model_type"}
    return AutoConfig.for_model(config["model_type"], **rest)


def peft_plain_name(name: str) -> str:
    """A PEFT-injected module's parameter name as HF/PEFT files spell it: q_proj.base_layer.weight -> q_proj.weight,
    q_proj.lora_A.default.weight -> q_proj.lora_A.weight (the adapter table's HF names, mtrain/layouts/lora.py)."""
    return name.replace(".base_layer.", ".").replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B.")


def hf_disk_views(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """On-disk (checkpoint) name -> a tensor sharing memory with the live model, for every stored weight.

    transformers 5 keeps MoE experts fused in memory (`experts.gate_up_proj [E, 2I, H]`) while checkpoints
    store `experts.{e}.gate_proj.weight`. We reuse transformers' own save-time conversion
    (`revert_weight_conversion`, the reverse of the load-time `WeightConverter`s): applied to the live
    parameters its reverse ops (chunk/unbind) return *views*, so copying into a view writes the fused
    parameter. Tied aliases (lm_head when tie_word_embeddings) are dropped, as save_pretrained does.
    """
    tied = set(getattr(model, "all_tied_weights_keys", None) or {})
    state, seen = {}, set()
    for name, tensor in model.state_dict(keep_vars=True).items():  # parameters + persistent buffers
        if name in tied or id(tensor) in seen:
            continue
        seen.add(id(tensor))
        state[peft_plain_name(name)] = tensor
    views = revert_weight_conversion(model, state)
    live = {t.untyped_storage().data_ptr() for t in state.values()}
    for name, view in views.items():
        # A conversion that concatenates on save would hand us a copy: writes would be lost silently.
        if view.untyped_storage().data_ptr() not in live:
            raise EngineError(f"weight {name!r}: transformers' conversion yields a copy, not a view of the "
                              f"model's memory; the reference engine cannot write it in place")
    return views

