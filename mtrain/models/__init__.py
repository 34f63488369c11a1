"""Megatron-core models from HF config.json dicts (llama, mistral, qwen2, qwen3, qwen3_moe, deepseek_v3,
qwen2_5_vl).

Public API (imported lazily so that ``mtrain.models.hf_config`` stays cheap to import without megatron-core):
``build_model``, ``forward_logits``, ``model_config_summary``, ``model_sharded_state_dict``, ``load_model_checkpoint``,
``make_transformer_config``, ``map_hf_config``, ``padded_vocab_size``, ``ModelConfigError``.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "build_model": "mtrain.models.builder",
    "make_transformer_config": "mtrain.models.builder",
    "model_config_summary": "mtrain.models.builder",
    "model_sharded_state_dict": "mtrain.models.builder",
    "load_model_checkpoint": "mtrain.models.builder",
    "forward_logits": "mtrain.models.forward",
    "SUPPORTED_MODEL_TYPES": "mtrain.models.hf_config",
    "ModelConfigError": "mtrain.models.config_error",
    "map_hf_config": "mtrain.models.hf_config",
    "padded_vocab_size": "mtrain.models.hf_config",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'mtrain.models' has no attribute {name!r}")
