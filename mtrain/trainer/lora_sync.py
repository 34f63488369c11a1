"""Weight sync of a LoRA policy: the engine gets the frozen base once, then only the adapters.

The first sync writes every base weight and every adapter (the engine starts from whatever it was built with);
each later sync plans and moves the adapter rows of the table alone (mtrain/layouts/lora.py): A and B, a few MB
instead of the whole model. The engine keeps its base weights between steps (the loop does not release them with
LoRA: they never change), so nothing else needs rewriting. Both plans go through the same planner and executor as
a full sync (mtrain/trainer/sync.py).
"""
from __future__ import annotations

from typing import Callable

from mtrain.layouts.lora import LoraSpec, lora_layout, peft_target_modules, with_adapters
from mtrain.layouts.table import ModelLayout


def engine_lora_args(base: ModelLayout, spec: LoraSpec) -> dict:
    """PEFT LoraConfig fields of the engine's adapter (the reference engine injects them; SGLang's
    lora_target_modules / max_lora_rank come from the same names)."""
    return {"r": spec.rank, "lora_alpha": spec.alpha, "target_modules": peft_target_modules(lora_layout(base, spec))}


class AdapterSync:
    def __init__(self, make_sync: Callable[[ModelLayout], object], base: ModelLayout, spec: LoraSpec):
        """make_sync(table): a WeightSync over the rows of `table` (same engine, groups and options)."""
        self.first = make_sync(with_adapters(base, spec))
        self.later = make_sync(lora_layout(base, spec))
        self.synced = False

    def sync(self, version: int) -> dict[str, float]:
        later = self.synced
        out = (self.later if later else self.first).sync(version)
        self.synced = True
        out["sync/adapters_only"] = float(later)
        return out
