"""The CPU reference engine in bitwise on-policy mode (numerics.on_policy=bitwise).

The HF model still holds the weights (so weight sync, release/resume and checkpoints are the reference engine's),
but tokens are computed by a forward written with `mtrain.kernels.bitwise_ops`, the same ops the trainer's bitwise
Megatron layers (mtrain/models/bitwise_layers.py) run, in the same order and dtypes: the logprob returned for each
sampled token is then bit for bit the one the trainer recomputes.

Each decoding step recomputes the whole sequence (no KV cache): the ops are batch- and length-invariant, so this
changes no bits, and it keeps the engine's forward a single function of the tokens. `tp_size` > 1 computes every
row-parallel layer (o_proj, down_proj) as that many ranks would, a tree over each rank's K slice then the top of
the tree over the ranks' float32 partials, to show that the engine's split does not change the bits either.

Qwen3-MoE blocks go through `mtrain.kernels.bitwise_moe_ops.moe`, the function the trainer's BitwiseMoELayer calls,
with the HF model's router and fused expert tensors. `record_routing` returns the experts this forward chose for every
input token (`Completion.routed_experts`, routing replay's layout), recorded at the step that first computed the token.
"""
from __future__ import annotations

import os
from typing import Any

import torch

from mtrain.kernels import bitwise_moe_ops as moe_ops
from mtrain.kernels import bitwise_ops as ops
from mtrain.rollout.protocol import Completion, EngineError, Request
from mtrain.rollout.reference_engine import ReferenceEngine
from mtrain.rollout.reference_engine_sampling import sample_token, top_alternatives

SUPPORTED = ("llama", "qwen2", "qwen3", "qwen3_moe")


def unsupported_model(hf_config: dict) -> str | None:
    """Why this engine cannot compute a model (its config.json dict) bit for bit, or None. The preflight asks it
    before any process group starts; the engine's constructor asks it again."""
    rope = hf_config.get("rope_scaling") or hf_config.get("rope_parameters") or {}
    if hf_config.get("model_type") not in SUPPORTED or hf_config.get("vision_config") or \
            rope.get("rope_type", rope.get("type", "default")) != "default":
        return (f"numerics.on_policy=bitwise: the reference engine computes {', '.join(SUPPORTED)} with plain RoPE; "
                f"got {hf_config.get('model_type')}")
    return None


def reference_engine_class(on_policy: str) -> type[ReferenceEngine]:
    """The reference engine of numerics.on_policy: BitwiseReferenceEngine for "bitwise", ReferenceEngine for "off"."""
    return BitwiseReferenceEngine if on_policy == "bitwise" else ReferenceEngine


class BitwiseReferenceEngine(ReferenceEngine):
    """ReferenceEngine whose forward and sampled-token logprobs are the fixed-order ops'."""

    def __init__(self, config, *, tp_size: int = 1, **kwargs: Any) -> None:
        if kwargs.get("lora"):
            raise EngineError("numerics.on_policy=bitwise: the reference engine's lora is not built for it")
        record = bool(kwargs.pop("record_routing", False))  # recorded by this forward, not the HF model's hooks
        super().__init__(config, **kwargs)
        cfg = self._config
        problem = unsupported_model(cfg.to_dict()) or (self._vlm and f"numerics.on_policy=bitwise: {cfg.model_type} "
                                                                       f"is a vision-language model")
        if problem:
            raise EngineError(problem)
        self.tp_size = int(tp_size)
        self._theta = float(getattr(cfg, "rope_theta", None) or (getattr(cfg, "rope_parameters", None) or {})["rope_theta"])
        self._eps = float(cfg.rms_norm_eps)
        self._head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        from mtrain.rollout.routing import routing_shape
        self._route_shape = routing_shape(cfg.to_dict())  # None: dense
        if record and self._route_shape is None:
            raise EngineError("record_routing: the model has no MoE layers, there is no routing to record")
        self._record = record

    def _row_parallel(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x @ weight^T (+ bias, added in x's dtype after the rounding, as the trainer's row-parallel layer)."""
        if self.tp_size == 1:
            return ops.linear(x, weight, bias)
        k = weight.shape[1] // self.tp_size
        if k & (k - 1) or weight.shape[1] % self.tp_size:
            raise EngineError(f"bitwise engine tp_size={self.tp_size}: K={weight.shape[1]} per rank is not a power of 2")
        parts = [ops.linear_fp32(x[..., r * k:(r + 1) * k], weight[:, r * k:(r + 1) * k]) for r in range(self.tp_size)]
        out = ops.tree_sum(torch.stack(parts, dim=-1)).to(x.dtype)
        return out + bias if bias is not None else out

    def _mlp(self, mlp, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the MLP block's output, expert ids [T, k] of a Qwen3-MoE block or None for a dense one)."""
        if not hasattr(mlp, "experts"):
            act = ops.silu_mul(ops.linear(y, mlp.gate_proj.weight, mlp.gate_proj.bias),
                               ops.linear(y, mlp.up_proj.weight, mlp.up_proj.bias))
            return self._row_parallel(act, mlp.down_proj.weight, mlp.down_proj.bias), None
        ex = mlp.experts  # transformers 5: gate_up_proj [E, 2I, H] (gate rows, then up), down_proj [E, H, I]
        expert = moe_ops.fused_experts(ex.gate_up_proj, ex.down_proj, self._row_parallel)
        return moe_ops.moe(y, mlp.gate.weight, int(self._config.num_experts_per_tok),
                           bool(self._config.norm_topk_prob), expert)

    @torch.no_grad()
    def bitwise_logits(self, tokens: torch.Tensor, routes: list | None = None) -> torch.Tensor:
        """Logits [B, T, vocab] (the model's dtype) of token rows [B, T], every row from position 0. `routes`, when
        given, gets each row's expert ids [T, layers, top_k] (routing replay's layout: zeros for dense layers)."""
        m = self._model.model
        h, d = self._config.num_attention_heads, self._head_dim
        hkv = self._config.num_key_value_heads
        rows = []
        shape = self._route_shape
        if routes is not None and shape is None:
            raise EngineError("bitwise_logits: a dense model has no routes")
        for row in tokens:
            t = row.shape[0]
            chosen = torch.zeros((t, shape.num_layers, shape.top_k), dtype=shape.dtype) if routes is not None else None
            pos = torch.arange(t)
            x = m.embed_tokens.weight[row]
            for li, layer in enumerate(m.layers):
                a = layer.self_attn
                y = ops.rms_norm(x, layer.input_layernorm.weight, self._eps)
                # biases (Qwen2's q/k/v) are added after the rounding, in the model's dtype, as the trainer's layers
                q = ops.linear(y, a.q_proj.weight, a.q_proj.bias).view(t, h, d)
                k = ops.linear(y, a.k_proj.weight, a.k_proj.bias).view(t, hkv, d)
                v = ops.linear(y, a.v_proj.weight, a.v_proj.bias).view(t, hkv, d)
                if hasattr(a, "q_norm"):
                    q = ops.rms_norm(q, a.q_norm.weight, self._eps)
                    k = ops.rms_norm(k, a.k_norm.weight, self._eps)
                q, k = ops.rope(q, pos, self._theta), ops.rope(k, pos, self._theta)
                o = ops.causal_attention(q, k, v, d ** -0.5).reshape(t, h * d)
                x = x + self._row_parallel(o, a.o_proj.weight, a.o_proj.bias)
                y = ops.rms_norm(x, layer.post_attention_layernorm.weight, self._eps)
                out, ids = self._mlp(layer.mlp, y)
                x = x + out
                if chosen is not None and ids is not None:
                    chosen[:, li] = ids.to(shape.dtype)
            if chosen is not None:
                routes.append(chosen)
            x = ops.rms_norm(x, m.norm.weight, self._eps)
            rows.append(ops.linear(x, self._model.lm_head.weight))
        return torch.stack(rows)

    @torch.no_grad()
    def _generate_group(self, reqs: list[Request]) -> list[Completion]:
        """Requests of one prompt length in lock step; each step recomputes every row's sequence (see the module)."""
        seqs = [list(r.prompt_ids) for r in reqs]
        outputs: list[list[int]] = [[] for _ in reqs]
        logprobs: list[list[float]] = [[] for _ in reqs]
        tops: list[list | None] = [[] if r.params.top_logprobs else None for r in reqs]
        finish: list[str | None] = [None] * len(reqs)
        routed: list[list[torch.Tensor]] = [[] for _ in reqs]  # per request: rows of the positions first computed
        gens = [torch.Generator().manual_seed(r.params.seed if r.params.seed is not None
                                              else int.from_bytes(os.urandom(7), "little")) for r in reqs]
        while True:
            self._gate()
            for i, r in enumerate(reqs):
                if finish[i] is None and self._is_aborted(r.rid):
                    finish[i] = "abort"
            alive = [i for i in range(len(reqs)) if finish[i] is None]
            if not alive:
                break
            routes = [] if self._record else None
            logits = self.bitwise_logits(torch.tensor([seqs[i] for i in alive]), routes)[:, -1, :].float()
            for row, i in enumerate(alive if routes is not None else ()):
                routed[i].append(routes[row][sum(len(r) for r in routed[i]):])  # the prompt, then one per step
            for row, i in enumerate(alive):
                params = reqs[i].params
                token, _ = sample_token(logits[row], params, gens[i])  # the choice; its logprob comes next
                temperature = 1.0 if params.greedy else params.temperature
                logprob = float(ops.token_logprobs(logits[row], torch.tensor(token), temperature))
                outputs[i].append(token)
                logprobs[i].append(logprob)
                seqs[i].append(token)
                if tops[i] is not None:
                    tops[i].append(top_alternatives(logits[row], params))
                if token in params.stop_token_ids:
                    finish[i] = "stop"
                elif len(outputs[i]) >= params.max_new_tokens:
                    finish[i] = "length"
            with self._abort_lock:
                for i in alive:
                    self._progress[reqs[i].rid] = len(outputs[i])
        return [Completion(rid=r.rid, prompt_ids=list(r.prompt_ids), output_ids=outputs[i], logprobs=logprobs[i],
                           finish_reason=finish[i], weight_version=self._version,  # type: ignore[arg-type]
                           top_logprobs=tops[i], vision=r.vision,
                           routed_experts=torch.cat(routed[i])[r.routed_experts_start:].clone() if routed[i] else None,
                           routed_experts_start=r.routed_experts_start)
                for i, r in enumerate(reqs)]
