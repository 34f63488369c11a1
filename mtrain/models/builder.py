"""Build Megatron-core GPTModel chunks from a HF config dict, inside a live ``parallel_state``.

One chunk per virtual pipeline stage (one chunk without VPP). The HF -> Megatron field mapping lives in
``mtrain.models.hf_config`` (with its table); this module adds the parallel sizes and builds the model.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from megatron.core import parallel_state as ps
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

from mtrain.compat import cpu_shim
from mtrain.models.hf_config import ModelConfigError, dtype_flags, map_hf_config, padded_vocab_size
from mtrain.models.hf_rope import YARN_CONFIG_ATTRS
from mtrain.models.specs import build_specs, te_available


def _check_divisible(what: str, value: int, by_name: str, by: int) -> None:
    if by > 0 and value % by != 0:
        raise ModelConfigError(f"{what}={value} is not divisible by {by_name}={by}")


def _parallel_sizes(vpp: Optional[int]) -> dict[str, Any]:
    if not ps.model_parallel_is_initialized():
        raise RuntimeError("build_model needs megatron parallel_state: call mtrain.dist.init_distributed() first")
    live_vpp = ps.get_virtual_pipeline_model_parallel_world_size()
    if vpp != live_vpp and not (vpp in (None, 1) and live_vpp in (None, 1)):
        raise ModelConfigError(
            f"vpp={vpp} differs from parallel_state's virtual pipeline size {live_vpp}; "
            "pass the same vpp to init_distributed and build_model"
        )
    return dict(
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
        virtual_pipeline_model_parallel_size=vpp if vpp and vpp > 1 else None,
        expert_model_parallel_size=ps.get_expert_model_parallel_world_size(),
        expert_tensor_parallel_size=ps.get_expert_tensor_parallel_world_size(),
        context_parallel_size=ps.get_context_parallel_world_size(),
    )


def pipeline_split_overrides(first_stage_layers: Optional[int], last_stage_layers: Optional[int]) -> dict[str, int]:
    """Our uneven pipeline split (parallel.first_stage_layers/last_stage_layers, the converters'
    --first-stage-layers/--last-stage-layers) as megatron-core TransformerConfig fields."""
    return {k: v for k, v in (("num_layers_in_first_pipeline_stage", first_stage_layers),
                              ("num_layers_in_last_pipeline_stage", last_stage_layers)) if v is not None}


def _check_stage_split(num_layers: int, pp: int, vpp: int, overrides: dict[str, Any]) -> None:
    """Layers per stage: even (num_layers % pp*vpp == 0) or the uneven split, checked by the same rule the
    planner uses (MegatronLayout.stage_layers), so the model and the weight plan never disagree."""
    first = overrides.get("num_layers_in_first_pipeline_stage")
    last = overrides.get("num_layers_in_last_pipeline_stage")
    if first is None and last is None:
        _check_divisible("num_hidden_layers", num_layers, "pipeline_model_parallel_size*vpp", pp * vpp)
        return
    from mtrain.layouts import LayoutError
    from mtrain.reshard.placement import MegatronLayout
    try:
        MegatronLayout(pp=pp, vpp=vpp if vpp > 1 else None, first_stage_layers=first,
                       last_stage_layers=last).stage_layers(num_layers)
    except LayoutError as e:
        raise ModelConfigError(f"uneven pipeline split: {e}") from None
    if pp == 1:
        raise ModelConfigError(f"first/last pipeline stage layers ({first}/{last}) given with "
                               "pipeline_model_parallel_size=1")


def _validate(cfg: dict[str, Any], par: dict[str, Any], overrides: Optional[dict[str, Any]] = None) -> None:
    tp, pp = par["tensor_model_parallel_size"], par["pipeline_model_parallel_size"]
    vpp = par["virtual_pipeline_model_parallel_size"] or 1
    _check_divisible("num_attention_heads", cfg["num_attention_heads"], "tensor_model_parallel_size", tp)
    _check_divisible("num_key_value_heads", cfg["num_query_groups"], "tensor_model_parallel_size", tp)
    _check_stage_split(cfg["num_layers"], pp, vpp, overrides or {})
    if cfg.get("num_moe_experts"):
        ep, etp = par["expert_model_parallel_size"], par["expert_tensor_parallel_size"]
        _check_divisible("num_experts", cfg["num_moe_experts"], "expert_model_parallel_size", ep)
        _check_divisible("moe_intermediate_size", cfg["moe_ffn_hidden_size"], "expert_tensor_parallel_size", etp)
    elif par["expert_model_parallel_size"] > 1:
        raise ModelConfigError(
            f"expert_model_parallel_size={par['expert_model_parallel_size']} needs a MoE model (this one has no experts)"
        )
    _check_divisible("intermediate_size", cfg["ffn_hidden_size"], "tensor_model_parallel_size", tp)


def make_transformer_config(
    hf_config: dict,
    *,
    params_dtype: torch.dtype = torch.float32,
    vpp: Optional[int] = None,
    use_te: bool = False,
    config_overrides: Optional[dict[str, Any]] = None,
) -> TransformerConfig:
    """The TransformerConfig (MLATransformerConfig for deepseek_v3) for the live parallel layout."""
    mapped = map_hf_config(hf_config)
    par = _parallel_sizes(vpp)
    _validate(mapped.config_kwargs, par, config_overrides)
    on_gpu = torch.cuda.is_available()
    kwargs: dict[str, Any] = dict(mapped.config_kwargs)
    kwargs.update(par)
    kwargs.update(dtype_flags(params_dtype))
    kwargs.update(
        # Megatron defaults some fusions on; they need CUDA kernels (or TE) and change nothing numerically.
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        cross_entropy_loss_fusion=False,
        # On CPU the weights are created on the host; on GPU directly on the device.
        use_cpu_initialization=not on_gpu,
        # gloo cannot run a batched isend/irecv list correctly with VPP (seen: swapped tensors).
        batch_p2p_comm=on_gpu,
        # Variable-length rollouts: schedules exchange shapes between PP stages.
        variable_seq_lengths=True,
        # ...which Megatron allows only with the alltoall dispatcher (checked even for dense models).
        moe_token_dispatcher_type="alltoall",
        # Sequence parallel saves activation memory with TP>1, but the local spec's WrappedTorchNorm
        # refuses it: on only with Transformer Engine.
        sequence_parallel=use_te and par["tensor_model_parallel_size"] > 1,
        # Which backend Megatron's own resolvers (0.19's MLA Q/KV-norm resolver) build from: the one the specs use.
        transformer_impl="transformer_engine" if use_te else "local",
    )
    if use_te and kwargs.get("num_moe_experts"):
        kwargs["moe_grouped_gemm"] = True  # TEGroupedMLP: one grouped GEMM per layer instead of E linears
    kwargs.update(config_overrides or {})
    undeclared = {k: kwargs.pop(k) for k in YARN_CONFIG_ATTRS if k in kwargs}  # read as attributes (hf_rope.py)
    cls = MLATransformerConfig if mapped.mla else TransformerConfig
    config = cls(**kwargs)
    for key, value in undeclared.items():
        setattr(config, key, value)
    return config


def build_model(
    hf_config: dict,
    *,
    params_dtype: torch.dtype = torch.float32,
    vpp: Optional[int] = None,
    use_te: Optional[bool] = None,
    make_vocab_size_divisible_by: int = 128,
    config_overrides: Optional[dict[str, Any]] = None,
    train_vision: bool = False,
    on_policy: str = "off",
) -> tuple[list[GPTModel], TransformerConfig]:
    """Build this rank's model chunks (one per virtual stage) and the shared TransformerConfig.

    A vision-language model (qwen2_5_vl) is a `VisionLanguageModel` (a GPTModel with the vision tower on the first
    stage); ``train_vision`` trains the tower (frozen otherwise: model.train_vision).

    ``use_te=None`` picks Transformer-Engine specs when TE imports; ``use_te=True`` without TE is an error.
    ``config_overrides`` sets any TransformerConfig field after the mapping (e.g. recompute settings).
    ``on_policy="bitwise"`` (numerics.on_policy) builds the fixed-order layers of mtrain.models.bitwise_layers.
    """
    cpu_shim.apply()
    if use_te is None:
        use_te = te_available()
    elif use_te and not te_available():
        raise ModelConfigError("use_te=True but transformer_engine is not importable")
    mapped = map_hf_config(hf_config)
    bitwise = on_policy == "bitwise"  # its logprobs: token_logprobs(..., bitwise=True), the engine's log-softmax
    if bitwise:
        from mtrain.models.bitwise_layers import bitwise_mapped
        use_te, (mapped, rope_theta) = False, bitwise_mapped(mapped)
    config = make_transformer_config(
        hf_config, params_dtype=params_dtype, vpp=vpp, use_te=use_te, config_overrides=config_overrides
    )
    vocab = padded_vocab_size(mapped.vocab_size, config.tensor_model_parallel_size, make_vocab_size_divisible_by)
    n_chunks = config.virtual_pipeline_model_parallel_size or 1
    model_cls, extra = GPTModel, {}
    if mapped.vision:
        from mtrain.models.vlm import VisionLanguageModel
        model_cls, extra = VisionLanguageModel, {"train_vision": train_vision}
    chunks: list[GPTModel] = []
    for chunk in range(n_chunks):
        vp_stage = chunk if n_chunks > 1 else None
        block_spec, mtp_spec = build_specs(config, use_te, vp_stage)
        if bitwise:
            from mtrain.models.bitwise_layers import bitwise_block_spec
            block_spec = bitwise_block_spec(block_spec, rope_theta)
        model = model_cls(
            config=config,
            transformer_layer_spec=block_spec,
            vocab_size=vocab,
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            parallel_output=True,
            mtp_block_spec=mtp_spec,
            vp_stage=vp_stage,
            **mapped.model_kwargs,
            **extra,
        )
        if torch.cuda.is_available():
            model.cuda(torch.cuda.current_device())
        # Remember what forward_logits must cut the padded vocabulary back to.
        model.mtrain_vocab_size = mapped.vocab_size
        if bitwise:
            from mtrain.models.bitwise_layers import use_bitwise_output_layer
            use_bitwise_output_layer(model)
        model.mtrain_model_type = mapped.model_type
        chunks.append(model)
    return chunks, config


def model_config_summary(config: TransformerConfig, chunks: Optional[list[GPTModel]] = None) -> str:
    """A few lines for the start-of-run log: shape, attention, MoE, parallel layout, parameter counts."""
    c = config
    lines = [
        f"layers={c.num_layers} hidden={c.hidden_size} heads={c.num_attention_heads} "
        f"kv_groups={c.num_query_groups} head_dim={c.kv_channels} ffn={c.ffn_hidden_size} "
        f"norm={c.normalization}(eps={c.layernorm_epsilon}) dtype={c.params_dtype}",
    ]
    if getattr(c, "multi_latent_attention", False):
        lines.append(
            f"MLA q_lora_rank={c.q_lora_rank} kv_lora_rank={c.kv_lora_rank} qk_head_dim={c.qk_head_dim} "
            f"qk_pos_emb_head_dim={c.qk_pos_emb_head_dim} v_head_dim={c.v_head_dim} rope_type={c.rope_type}"
        )
    else:
        lines.append(f"qkv_bias={c.add_qkv_bias} qk_layernorm={c.qk_layernorm}")
    if c.num_moe_experts:
        lines.append(
            f"MoE experts={c.num_moe_experts} topk={c.moe_router_topk} ffn={c.moe_ffn_hidden_size} "
            f"shared={c.moe_shared_expert_intermediate_size} score={c.moe_router_score_function} "
            f"expert_bias={c.moe_router_enable_expert_bias} groups={c.moe_router_num_groups}/"
            f"{c.moe_router_group_topk} scale={c.moe_router_topk_scaling_factor} layer_freq={c.moe_layer_freq}"
        )
    if c.mtp_num_layers:
        lines.append(f"MTP layers={c.mtp_num_layers}")
    lines.append(
        f"parallel tp={c.tensor_model_parallel_size} pp={c.pipeline_model_parallel_size} "
        f"vpp={c.virtual_pipeline_model_parallel_size} ep={c.expert_model_parallel_size} "
        f"etp={c.expert_tensor_parallel_size} cp={c.context_parallel_size} sp={c.sequence_parallel}"
    )
    if chunks is not None:
        n = sum(p.numel() for m in chunks for p in m.parameters())
        lines.append(f"parameters on this rank: {n:,} in {len(chunks)} chunk(s)")
    return "\n".join(lines)


def model_sharded_state_dict(chunks: list[GPTModel]) -> dict[str, Any]:
    """Megatron dist-checkpoint state of all chunks: ``{"chunk0": ..., "chunk1": ...}``.

    Passes the ``dp_cp_group`` metadata explicitly: GPTModel.sharded_state_dict (0.16.1) fills it in for
    its parent class but then reads the caller's ``metadata`` itself on an MTP stage that is not the first
    stage (PP>1 with MTP), where ``None`` fails. The same dict structure loads under any parallel layout
    (keys inside are global names), so ``dist_checkpointing.load(model_sharded_state_dict(c), dir)``
    reshards a checkpoint saved under another layout.
    """
    from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group

    return {
        f"chunk{i}": m.sharded_state_dict(metadata=ensure_metadata_has_dp_cp_group(None))
        for i, m in enumerate(chunks)
    }


def hybrid_optimizer_classes() -> list:
    """The optimizer classes a trainer checkpoint written with optim.cpu_offload names in its common state
    (megatron-core's HybridDeviceOptimizer keeps cpu_optimizer_cls/gpu_optimizer_cls in its param groups), which
    megatron reads with torch.load (weights_only) and refuses unless allowed: megatron-core's choices for them."""
    import megatron.core.optimizer as mopt
    return [c for c in {torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD, mopt.Adam, mopt.SGD}
            if isinstance(c, type)]


def load_model_checkpoint(chunks: list[GPTModel], path) -> None:
    """Fill this rank's chunks from a Megatron dist checkpoint saved under any parallel layout (a converter's
    output or a trainer checkpoint): megatron reshards on load, every model tensor must be there."""
    from megatron.core import dist_checkpointing

    with torch.serialization.safe_globals(hybrid_optimizer_classes()):
        loaded = dist_checkpointing.load(model_sharded_state_dict(chunks), str(path))
    for i, c in enumerate(chunks):
        c.load_state_dict(loaded[f"chunk{i}"])
