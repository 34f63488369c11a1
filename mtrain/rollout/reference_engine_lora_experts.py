"""LoRA on fused MoE experts in the CPU reference engine (model.lora.targets with `experts`).

transformers 5 keeps a block's routed experts as two fused parameters, `mlp.experts.gate_up_proj [E, 2I, H]` and
`mlp.experts.down_proj [E, H, I]`, not as per-expert linears, so PEFT's target_modules finds nothing to wrap there.
PEFT's `target_parameters` wraps such a parameter (`ParamWrapper`): per expert e one A (r x in) and B (out x r),
stored stacked (A: [r*E, in], row e*r + k; B: [out, r*E], column k*E + e), applied as W[e] + (alpha/r) B_e A_e
during the forward. The trainer (and SGLang) name PEFT's per-expert adapters instead
(`mlp.experts.{e}.gate_proj.lora_A.weight`, ...): one A/B pair per HF linear. down_proj maps one to one. gate and up
share the fused parameter but have separate A's, so the gate_up wrapper has rank 2r: A_e = [A_gate; A_up] and
B_e = [[B_gate, 0], [0, B_up]], whose product is [B_gate A_gate; B_up A_up], with alpha 2*alpha so the scale stays
alpha / r. The engine's arithmetic stays PEFT's; this file only lays the trainer's tensors out the way PEFT holds them.
"""
from __future__ import annotations

import contextlib
import re

import torch

# the fused parameters of transformers' MoE experts modules, by the PEFT per-expert names that feed them
FUSED = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
_PER_EXPERT = re.compile(r"^(?P<path>.+\.experts)\.(?P<e>\d+)\.(?P<lin>gate_proj|up_proj|down_proj)"
                         r"\.lora_(?P<ab>[AB])\.weight$")


def peft_lora_config(lora: dict):
    """PEFT's LoraConfig for the engine's adapter slots: lora = {r, lora_alpha, target_modules[, module_targets,
    exclude_modules, experts]} (mtrain.trainer.publishers.lora.engine_lora_args). PEFT's target_modules are the
    non-expert rows' module_targets (two name components; target_modules' last components where absent); with
    experts the fused expert parameters are target_parameters. exclude_modules: a vision-language model's vision
    tower, whose MLP shares the language model's linear names. Inject it under `as_given()`."""
    import peft
    exclude = {"exclude_modules": lora["exclude_modules"]} if lora.get("exclude_modules") else {}
    modules = list(lora.get("module_targets", lora["target_modules"]))
    if not lora.get("experts"):
        return peft.LoraConfig(lora_dropout=0.0, r=lora["r"], lora_alpha=lora["lora_alpha"],
                               target_modules=modules, **exclude)
    r, alpha = int(lora["r"]), float(lora["lora_alpha"])
    return peft.LoraConfig(lora_dropout=0.0, r=r, lora_alpha=alpha, target_modules=modules,
                           **exclude,
                           target_parameters=[f"mlp.experts.{p}" for p in FUSED],
                           rank_pattern={"gate_up_proj": 2 * r}, alpha_pattern={"gate_up_proj": 2 * alpha})


@contextlib.contextmanager
def as_given():
    """PEFT under transformers 5 rewrites, on any MoE model (Qwen3-MoE, DeepSeek-V3, ...), target_modules ending in
    gate_proj / up_proj / down_proj into the fused experts' target_parameters and drops them from target_modules
    (peft.utils.transformers_weight_conversion: adapters trained on transformers 4's per-expert linears). The
    engine's config is already in transformers 5's terms, so that rewrite took the adapters off a dense MLP layer
    and off DeepSeek's shared experts (the first load then refused their tensors as unknown) and put them on experts
    no one had targeted. Inside this block the rewrite is off."""
    from peft.utils import transformers_weight_conversion as conversion
    rewrite = conversion.convert_peft_config_for_transformers
    conversion.convert_peft_config_for_transformers = lambda *args, **kwargs: None
    try:
        yield
    finally:
        conversion.convert_peft_config_for_transformers = rewrite


def wrapper_params(model: torch.nn.Module, slot: str) -> dict[str, torch.nn.Parameter]:
    """`<experts path>.<fused parameter>.lora_A|B.weight` -> the PEFT ParamWrapper's parameter of adapter `slot`."""
    out = {}
    for name, m in model.named_modules():
        if type(m).__name__ == "ParamWrapper" and slot in m.lora_A:
            path = name.replace(".base_layer", "")
            out[f"{path}.{m.parameter_name}.lora_A.weight"] = m.lora_A[slot].weight
            out[f"{path}.{m.parameter_name}.lora_B.weight"] = m.lora_B[slot].weight
    return out


def fuse_expert_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert PEFT names -> the fused wrapper names and layouts above. An experts block whose per-expert
    tensors are not all there (every expert 0..E-1, each linear's A and B) is left as it came, so the caller's
    check names the unknown per-expert tensors and the missing fused ones."""
    groups: dict[str, dict] = {}
    out = {}
    for k, t in tensors.items():
        m = _PER_EXPERT.match(k)
        if m is None:
            out[k] = t
        else:
            groups.setdefault(m["path"], {})[(int(m["e"]), m["lin"], m["ab"])] = (k, t)
    for path, got in groups.items():
        experts = 1 + max(e for e, _, _ in got)
        for fused, lins in FUSED.items():
            keys = [(e, lin, ab) for e in range(experts) for lin in lins for ab in "AB"]
            if not all(key in got for key in keys):
                out.update({got[key][0]: got[key][1] for key in keys if key in got})
                continue
            a = torch.cat([torch.cat([got[(e, lin, "A")][1] for lin in lins]) for e in range(experts)])
            blocks = [torch.block_diag(*[got[(e, lin, "B")][1] for lin in lins]) for e in range(experts)]
            out[f"{path}.{fused}.lora_A.weight"] = a
            out[f"{path}.{fused}.lora_B.weight"] = torch.stack(blocks, dim=-1).flatten(1)  # column k*E + e
    return out
