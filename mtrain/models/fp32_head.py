"""A float32 language-model head on a bf16 Megatron model (model.fp32_lm_head).

In bf16 the output layer rounds every logit to 8 mantissa bits before the softmax; the engine rounds its own logits
too, differently (another kernel, another summation order), so the trainer-vs-engine logprob gap carries both
roundings. With this head the output layer multiplies float32 copies of its input and weight (the tied embedding
too: GPTModel passes it as `weight=`), so its logits are float32; SGLang's `enable_fp32_lm_head` does the same on
the engine side. The gradient flows back through the casts into the bf16 parameters, as it would without them.
"""
from __future__ import annotations

import torch


def _float32_inputs(module, args, kwargs):
    weight = kwargs.get("weight")
    kwargs["weight"] = (module.weight if weight is None else weight).float()
    return (args[0].float(), *args[1:]), kwargs


def install_fp32_lm_head(chunks) -> int:
    """Hook the output layer of every chunk that has one (the last pipeline stage); returns how many were hooked."""
    hooked = 0
    for chunk in chunks:
        layer = getattr(chunk, "output_layer", None)
        if isinstance(layer, torch.nn.Module):
            layer.register_forward_pre_hook(_float32_inputs, with_kwargs=True)
            hooked += 1
    return hooked
