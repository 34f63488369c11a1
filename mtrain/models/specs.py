"""Layer specs: Transformer-Engine specs when TE imports, Megatron-core's local specs otherwise.

Local-spec gaps, filled through the spec's submodule slots (the extension point specs exist for) instead of
patching Megatron:
- Multi-Latent Attention: ``MLASelfAttention`` builds its core attention with ``k_channels``/``v_channels``
  (query/key heads are ``qk_head_dim + qk_pos_emb_head_dim`` wide, value heads ``v_head_dim``), which TE's
  attention accepts and the local ``DotProductAttention`` does not: ``MLADotProductAttention``.
- Packed (THD) sequences, which the local ``DotProductAttention`` refuses: ``PackedDotProductAttention``
  (mtrain/models/packed_attention.py), the core attention of every local layer.
- MLA without a query LoRA (``q_lora_rank: null``, e.g. DeepSeek-V2-Lite) under ``qk_layernorm``: the model
  normalises only the KV latent (HF's ``kv_a_layernorm``). megatron-core 0.19 resolves this case with
  ``QKNormConfigResolver``, which wants a Q norm fused into ``linear_q_proj`` (a norm+linear module the local
  backend does not have) and refuses the local spec's Q norm as unused. ``LocalMLASelfAttention`` resolves it
  as 0.16 built it: plain ``linear_q_proj``, no Q norm, the spec's KV norm and plain ``linear_kv_up_proj``;
  every other case goes to Megatron's resolver.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_mtp_block_spec
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.multi_latent_attention import MLASelfAttention
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig

from mtrain.compat.no_te import te_installed
from mtrain.models.packed_attention import PackedDotProductAttention


def te_available() -> bool:
    """True when Transformer Engine can be imported (then its fused-layernorm specs are used)."""
    return te_installed()


class MLADotProductAttention(PackedDotProductAttention):
    """Local (non-TE) core attention that accepts MLA's separate key and value head widths.

    Scores use query/key heads of ``k_channels``; the output is ``v_channels`` per head. The parent computes
    in terms of ``config.kv_channels`` only in the final reshape (``hidden_size_per_partition``); the
    softmax scale comes in explicitly from MLASelfAttention (incl. the YaRN mscale).
    """

    def __init__(self, *args, k_channels: Optional[int] = None, v_channels: Optional[int] = None, **kwargs):
        super().__init__(*args, **kwargs)
        if v_channels is not None:
            self.hidden_size_per_attention_head = v_channels
            self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition


class LocalMLASelfAttention(MLASelfAttention):
    """MLASelfAttention for the local spec; only the no-query-LoRA norm case differs (module docstring)."""

    def _resolve_qk_norm_config(self, submodules) -> dict:
        c = self.config
        if c.q_lora_rank is not None or not c.qk_layernorm or c.qk_l2_norm:
            return super()._resolve_qk_norm_config(submodules)
        return dict(
            linear_q_proj=submodules.linear_q_proj,
            linear_q_up_proj=IdentityOp,
            linear_kv_up_proj=submodules.linear_kv_up_proj,
            q_layernorm=IdentityOp,
            kv_layernorm=submodules.kv_layernorm,
        )


def _with_local_core_attention(layer_spec: ModuleSpec) -> ModuleSpec:
    """Copy of a TransformerLayer spec whose local core attention is ours: MLADotProductAttention under MLA,
    PackedDotProductAttention otherwise; MLA itself becomes LocalMLASelfAttention."""
    attn = layer_spec.submodules.self_attention
    if not isinstance(attn, ModuleSpec) or not hasattr(attn.submodules, "core_attention"):
        return layer_spec
    is_mla = attn.module is MLASelfAttention
    ours = MLADotProductAttention if is_mla else PackedDotProductAttention
    core = attn.submodules.core_attention
    core_module = core.module if isinstance(core, ModuleSpec) else core
    if core_module is not DotProductAttention:
        return layer_spec
    new_attn = dataclasses.replace(
        attn, module=LocalMLASelfAttention if is_mla else attn.module,
        submodules=dataclasses.replace(attn.submodules, core_attention=ours),
    )
    return dataclasses.replace(
        layer_spec, submodules=dataclasses.replace(layer_spec.submodules, self_attention=new_attn)
    )


def build_specs(
    config: TransformerConfig, use_te: bool, vp_stage: Optional[int]
) -> tuple[TransformerBlockSubmodules, Optional[ModuleSpec]]:
    """(decoder block spec, MTP block spec or None) for this pipeline stage / virtual stage."""
    block = get_gpt_decoder_block_spec(
        config, use_transformer_engine=use_te, normalization="RMSNorm", vp_stage=vp_stage
    )
    if not use_te:
        block = dataclasses.replace(block, layer_specs=[_with_local_core_attention(s) for s in block.layer_specs])
    mtp = None
    if config.mtp_num_layers:
        # The MTP layer copies the last decoder layer's spec; give it the full (unsliced) last-layer spec
        # so a pipeline stage without decoder layers still builds the right MTP layer.
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_layer_specs

        last = get_gpt_decoder_layer_specs(config, use_te, normalization="RMSNorm")[-1]
        if not use_te:
            last = _with_local_core_attention(last)
        mtp = get_gpt_mtp_block_spec(config, last, use_transformer_engine=use_te, vp_stage=vp_stage)
    return block, mtp
