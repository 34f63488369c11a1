"""Activation taps inside SGLang's scheduler processes, for the logprob-gap diagnostic (mtrain/gap_probe.py).

Registered with the engine's `custom_weight_loader` list like the weight loaders (sglang_loader.py) and
called the same way, `update_weights_from_tensor(load_format=TAP_ACTIVATIONS)` with one control entry:
    TAP_PREFIX + '{"action": "arm"}'                 hooks on this rank's model (mtrain.models.taps points);
                                                      the next forward fills them
    TAP_PREFIX + '{"action": "dump", "dir": DIR}'     rank 0 writes DIR/rank0.pt ({point: tensor}), and the
                                                      hooks are removed on every rank
The residual stream and the sublayer outputs are whole on every TP rank (the row-parallel projections
all-reduce), so rank 0's copy is the engine's. Errors go to the status directory, never raised (SGLang would
kill the whole process tree: sglang_loader's docstring).
"""
from __future__ import annotations

import json
import os
from typing import Any, Sequence

import torch

from mtrain.models.taps import Taps, hf_style_points, stream_sum
from mtrain.rollout.sglang_loader import _rank, report_error

TAP_ACTIVATIONS = "mtrain.rollout.sglang_taps.tap_activations"
TAP_PREFIX = "__mtrain_taps__"

_armed: list[Taps] = []  # at most one set of hooks per scheduler process


def tap_spec(action: str, out_dir: str | None = None) -> str:
    return TAP_PREFIX + json.dumps({"action": action, **({"dir": out_dir} if out_dir else {})})


def _disarm() -> None:
    while _armed:
        _armed.pop().close()


def tap_activations(model: torch.nn.Module, named_tensors: Sequence[tuple[str, Any]]) -> None:
    try:
        if len(named_tensors) != 1 or not str(named_tensors[0][0]).startswith(TAP_PREFIX):
            raise ValueError(f"tap_activations expects one {TAP_PREFIX}<json> entry, got "
                             f"{[n for n, _ in named_tensors][:3]}")
        spec = json.loads(named_tensors[0][0][len(TAP_PREFIX):])
        if spec.get("action") == "arm":
            _disarm()
            _armed.append(Taps(hf_style_points(model, stream=stream_sum)))
        elif spec.get("action") == "dump":
            captures = _armed[0].captures if _armed else {}
            _disarm()
            if _rank() == 0:
                os.makedirs(spec["dir"], exist_ok=True)
                torch.save(captures, os.path.join(spec["dir"], "rank0.pt"))
        else:
            raise ValueError(f"tap_activations: unknown action in {spec!r}")
    except Exception as e:  # noqa: BLE001 -- see sglang_loader.load_direct
        _disarm()
        report_error(f"tap_activations: {type(e).__name__}: {e}")
