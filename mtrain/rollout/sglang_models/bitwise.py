"""SGLang model classes for numerics.on_policy=bitwise: Llama, Qwen3 and Qwen3-MoE computed with mtrain's bitwise ops.

The engine's sampled-token logprob must equal the trainer's recompute bit for bit (docs/design-on-policy.md). The
trainer's Megatron layers call `mtrain.kernels.bitwise_ops`; these classes make SGLang's forward call the very same
functions on the same device, in the same order, on the parameters SGLang loaded (names, shapes and fused layouts
are SGLang's own, so weight sync, release/resume and the KV cache work unchanged):

  embed -> per layer: RMSNorm, fused QKV linear, (Qwen3: per-head q/k RMSNorm), RoPE, attention over the KV cache
  (`bitwise_gpu.attention`, which gives a query the same bits in a decode step, a prefill chunk or the
  trainer's packed sequence), o_proj, residual add; RMSNorm, gate|up linear, SiLU * up, down_proj (Qwen3-MoE: the
  shared fixed-order MoE of kernels/bitwise_moe_ops.py), residual add ->
  final RMSNorm -> LM head by the bitwise linear, rounded to the model's dtype as the trainer's output layer does.

They subclass SGLang's own classes (construction and weight loading are inherited) and are selected by an
architecture override (`json_model_override_args`), never by editing SGLang. What reaches SGLang's sampler is the
logits tensor; the returned logprob is then SGLang's softmax / log of it, which `bitwise_gpu.token_logprobs`
reproduces on the trainer's side. Limits (refused by mtrain.config_checks before start): TP1, no LoRA, no
multimodal input, no pipeline parallelism, plain RoPE.
"""
from __future__ import annotations

import itertools

import torch
from sglang.srt.model_executor.forward_context import get_req_to_token_pool, get_token_to_kv_pool
from sglang.srt.models.llama import LlamaForCausalLM
from sglang.srt.models.qwen3 import Qwen3ForCausalLM
from sglang.srt.models.qwen3_moe import Qwen3MoeForCausalLM

from mtrain.kernels import bitwise_moe_ops as moe_ops
from mtrain.kernels import bitwise_ops as ops
from mtrain.kernels import bitwise_gpu


class _BitwiseLinearMethod:
    """What SGLang's LogitsProcessor calls for the LM head (`quant_method.apply`, logits_processor.py
    `_compute_lm_head`): the bitwise linear, rounded to the activations' dtype like the trainer's output layer."""

    def apply(self, layer, x, bias=None):
        return ops.linear(x, layer.weight)


class _BitwiseHead(torch.nn.Module):
    """The LM head as LogitsProcessor sees it: the model's own head weight (tied or not), read at every call so that a
    weight sync into it is seen, and the bitwise method."""

    def __init__(self, head: torch.nn.Module) -> None:
        super().__init__()
        self._head = [head]  # a list: not a submodule, so its parameter is not listed twice
        self.quant_method = _BitwiseLinearMethod()

    @property
    def weight(self) -> torch.Tensor:
        return self._head[0].weight


def _token_rows(forward_batch, n_tokens: int) -> torch.Tensor:
    """Each token's row of req_to_token: its request's pool index (decode: one token per request)."""
    if forward_batch.forward_mode.is_decode():
        return forward_batch.req_pool_indices
    return torch.repeat_interleave(forward_batch.req_pool_indices, forward_batch.extend_seq_lens,
                                   output_size=n_tokens)


def _token_segments(forward_batch, n_tokens: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """bitwise_gpu.segment_attention's runs: a decode step's tokens one each (device tensors only: the step may be
    captured in a CUDA graph), an extend's tokens per request in runs of SEGMENT_TOKENS."""
    if forward_batch.forward_mode.is_decode():
        return (torch.arange(n_tokens, dtype=torch.int32, device=device),
                torch.ones(n_tokens, dtype=torch.int32, device=device))
    lengths = [int(x) for x in forward_batch.extend_seq_lens_cpu]
    return bitwise_gpu.sequence_segments([0, *itertools.accumulate(lengths)][:-1], lengths, device)


class _BitwiseForward:
    """The forward of a Llama-family model (dense, or with Qwen3-MoE experts) by mtrain's bitwise ops, mixed into
    SGLang's model classes."""

    def forward(self, input_ids, positions, forward_batch, input_embeds=None, get_embedding=False,
                pp_proxy_tensors=None, **kwargs):
        if input_embeds is not None or get_embedding or pp_proxy_tensors is not None:
            raise RuntimeError("numerics.on_policy=bitwise: embeddings in, embedding outputs and pipeline stages "
                               "are not built for the bitwise model")
        model = self.model
        h = model.embed_tokens(input_ids)
        n = h.shape[0]
        rows = _token_rows(forward_batch, n)
        segments = _token_segments(forward_batch, n, h.device) if bitwise_gpu.ATTENTION == "segment" else None
        kv_pool = get_token_to_kv_pool()
        table = get_req_to_token_pool().req_to_token
        for layer in model.layers:
            a, mlp = layer.self_attn, layer.mlp
            x = ops.rms_norm(h, layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon)
            q, k, v = ops.linear(x, a.qkv_proj.weight).split([a.q_size, a.kv_size, a.kv_size], dim=-1)
            q = q.reshape(n, a.num_heads, a.head_dim)
            k = k.reshape(n, a.num_kv_heads, a.head_dim)
            v = v.reshape(n, a.num_kv_heads, a.head_dim).contiguous()
            if hasattr(a, "q_norm"):  # Qwen3: RMSNorm of each head before RoPE
                q = ops.rms_norm(q, a.q_norm.weight, a.q_norm.variance_epsilon)
                k = ops.rms_norm(k, a.k_norm.weight, a.k_norm.variance_epsilon)
            q = ops.rope(q, positions, a.rope_theta)
            k = ops.rope(k, positions, a.rope_theta)
            kv_pool.set_kv_buffer(a.attn, forward_batch.out_cache_loc, k, v)
            layer_id = a.attn.layer_id
            o = bitwise_gpu.attention(q, kv_pool.get_key_buffer(layer_id), kv_pool.get_value_buffer(layer_id), table,
                                      rows, positions, a.attn.scaling, segments)
            h = h + ops.linear(o.reshape(n, -1), a.o_proj.weight)
            x = ops.rms_norm(h, layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon)
            h = h + self._mlp(mlp, x)
        h = ops.rms_norm(h, model.norm.weight, model.norm.variance_epsilon)
        if not hasattr(self, "_bitwise_head"):
            self._bitwise_head = _BitwiseHead(self.lm_head)
        return self.logits_processor(input_ids, h, self._bitwise_head, forward_batch)


# Named by mtrain.rollout.sglang_wire.bitwise_architecture (the override mtrain starts the engine with).
    def _mlp(self, mlp, x):
        if not hasattr(mlp, "experts"):
            gate, up = ops.linear(x, mlp.gate_up_proj.weight).chunk(2, dim=-1)
            return ops.linear(ops.silu_mul(gate, up), mlp.down_proj.weight)
        # Qwen3-MoE: the trainer's BitwiseMoELayer calls the same function (kernels/bitwise_moe_ops.py). SGLang's
        # fused experts hold w13 [E, 2I, H] (gate rows, then up) and w2 [E, H, I]. The routing is data-dependent
        # (which experts run), so this forward cannot be captured in a CUDA graph: mtrain starts such an engine
        # without decode graphs.
        expert = moe_ops.fused_experts(mlp.experts.w13_weight, mlp.experts.w2_weight)
        cfg = self.config
        out, _ = moe_ops.moe(x, mlp.gate.weight, int(cfg.num_experts_per_tok),
                             bool(getattr(cfg, "norm_topk_prob", True)), expert)
        return out


class MtrainBitwiseLlamaForCausalLM(_BitwiseForward, LlamaForCausalLM):
    pass


class MtrainBitwiseQwen3ForCausalLM(_BitwiseForward, Qwen3ForCausalLM):
    pass


class MtrainBitwiseQwen3MoeForCausalLM(_BitwiseForward, Qwen3MoeForCausalLM):
    pass


EntryClass = [MtrainBitwiseLlamaForCausalLM, MtrainBitwiseQwen3ForCausalLM, MtrainBitwiseQwen3MoeForCausalLM]
