"""Recording routed experts from a transformers (5.x) MoE model as it runs: the CPU reference engine's capture.

transformers 5 MoE blocks (Qwen3-MoE, DeepSeek-V3, Mixtral, ...) compute their top-k in the block and then call
`self.experts(hidden_states, top_k_index, top_k_weights)`. A forward pre-hook on that `experts` module sees the ids
the block really used, so what we record is what the model computed (not a second, possibly different, top-k).
"""
from __future__ import annotations

import torch

from mtrain.rollout.protocol import EngineError
from mtrain.rollout.routing import routing_shape


class RoutingRecorder:
    """Hooks on every MoE block of `model`; `start((b, t))` before a forward, `finish()` after it returns the
    routing of each of the b rows: [t, num_layers, top_k] in the stored dtype, zero rows for dense layers."""

    def __init__(self, model: torch.nn.Module, hf_config: dict) -> None:
        self.shape = routing_shape(hf_config)
        if self.shape is None:
            raise EngineError("record_routing: the model has no MoE layers, there is no routing to record")
        layers = model.model.layers
        found = []
        for i, layer in enumerate(layers):
            experts = getattr(getattr(layer, "mlp", None), "experts", None)
            if experts is None:
                continue
            found.append(i)
            experts.register_forward_pre_hook(self._hook(i))
        if tuple(found) != self.shape.moe_layers:
            raise EngineError(f"record_routing: the HF model has MoE blocks at layers {found}, the config says "
                              f"{list(self.shape.moe_layers)}")
        self._calls: dict[int, torch.Tensor] = {}
        self._bt: tuple[int, int] | None = None

    def _hook(self, layer: int):
        def hook(module, args):
            if self._bt is not None:
                self._calls[layer] = args[1].detach()
        return hook

    def start(self, batch_shape) -> None:
        self._bt = (int(batch_shape[0]), int(batch_shape[1]))
        self._calls = {}

    def finish(self) -> list[torch.Tensor]:
        b, t = self._bt
        s = self.shape
        out = torch.zeros((b * t, s.num_layers, s.top_k), dtype=s.dtype)
        for layer in s.moe_layers:
            ids = self._calls.get(layer)
            if ids is None or ids.shape != (b * t, s.top_k):
                raise EngineError(f"record_routing: layer {layer} recorded "
                                  f"{None if ids is None else tuple(ids.shape)}, expected ({b * t}, {s.top_k})")
            out[:, layer] = ids.to(s.dtype)
        self._bt, self._calls = None, {}
        return list(out.view(b, t, s.num_layers, s.top_k).unbind(0))
