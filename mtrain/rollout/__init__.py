"""Rollout: the engine protocol, the in-process SGLang engine, the CPU reference engine.

Only the protocol is imported eagerly; the engines pull in transformers / SGLang, so they load on first use
(`from mtrain.rollout import ReferenceEngine` still works).
"""
from mtrain.rollout.protocol import (
    MEMORY_TAGS,
    Completion,
    EngineError,
    Request,
    RolloutEngine,
    SamplingParams,
    expand_samples,
)

__all__ = ["MEMORY_TAGS", "Completion", "EngineError", "Request", "RolloutEngine", "SamplingParams",
           "expand_samples", "ReferenceEngine"]


def __getattr__(name: str):
    if name == "ReferenceEngine":
        from mtrain.rollout.reference_engine import ReferenceEngine

        return ReferenceEngine
    raise AttributeError(f"module 'mtrain.rollout' has no attribute {name!r}")
