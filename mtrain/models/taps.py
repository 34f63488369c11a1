"""Activation taps: the residual stream and each sublayer's output, captured by forward hooks, under one set of
names for every implementation of a decoder (Megatron-core, HF transformers, SGLang).

The logprob-gap diagnostic (`mtrain gap-probe`, mtrain/gap_probe.py) runs one token sequence through the
trainer's model, the engine's model and a high-precision HF reference, and compares the captures point by
point: where the trainer and the engine first part, and which of them is off the reference there.

Point names, in forward order:
    embed            the token embeddings
    L{i}.norm1       layer i's input RMSNorm (absent where a norm is fused into the next linear)
    L{i}.attn        layer i's attention output (after the output projection, before the residual add)
    L{i}.norm2       layer i's pre-MLP norm
    L{i}.mlp         layer i's MLP / MoE output (before the residual add)
    L{i}.out         the residual stream after layer i
    norm             the final norm's output (what the LM head reads)
Every capture is stored as float32 on the CPU, shaped [tokens, hidden] (Megatron's [s, b, h] with b = 1 and
SGLang's flat [tokens, h] alike).
"""
from __future__ import annotations

from typing import Any, Callable, Iterable

import torch

# How a module's output becomes the captured tensor; each implementation returns something else
Pick = Callable[[Any], torch.Tensor | None]


def first(out: Any) -> torch.Tensor | None:
    """A module returning (tensor, extra) -- Megatron's (output, bias), HF's (attn_output, weights)."""
    return out[0] if isinstance(out, (tuple, list)) else out


def stream_sum(out: Any) -> torch.Tensor | None:
    """SGLang's decoder layers return (hidden, residual): the residual stream is their sum (residual None at
    a layer that starts the stream)."""
    if isinstance(out, (tuple, list)):
        h, residual = out[0], out[1] if len(out) > 1 else None
        return h if residual is None else h.float() + residual.float()
    return out


class Taps:
    """Forward hooks on (name, module, pick) points; `captures` fills on each forward while armed.

    A point that runs more than once per forward (a module shared by several call sites) keeps its first
    capture; callers run exactly one forward of the sequence they probe while armed."""

    def __init__(self, points: Iterable[tuple[str, torch.nn.Module, Pick]]) -> None:
        self.captures: dict[str, torch.Tensor] = {}
        self._handles = []
        for name, module, pick in points:
            self._handles.append(module.register_forward_hook(self._hook(name, pick)))

    def _hook(self, name: str, pick: Pick):
        def hook(module, args, out):
            if name in self.captures:
                return
            t = pick(out)
            if isinstance(t, torch.Tensor):
                # a copy now: SGLang's fused add-RMSNorm overwrites its inputs in place a moment later
                self.captures[name] = t.detach().to(torch.float32, copy=True).reshape(-1, t.shape[-1]).cpu()
        return hook

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def __enter__(self) -> "Taps":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _layer_points(layers, attn: str, mlp: str, norm1: str, norm2: str, stream: Pick) -> list:
    points = []
    for i, layer in enumerate(layers):
        for key, sub in (("norm1", norm1), ("attn", attn), ("norm2", norm2), ("mlp", mlp)):
            module = getattr(layer, sub, None)
            if module is not None and type(module).__name__ != "IdentityOp":
                points.append((f"L{i}.{key}", module, first))
        points.append((f"L{i}.out", layer, stream))
    return points


def megatron_points(model: torch.nn.Module) -> list:
    """A megatron-core GPTModel (unwrapped: no DDP / Float16Module around it), one PP stage holding every layer."""
    points = [("embed", model.embedding, first)]
    points += _layer_points(model.decoder.layers, "self_attention", "mlp", "input_layernorm",
                            "pre_mlp_layernorm", first)
    if getattr(model.decoder, "final_layernorm", None) is not None:
        points.append(("norm", model.decoder.final_layernorm, first))
    return points


def _decoder_of(model: torch.nn.Module) -> torch.nn.Module:
    """The module holding embed_tokens / layers / norm in HF and SGLang causal LMs (model.model, or the
    language model inside a vision-language wrapper)."""
    for _, m in model.named_modules():
        if hasattr(m, "embed_tokens") and isinstance(getattr(m, "layers", None), torch.nn.ModuleList):
            return m
    raise ValueError(f"{type(model).__name__}: no submodule with embed_tokens and layers")


def hf_style_points(model: torch.nn.Module, *, stream: Pick = first) -> list:
    """HF transformers' decoders (stream = the layer's output) and SGLang's (stream = hidden + residual):
    both name their parts embed_tokens / layers[i].{input_layernorm, self_attn, post_attention_layernorm, mlp}
    / norm."""
    dec = _decoder_of(model)
    points = [("embed", dec.embed_tokens, first)]
    points += _layer_points(dec.layers, "self_attn", "mlp", "input_layernorm", "post_attention_layernorm", stream)
    if getattr(dec, "norm", None) is not None:
        points.append(("norm", dec.norm, first))
    return points


def point_order(names: Iterable[str]) -> list[str]:
    """Forward order of point names (embed, L0.*, L1.*, ..., norm)."""
    sub = {"norm1": 0, "attn": 1, "norm2": 2, "mlp": 3, "out": 4}

    def key(n: str):
        if n == "embed":
            return (-1, 0)
        if n == "norm":
            return (10 ** 9, 0)
        layer, part = n[1:].split(".")
        return (int(layer), sub[part])
    return sorted(names, key=key)


def rel_diff(a: torch.Tensor, b: torch.Tensor, ref: torch.Tensor) -> float:
    """||a - b|| / ||ref|| over all tokens (float64): 0 when a and b agree bit for bit."""
    a, b, ref = a.double(), b.double(), ref.double()
    return float((a - b).norm() / ref.norm().clamp_min(1e-30))
