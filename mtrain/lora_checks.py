"""The model-dependent model.lora checks (targets that match no layer of this model, unsupported models and
layouts), one ConfigError line before any process group or model exists. Megatron-free: preflight runs it."""
from __future__ import annotations

from mtrain.config_error import ConfigError
from mtrain.layouts import model_layout
from mtrain.layouts.lora import LoraSpec, lora_layout
from mtrain.layouts.rules import LayoutError


def check_model(cfg, hf_config: dict) -> None:
    lo = cfg.model.lora
    if not lo.targets:
        return
    try:
        lora_layout(model_layout(dict(hf_config, num_nextn_predict_layers=0), mtp=False),
                    LoraSpec(lo.rank, float(lo.alpha), tuple(lo.targets)))
    except LayoutError as e:
        raise ConfigError(f"model.lora.targets: {e}") from None
    p = cfg.parallel
    if "experts" in lo.targets and (p.etp or p.tp) > 1:
        raise ConfigError("model.lora.targets: experts need expert tensor parallelism 1 (parallel.etp=1, or tp=1): "
                          "megatron's dispatcher reduces expert outputs over expert-TP itself")
