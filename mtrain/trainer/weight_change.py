"""How far an optimizer step moves the weights the model computes with (train.log_weight_change).

A bf16 model trains through float32 main copies in the optimizer: an update smaller than half a bf16 unit in the
last place of a weight moves the main copy but leaves the bf16 weight, which the forward and the engines use, where
it was. With Adam every element moves by about the learning rate per step, so at lr 5e-6 a weight of magnitude
0.03 (half an ulp: 6e-5) changes only after a dozen steps of one sign. These metrics measure it:
- weights/changed_frac: share of model elements this step changed;
- weights/changed_frac_total: share that differ from the first step's weights;
- weights/model_rel_change, weights/main_rel_change: ||w - w_0|| / ||w_0|| of the model copy and of the float32
  main copy (the same number in a float32 model).
Sums run over this rank's parameters; the loop averages the metrics over ranks. It keeps one copy of the model
and one of the main weights, so it is meant for diagnosis, not for every run.
"""
from __future__ import annotations

import torch


def _main_params(optimizer) -> list[torch.Tensor]:
    """The float32 main copies of a mixed-precision megatron optimizer (the model's own parameters otherwise)."""
    out = []
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        groups = getattr(opt, "shard_fp32_from_float16_groups", None) or getattr(opt, "fp32_from_float16_groups", None)
        if groups:
            out += [p for g in groups for p in g]
        for g in getattr(opt, "fp32_from_fp32_groups", None) or []:
            out += list(g)
    return out


class WeightChange:
    def __init__(self, model_params: list[torch.Tensor], optimizer) -> None:
        self.params = [p for p in model_params if p.requires_grad]
        self.optimizer = optimizer
        self.first = [p.detach().clone() for p in self.params]
        self.main_first = [p.detach().clone() for p in _main_params(optimizer)] or None
        self.before: list[torch.Tensor] | None = None

    def before_step(self) -> None:
        self.before = [p.detach().clone() for p in self.params]

    def after_step(self) -> dict[str, float]:
        total = sum(p.numel() for p in self.params)
        changed = sum(int((p.detach() != b).sum()) for p, b in zip(self.params, self.before))
        changed_total = sum(int((p.detach() != f).sum()) for p, f in zip(self.params, self.first))
        self.before = None
        out = {"weights/changed_frac": changed / total, "weights/changed_frac_total": changed_total / total,
               "weights/model_rel_change": _rel_change(self.params, self.first)}
        main = _main_params(self.optimizer)
        out["weights/main_rel_change"] = (_rel_change(main, self.main_first) if self.main_first
                                          else out["weights/model_rel_change"])
        return out


def _rel_change(now: list[torch.Tensor], first: list[torch.Tensor]) -> float:
    num = sum(float((a.detach().double() - b.double()).pow(2).sum()) for a, b in zip(now, first))
    den = sum(float(b.double().pow(2).sum()) for b in first)
    return (num / den) ** 0.5 if den else 0.0
