"""What an SGLang engine start is refused for before `sglang.Engine(...)` spends 40-110 s starting schedulers that
would die at the first request (pure functions; docs/sglang-bundle-audit.md has the whole audit).

Failures found by reading SGLang 0.5.17 and the GPU bundle (/work/shared/device) (paths under sglang/srt/):
- An attention backend whose kernels the installed `sgl_kernel` lacks. The bundle drops `flash_ops` (FA3) and
  `flashmla_ops` to stay small (build-sglang-bundle.sh); `sgl_kernel/flash_attn.py:7-12` raises ImportError at the
  first attention call, which kills the scheduler (2026-11-30: the Qwen2.5-VL vision tower, whose Hopper default is
  "fa3", layers/attention/vision.py:1215-1230).
- A vision model without the Python packages SGLang's Qwen2.5-VL code imports and the bundle does not hold
  (torchvision and PIL: multimodal/processors/qwen_vl.py:9-11, in this process when the engine builds its
  processor; einops: layers/attention/vision.py:13, models/qwen2_5_vl.py:34, in the schedulers at model load). They
  come from the carried `.gpu-extra/` wheels (BUILD.md, "GPU").
- A rotary head size without SGLang's fused rope kernel: on CUDA only 64/128/256/512 take it
  (layers/rotary_embedding/base.py:103-124); other sizes go to a JIT fallback, and the schedulers died with head size
  32 (tiny Llama, /work/shared/device/README.md) and 16 (tiny Qwen2.5-VL, mtrain/tiny_vlm.py) on the H200.

And one that would not fail but compute another model: Qwen3-MoE with rope_scaling yarn under the fused QK-norm +
RoPE kernel (`enable_fused_qk_norm_rope`, off by default), which takes another yarn factor than config.json states.
"""
from __future__ import annotations

import difflib
import importlib.util
from pathlib import Path
from typing import Any, Iterable, Mapping

FUSED_ROPE_HEAD_SIZES = (64, 128, 256, 512)  # layers/rotary_embedding/base.py:103-124
# backend name -> the sgl_kernel extension its kernels live in (sgl_kernel/flash_attn.py:7-12: "fa3";
# sgl_kernel/flash_mla.py:6-9: "flashmla"). Backends served by Triton, flashinfer's JIT or common_ops are absent.
BACKEND_EXTENSIONS = {"fa3": "flash_ops", "flashmla": "flashmla_ops"}
ATTENTION_ARGS = ("attention_backend", "prefill_attention_backend", "decode_attention_backend",
                  "mm_attention_backend")
# what to use instead, for the error message (triton for the text backends)
SAFE_BACKEND = {"mm_attention_backend": "triton_attn"}


def sgl_kernel_extensions() -> set[str] | None:
    """Names of the compiled extensions in the installed sgl_kernel (`flash_ops`, `common_ops`, ...), found without
    importing it (its __init__ loads CUDA ops); None when sgl_kernel is not installed."""
    spec = importlib.util.find_spec("sgl_kernel")
    if spec is None or not spec.submodule_search_locations:
        return None
    return extensions_in(spec.submodule_search_locations)


def extensions_in(folders: Iterable[str]) -> set[str]:
    """Extension module names under the package folders (`flash_ops.abi3.so` -> flash_ops; sm90/common_ops too)."""
    return {p.name.split(".", 1)[0] for d in folders for p in Path(d).rglob("*.so")}


def missing_kernels(args: Mapping[str, Any], extensions: set[str] | None) -> list[str]:
    """One message per attention setting in `args` whose sgl_kernel extension is not installed. `extensions` None
    (sgl_kernel not found) checks nothing: the engine's own import fails first, with its own message."""
    if extensions is None:
        return []
    out = []
    for key in ATTENTION_ARGS:
        backend = args.get(key)
        ext = BACKEND_EXTENSIONS.get(backend) if isinstance(backend, str) else None
        if ext is not None and ext not in extensions:
            out.append(f"{key}={backend!r} needs sgl_kernel's {ext} extension, which this SGLang install lacks "
                       f"(the GPU bundle strips it): use {key}={SAFE_BACKEND.get(key, 'triton')!r}")
    return out


VISION_MODULES = ("torchvision", "PIL", "einops")


def missing_vision_modules(hf_config: Mapping[str, Any], modules: Iterable[str] = VISION_MODULES) -> list[str]:
    """The modules of `modules` that cannot be imported, when `hf_config` is a vision model's; [] otherwise."""
    if not isinstance(hf_config.get("vision_config"), Mapping):
        return []
    return [m for m in modules if importlib.util.find_spec(m) is None]


def rope_head_size(hf_config: Mapping[str, Any]) -> int | None:
    """The head size SGLang builds the language model's rotary embedding with: qk_rope_head_dim for MLA
    (DeepSeek), else head_dim or hidden_size / num_attention_heads (a VLM's text_config when nested)."""
    cfg = hf_config.get("text_config") if isinstance(hf_config.get("text_config"), Mapping) else hf_config
    if cfg.get("qk_rope_head_dim"):
        return int(cfg["qk_rope_head_dim"])
    if cfg.get("head_dim"):
        return int(cfg["head_dim"])
    if cfg.get("hidden_size") and cfg.get("num_attention_heads"):
        return int(cfg["hidden_size"]) // int(cfg["num_attention_heads"])
    return None


def rope_problem(hf_config: Mapping[str, Any]) -> str | None:
    """Refuses what was seen to fail, no more: head sizes below 64 without the fused kernel (16 and 32 crashed).
    Larger sizes outside FUSED_ROPE_HEAD_SIZES (80, 96, ...) take the same fallback but never ran here, so they are
    let through rather than refused on a guess."""
    size = rope_head_size(hf_config)
    if size is None or size in FUSED_ROPE_HEAD_SIZES or size > min(FUSED_ROPE_HEAD_SIZES):
        return None
    return (f"rotary head size {size} has no fused rope kernel in SGLang 0.5.17 (only {FUSED_ROPE_HEAD_SIZES}, "
            f"layers/rotary_embedding/base.py:103-124); its fallback crashed the schedulers on the H200 for head "
            f"sizes 16 and 32: give the model a head size of 64 or 128")


def fused_yarn_problem(args: Mapping[str, Any], hf_config: Mapping[str, Any]) -> str | None:
    """SGLang's fused QK-norm + RoPE kernel for Qwen3-MoE takes yarn's factor as max_position_embeddings /
    original_max_position_embeddings (models/qwen3_moe.py, compute_yarn_parameters), not the factor config.json
    states, with which transformers, Megatron-core and SGLang's own unfused path compute."""
    from mtrain.models.hf_rope import rope_of, yarn_original_length
    if not args.get("enable_fused_qk_norm_rope") or hf_config.get("model_type") != "qwen3_moe":
        return None
    _, scaling = rope_of(dict(hf_config))
    if scaling is None or scaling["rope_type"] != "yarn":
        return None
    context = hf_config.get("max_position_embeddings")
    if not context:
        return None
    original = yarn_original_length(hf_config, scaling, context)
    if not original or abs(float(context) / float(original) - float(scaling.get("factor") or 0)) < 1e-9:
        return None
    return (f"enable_fused_qk_norm_rope: SGLang's fused Qwen3-MoE kernel computes yarn with factor "
            f"max_position_embeddings / original_max_position_embeddings = {context}/{original}, not the "
            f"rope_scaling factor {scaling.get('factor')} the model has: leave it off")


def default_attention_backend(extensions: set[str] | None) -> str:
    """SGLang's own choice on Hopper ("fa3") where the installed sgl_kernel carries its kernels, else "triton"
    (the GPU bundle strips flash_ops; flashinfer would build its kernels with nvcc at the first start)."""
    return "fa3" if extensions is not None and BACKEND_EXTENSIONS["fa3"] in extensions else "triton"


def missing_model_keys(hf_config: Mapping[str, Any]) -> list[str]:
    """config.json keys SGLang 0.5.17 cannot start without: it picks its model class by `architectures[0]`
    (configs/model_config.py) and dies with "'NoneType' object is not subscriptable" when the key is absent."""
    archs = hf_config.get("architectures")
    if isinstance(archs, list) and archs and isinstance(archs[0], str):
        return []
    return ["config.json has no 'architectures' list, which SGLang reads to pick its model class (architectures[0]); "
            "add it (e.g. \"architectures\": [\"LlamaForCausalLM\"]) or write the directory with mtrain-convert, "
            "which fills it in"]


def unknown_server_args(names: Iterable[str], known: Iterable[str]) -> list[str]:
    """One message per name of engine.server_args that SGLang's ServerArgs lacks (sglang.Engine would raise a
    TypeError naming only the first, after mtrain had built the rest of the run); the closest known name when near."""
    known = set(known)
    out = []
    for name in names:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1, cutoff=0.75)
            out.append(f"engine.server_args: SGLang has no server argument {name!r}"
                       + (f"; did you mean {close[0]!r}?" if close else ""))
    return out


def preflight_problems(args: Mapping[str, Any], hf_config: Mapping[str, Any] | None,
                       extensions: set[str] | None) -> list[str]:
    """Everything that would make this engine start fail later; [] when none is known."""
    out = missing_kernels(args, extensions)
    if str(args.get("dtype")) == "float32":
        out.append("dtype float32: SGLang's RMSNorm kernel has no float32 path (it fails to dispatch Float at the "
                   "first request): use bfloat16 (engine.weight_dtype=bfloat16 or model.dtype=bfloat16)")
    if hf_config is not None:
        out += missing_model_keys(hf_config)
        missing = missing_vision_modules(hf_config)
        if missing:
            out.append(f"a vision model needs {', '.join(missing)} (SGLang's Qwen2.5-VL processor and vision tower "
                       f"import them; the GPU bundle lacks them): install or carry the .gpu-extra/ wheels")
        out += [p for p in (rope_problem(hf_config), fused_yarn_problem(args, hf_config)) if p]
    return out
