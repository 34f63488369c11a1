"""What a person sees when a run starts: each warning once, the known harmless ones silenced, a short summary.

`quiet_known_warnings(rank)` runs first thing in `mtrain train`:
* ranks other than 0 ignore Python warnings: every rank imports the same libraries and runs the same code, so
  their warnings are copies of rank 0's (errors still reach every rank's stderr);
* on rank 0, the warnings below are silenced, each with the reason it needs no action. Anything else is shown.
The full resolved config goes to RUN_DIR/config.yaml; `summary(cfg, ...)` is the few lines printed instead.
"""
from __future__ import annotations

import os
import warnings

# (message regex, category, why it needs no action)
KNOWN_HARMLESS: tuple[tuple[str, type[Warning], str], ...] = (
    # megatron-core announces at import that it uses its torch implementations (fused Adam, norms,
    # multi_tensor_*) when Transformer Engine / Apex are absent; mtrain supports running without them.
    (r"Transformer Engine and Apex are not installed", UserWarning, "optional accelerators"),
    (r"Apex is not installed", UserWarning, "optional accelerators"),
    # megatron-core 0.19's hyper_comm_grid (imported by its model code) logs through absl when absl-py is present
    # and through the standard logging module otherwise; mtrain reads neither, so absl-py is not needed.
    (r"absl\.logging is not installed", UserWarning, "megatron-core's optional logging backend"),
    # megatron-core 0.19 marks its multimodal MimoModelConfig experimental when that module is imported (its
    # optimizer package imports it); mtrain builds no MIMO model.
    (r"MimoModelConfig is experimental", UserWarning, "a megatron-core module mtrain does not use"),
    # TransformerConfig's own default cuda_graph_scope="full" triggers its deprecation notice (we set none).
    (r"full scope is deprecated", UserWarning, "megatron-core's default value"),
    # megatron-core's distributed optimizer calls these c10d names; nothing in mtrain does.
    (r"`torch.distributed.reduce_scatter_tensor` is deprecated", FutureWarning, "inside megatron-core"),
    (r"`torch.distributed.all_gather_into_tensor` is deprecated", FutureWarning, "inside megatron-core"),
    # megatron-core's zero_grad sets `.grad = None` on float32 main-parameter shards, which are views of the
    # model parameters (so not leaves); nothing reads that attribute. On CPU the warning names our CPU shim's
    # line because the shim forwards every torch call; with bf16 (separate fp32 copies) it does not occur.
    (r"The \.grad attribute of a Tensor that is not a leaf Tensor", UserWarning, "megatron-core zero_grad"),
)
# On CPU there are no CUDA streams: the advice about CUDA_DEVICE_MAX_CONNECTIONS is meaningless there.
CPU_ONLY_HARMLESS = ((r"When using async grad allreduce it is recommended to set the environment variable "
                      r"CUDA_DEVICE_MAX_CONNECTIONS", UserWarning, "no CUDA streams on CPU"),)


def quiet_known_warnings(rank: int | None = None, on_gpu: bool | None = None) -> None:
    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    if rank != 0:
        warnings.simplefilter("ignore")
        return
    if on_gpu is None:
        import torch
        on_gpu = torch.cuda.is_available()
    for message, category, _why in KNOWN_HARMLESS + (() if on_gpu else CPU_ONLY_HARMLESS):
        warnings.filterwarnings("ignore", message=message, category=category)


def summary(cfg, hf_config: dict, world: int, train_ranks: int | None = None) -> str:
    """Four lines: model, layout, algorithm and batch, where the full config and metrics go. train_ranks: the ranks
    that train (separate placement: fewer than world; mtrain.job_split.train_world)."""
    p, r, t = cfg.parallel, cfg.rollout, cfg.train
    dp = (world if train_ranks is None else train_ranks) // (p.tp * p.pp * p.cp)
    src = cfg.model.mcore_ckpt or cfg.model.hf_path
    data = cfg.data.train_path or f"task {cfg.data.task}"
    engine = cfg.engine.kind
    if engine == "auto":
        import torch
        engine = "sglang" if torch.cuda.is_available() else "reference"
    # a vision-language config (Qwen2.5-VL) keeps the language model's sizes under text_config
    text = {**(hf_config.get("text_config") or {}), **hf_config}
    return "\n".join([
        f"mtrain: model {hf_config.get('model_type', '?')} ({text.get('num_hidden_layers', '?')} layers, hidden "
        f"{text.get('hidden_size', '?')}) from {src}, {cfg.model.dtype}",
        f"mtrain: {world} rank(s): tp={p.tp} pp={p.pp} ep={p.ep} cp={p.cp} dp={dp}; engine {engine} "
        f"tp={cfg.engine.tp}",
        f"mtrain: {cfg.algo.name}, {t.steps} steps x {r.prompts_per_step} prompts x {r.samples_per_prompt} samples "
        f"from {data}, lr {cfg.optim.lr:g}" + _lora_text(cfg.model.lora),
        f"mtrain: run dir {t.run_dir} (full config: config.yaml, metrics: metrics.jsonl)",
    ])


def _lora_text(lo) -> str:
    """model.lora in the start-of-run summary: what trains, and at which learning rate."""
    if not lo.targets:
        return ""
    lr = f", adapter lr {lo.lr:g}" if lo.lr is not None else ""
    return f"; LoRA r={lo.rank} alpha={lo.alpha:g} on {','.join(lo.targets)}{lr} (base frozen)"

