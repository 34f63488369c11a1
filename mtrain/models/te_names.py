"""Which Megatron parameter names the Transformer-Engine layer specs use instead of the local specs.

Read from megatron-core 0.16.1 ``gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec``,
``backends.TESpecProvider`` and ``moe_module_specs`` (TE is not installed on the CPU box, so these
cannot be dumped; the local-spec names are in the ``{arch}.txt`` dumps). Written by ``dump_names``.
"""

TE_NAMES_MD = """\
# Transformer-Engine spec names vs local spec names (megatron-core 0.16.1)

`L` = local spec (what the `{arch}.txt` dumps show; used when TE is not importable),
`TE` = `get_gpt_layer_with_transformer_engine_spec` (used when TE is importable).
Prefix `decoder.layers.{i}.` omitted. Tensor shapes and row layouts are the same in both.

## GQA attention (llama, qwen2, qwen3, qwen3_moe)
| L (module param)                       | TE (module param)                                   |
|----------------------------------------|-----------------------------------------------------|
| input_layernorm.weight                 | self_attention.linear_qkv.layer_norm_weight (TELayerNormColumnParallelLinear fuses the pre-attention RMSNorm) |
| self_attention.linear_qkv.weight/.bias | same                                                |
| self_attention.q_layernorm.weight      | same (TENorm for qk; qwen3 family)                  |
| self_attention.k_layernorm.weight      | same                                                |
| self_attention.linear_proj.weight      | same                                                |

## Dense MLP layers (all; the first_k_dense / mlp_only layers of the MoE models)
| L                                      | TE                                                  |
|----------------------------------------|-----------------------------------------------------|
| pre_mlp_layernorm.weight               | mlp.linear_fc1.layer_norm_weight (fused into TELayerNormColumnParallelLinear; pre_mlp_layernorm is IdentityOp) |
| mlp.linear_fc1.weight, mlp.linear_fc2.weight | same                                          |

Note: the *local* non-MLA spec already maps these two in `sharded_state_dict` keys
(`sharded_state_dict_keys_map`: `input_layernorm.` -> `self_attention.linear_qkv.layer_norm_`,
`pre_mlp_layernorm.` -> `mlp.linear_fc1.layer_norm_`), so dist-checkpoint keys match TE's names for
dense layers; only `named_parameters()` differ. Check the `--- sharded_state_dict` part of each dump.
Caveat: the local spec applies that map to its MoE layers too (`pre_mlp_layernorm.weight` is saved as
`mlp.linear_fc1.layer_norm_weight`), while TE's MoE layers keep `pre_mlp_layernorm.weight`: local and
TE dist checkpoints of MoE models differ in that one key per MoE layer.

Expert indices: `named_parameters()` use the LOCAL index j (0..E/EP-1) in `local_experts.{j}`;
the global expert is `ep_rank * (E/EP) + j`. Checkpoint keys put all experts on one global axis.

## MoE layers (qwen3_moe, deepseek_v3)
| L                                                   | TE                                          |
|-----------------------------------------------------|---------------------------------------------|
| pre_mlp_layernorm.weight                            | same (TENorm; not fused for MoE layers)     |
| mlp.router.weight, mlp.router.expert_bias (buffer)  | same                                        |
| mlp.experts.local_experts.{j}.linear_fc1.weight (SequentialMLP, moe_grouped_gemm=False) | mlp.experts.linear_fc1.weight{j} (TEGroupedMLP, moe_grouped_gemm=True; j = local expert index; mtrain turns grouped GEMM on with TE) |
| mlp.experts.local_experts.{j}.linear_fc2.weight     | mlp.experts.linear_fc2.weight{j}            |
| mlp.shared_experts.linear_fc1.weight / linear_fc2.weight | same                                   |
TEGroupedMLP's sharded_state_dict uses keys `mlp.experts.experts.linear_fc1.weight` with a global expert
axis (ShardedTensor per expert, `replica_id`/`prepend_axis_num`), SequentialMLP uses
`mlp.experts.local_experts.{global_e}.linear_fc1.weight` reshaped into one key
`mlp.experts.experts.linear_fc1.weight` too (see dumps). Legacy GroupedMLP (local + grouped gemm,
not used by mtrain) would be `mlp.experts.weight1` [H, E_local*2*I] / `mlp.experts.weight2`.

## MLA attention (deepseek_v3)
| L                                                  | TE                                                |
|----------------------------------------------------|---------------------------------------------------|
| input_layernorm.weight                             | same (TENorm, not fused for MLA)                  |
| self_attention.linear_q_down_proj.weight           | same (TELinear, duplicated across TP)             |
| self_attention.q_layernorm.weight                  | self_attention.linear_q_up_proj.layer_norm_weight (fused TELayerNormColumnParallelLinear) |
| self_attention.linear_q_up_proj.weight             | same                                              |
| self_attention.linear_q_proj.weight (q_lora_rank=None) | same (TEColumnParallelLinear)                 |
| self_attention.linear_kv_down_proj.weight          | same (TELinear, duplicated across TP)             |
| self_attention.kv_layernorm.weight                 | self_attention.linear_kv_up_proj.layer_norm_weight |
| self_attention.linear_kv_up_proj.weight            | same                                              |
| self_attention.linear_proj.weight                  | same                                              |
Dense MLA layers with TE: pre_mlp_layernorm is IdentityOp and the norm is mlp.linear_fc1.layer_norm_weight.

## MTP (deepseek_v3, mtp.layers.{k}.)
enorm.weight, hnorm.weight, eh_proj.weight, final_layernorm.weight: same in both; the inner
`mtp_model_layer.*` (megatron-core 0.19; `transformer_layer.*` in 0.16) follows the MoE-layer rows
above.

## Model level
embedding.word_embeddings.weight, decoder.final_layernorm.weight, output_layer.weight: same in both
(final norm is TENorm vs WrappedTorchNorm, both `.weight`).
"""
