"""How mtrain's requests, settings and weight buckets are spelled for SGLang 0.5.17 (pure functions).

Kept apart from `sglang_engine.py` (the engine's life cycle and threading) so they can be tested without a GPU.
Facts with file:line are in docs/sglang-layout.md.
"""
from __future__ import annotations

import json
import logging
from typing import Any, Mapping, Sequence

import torch

from mtrain.rollout.protocol import Completion, EngineError, Request, SamplingParams, routed_start_error
from mtrain.rollout.sglang_loader import DUMP_PARAMS, LOAD_DIRECT
from mtrain.rollout.sglang_taps import TAP_ACTIVATIONS

logger = logging.getLogger("mtrain.rollout.sglang_engine")

_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}


def _launch_sigquit_handler(signum: int, frame: Any) -> None:
    """Replaces SGLang's launch-phase handler, which kills the whole process tree (engine.py:1649-1655).

    Module-level so it pickles by name into the scheduler processes with the server args. A scheduler that
    fails during start also makes `sglang.Engine(...)` raise, which becomes an EngineError.
    """
    logger.error("SGLang: a child process failed during engine start (SIGQUIT)")


# numerics.on_policy=bitwise: SGLang serves the model through mtrain's own classes (mtrain/rollout/sglang_models/),
# registered by SGLang's external-model extension point and picked by an architecture override.
BITWISE_MODEL_PACKAGE = "mtrain.rollout.sglang_models"
BITWISE_SERVED = ("LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")


def bitwise_architecture(architecture: str) -> str:
    """The class name mtrain's bitwise model for an HF architecture has (sglang_models/bitwise.py)."""
    if architecture not in BITWISE_SERVED:
        raise EngineError(f"numerics.on_policy=bitwise on SGLang serves {', '.join(BITWISE_SERVED)}; this model is "
                          f"{architecture}")
    return "MtrainBitwise" + architecture


def engine_server_args(
    model_path: str,
    *,
    tp_size: int,
    mem_fraction_static: float,
    base_gpu_id: int,
    load_format: str,
    random_seed: int,
    deterministic: bool = False,
    extra: Mapping[str, Any] | None = None,
    routed_experts: bool = False,
    architecture_override: str | None = None,
) -> dict[str, Any]:
    """The `sglang.Engine(**kwargs)` an mtrain engine starts with (names checked against server_args.py).
    architecture_override: the model class SGLang builds instead of config.json's (numerics.on_policy=bitwise)."""
    args: dict[str, Any] = dict(
        model_path=model_path,
        tp_size=tp_size,
        skip_tokenizer_init=True,  # token ids in, token ids out
        enable_memory_saver=True,  # release/resume by tags
        attention_backend="triton",
        # The vision tower's attention (Qwen2.5-VL): on Hopper SGLang picks "fa3" (layers/attention/vision.py:
        # 1215-1230), which needs sgl_kernel's flash_ops; the device bundle has none, and the H200 run died on the
        # first image (2026-11-30). Its Triton kernel needs nothing beyond triton. Text-only models never read it.
        mm_attention_backend="triton_attn",
        sampling_backend="pytorch",  # flashinfer's sampler asserts when a sampling seed is set (sampler.py:267-269)
        grammar_backend="none",
        mem_fraction_static=mem_fraction_static,
        cuda_graph_backend_prefill="disabled",  # prefill graph capture is most of a 40-110 s start
        # Decode graph capture took 83 s of a 129 s start on the H200 (2026-11-29); tests and benchmarks turn it
        # off, long runs turn it back on with engine.server_args.disable_cuda_graph=false.
        disable_cuda_graph=True,
        load_format=load_format,
        custom_weight_loader=[LOAD_DIRECT, DUMP_PARAMS, TAP_ACTIVATIONS],
        # The direct loader writes w13_weight as [gate; up] in [E, 2I, H]: that is the triton runner's layout.
        # flashinfer_trtllm ("auto" on Blackwell) stores [up; gate] re-blocked, triton_kernel transposes.
        moe_runner_backend="triton",
        # DeepSeek-V3 (256 routed + 1 shared expert) would fuse the shared expert into FusedMoE as expert 256
        # on an H200; the layout tables keep it as mlp.shared_experts.* (deepseek_v2.py:2974-3044).
        disable_shared_experts_fusion=True,
        # SGLang auto-enables FlashInfer's all-reduce fusion at TP > 1 on Hopper for DeepSeek-V3, Qwen3-MoE and a
        # few more architectures (arg_groups/overrides.py:1863-1906); the first start then builds flashinfer's
        # trtllm_comm module with nvcc. On 2 x H200 that build took about 4 of a DeepSeek-V3 engine's 4.5-minute
        # start, twice (docs/results.md section 32). A fresh node or container has no flashinfer cache, so every
        # job would pay it. Runs with a warm cache can turn it back on:
        # engine.server_args.enforce_disable_flashinfer_allreduce_fusion=false.
        enforce_disable_flashinfer_allreduce_fusion=True,
        base_gpu_id=base_gpu_id,
        weight_version="0",
        random_seed=random_seed,
        # Per-request sampling seeds only take effect with deterministic inference (batch-invariant kernels);
        # without it sampling uses the global torch RNG (sampling_batch_info.py:118-132).
        enable_deterministic_inference=deterministic,
        custom_sigquit_handler=_launch_sigquit_handler,
        log_level="error",
    )
    if architecture_override:
        args["json_model_override_args"] = json.dumps({"architectures": [architecture_override]})
    if routed_experts:  # routing replay: requests may then ask for meta_info["routed_experts"] (server_args.py:3364)
        args["enable_return_routed_experts"] = True
    for k, v in (extra or {}).items():
        if k == "incremental_streaming_output" and v:
            raise EngineError("server_args incremental_streaming_output=True is not supported: mtrain's streaming "
                              "(mtrain/rollout/sglang_stream.py) reads SGLang's default cumulative stream chunks")
        if k == "custom_weight_loader":
            args[k] = list(args[k]) + [x for x in v if x not in args[k]]
        elif k == "json_model_override_args" and architecture_override:  # the run's overrides, and mtrain's class
            theirs = json.loads(v) if isinstance(v, str) else dict(v)
            args[k] = json.dumps({**theirs, "architectures": [architecture_override]})
        else:
            args[k] = v
    return args


def _marker_tensor() -> torch.Tensor:
    # SGLang's patched tensor reduction (patch_torch.py) only handles CUDA storages: a CPU tensor fails to
    # serialize (seen on the H200, 2026-11-29). Control messages carry an empty CUDA tensor.
    return torch.empty(0, device="cuda")


def to_sglang_sampling(params: SamplingParams, seed: int) -> dict[str, Any]:
    """Our SamplingParams as SGLang's sampling_params dict. Temperature 0 is SGLang's greedy too
    (sampling_params.py:144-147: temperature 1, top_k 1, logprobs = log_softmax(logits)).

    SGLang always stops at the model's EOS ids (config.json + generation_config.json) besides stop_token_ids;
    `ignore_eos` turns off both (schedule_batch.py:1446-1457). So: no stop ids -> ignore_eos, only the length
    limit stops (the protocol's meaning); with stop ids, EOS stops too -- put the EOS ids in stop_token_ids.
    """
    out: dict[str, Any] = {
        "max_new_tokens": params.max_new_tokens,
        "temperature": float(params.temperature),
        "top_p": float(params.top_p),
        "top_k": params.top_k,
        "sampling_seed": seed,
    }
    if params.stop_token_ids:
        out["stop_token_ids"] = list(params.stop_token_ids)
    else:
        out["ignore_eos"] = True
    return out


def sglang_image_data(req: Request) -> list[dict[str, Any]] | None:
    """A request's images as SGLang 0.5.17 takes them with token ids (skip_tokenizer_init): ONE item holding every
    image's processor output, so SGLang keeps our expanded ids and never re-runs the HF processor.

    Source (sglang/srt/, 0.5.17):
    - multimodal/processors/base_processor.py:899-923 (load_mm_data): when the prompt is a list of ids and every
      item is preprocessed, the ids are returned as given (no decode + re-tokenize, which may not round-trip);
      a raw image instead takes the decode path (926-957 -> legacy_load_mm_data, 1077+).
    - base_processor.py:679-705: an item is preprocessed when its "format" is "processor_output".
    - base_processor.py:834-855 (_validate_one_modality): such an item must be the only one in image_data.
    - base_processor.py:1227-1315 (collect_mm_items_from_processor_output): keys map to the image modality by name
      (ATTR_NAME_TO_MODALITY, 300-302: pixel_values, image_grid_thw); pixel_values becomes the item's feature.
    - base_processor.py:1599-1609 + 1203-1216: offsets = runs of image_token_id in our ids; managers/mm_utils.py:
      1733-1800 (get_new_expanded_mm_items) splits the item per image by prod(image_grid_thw) patches -- so each
      image's run must be exactly its t*h*w / merge^2 tokens (VisionInputs.check_ids).
    - multimodal/processors/qwen_vl.py:835-854: mRoPE positions from our expanded ids and the grids
      (MRotaryEmbedding.get_rope_index); models/qwen2_5_vl.py:671-676 casts pixel_values to the tower's dtype.
    - managers/tokenizer_manager.py:466-489: the multimodal processor exists even with skip_tokenizer_init, built
      from the model folder's HF processor (3702-3730): the folder needs its processor files.
    """
    if req.vision is None:
        return None
    from mtrain.data.vision import VisionError, VisionInputs
    if not isinstance(req.vision, VisionInputs):
        raise EngineError(f"request {req.rid!r}: vision must be a VisionInputs, got {type(req.vision).__name__}")
    try:
        req.vision.check_ids(req.prompt_ids, what=f"request {req.rid!r}")
    except VisionError as e:
        raise EngineError(str(e)) from None
    return [{"format": "processor_output", "pixel_values": req.vision.pixel_values,
             "image_grid_thw": req.vision.image_grid_thw}]


def routing_request_args(req: Request, routing) -> dict[str, Any]:
    """The `Engine.async_generate` keywords that ask for a request's routed experts (io_struct.py:230-235,
    engine.py:373-374): none when the engine records no routing (`routing` None); otherwise every row from the
    request's `routed_experts_start` on (`routed_experts_start_len`, which SGLang requires in [0, prompt_len] and
    aborts the request otherwise: we refuse it here first, with our message)."""
    if routing is None:
        return {}
    bad = routed_start_error(req)
    if bad:
        raise EngineError(bad)
    return {"return_routed_experts": True, "routed_experts_start_len": int(req.routed_experts_start)}


def completion_from_output(req: Request, out: Mapping[str, Any], default_version: int, routing=None) -> Completion:
    """One SGLang generate output (tokenizer_manager.py:2214-2380) as a Completion.

    routing: the model's `mtrain.rollout.routing.RoutingShape` when the engine returns routed experts
    (`enable_return_routed_experts`): `meta_info["routed_experts"]` (base64 int32 [prompt + output - 1 - start, L, k],
    start = the request's `routed_experts_start`; SGLANG-NEXT.md question 1) is decoded into the stored dtype and its
    row count checked against that start; the Completion says where its rows start. A finished request without it
    is an error (the server flag is missing)."""
    meta = out.get("meta_info", {})
    output_ids = [int(t) for t in out.get("output_ids", [])]
    entries = meta.get("output_token_logprobs") or []
    logprobs = [float(e[0]) for e in entries]
    if len(logprobs) != len(output_ids):
        raise EngineError(f"request {req.rid!r}: SGLang returned {len(output_ids)} output ids but "
                          f"{len(logprobs)} logprobs")
    for i, e in enumerate(entries):
        if int(e[1]) != output_ids[i]:
            raise EngineError(f"request {req.rid!r}: logprob {i} is for token {e[1]}, output has {output_ids[i]}")
    reason = meta.get("finish_reason")
    kind = reason.get("type") if isinstance(reason, dict) else reason
    if kind not in _FINISH:
        raise EngineError(f"request {req.rid!r}: unexpected SGLang finish_reason {reason!r}")
    version = meta.get("weight_version", default_version)
    try:
        version = int(version)
    except (TypeError, ValueError):
        raise EngineError(f"request {req.rid!r}: weight_version {version!r} is not an int") from None
    routed, start = None, 0
    if routing is not None:
        from mtrain.rollout.routing import RoutingError, decode_sglang, routed_rows
        start = req.routed_experts_start
        payload = meta.get("routed_experts")
        if payload is None and _FINISH[kind] != "abort":
            raise EngineError(f"request {req.rid!r}: SGLang returned no routed experts (server started without "
                              f"enable_return_routed_experts?)")
        if payload is not None:
            try:
                routed = decode_sglang(payload, routing, routed_rows(len(req.prompt_ids), len(output_ids), start),
                                       f"request {req.rid!r} (routed_experts_start_len {start})")
            except RoutingError as e:
                raise EngineError(str(e)) from None
    return Completion(rid=req.rid, prompt_ids=list(req.prompt_ids), output_ids=output_ids, logprobs=logprobs,
                      finish_reason=_FINISH[kind], weight_version=version, vision=req.vision,
                      top_logprobs=top_logprobs_from_meta(req, meta, len(output_ids)), routed_experts=routed,
                      routed_experts_start=start)


def top_logprobs_from_meta(req: Request, meta: Mapping[str, Any], n_tokens: int) -> list | None:
    """`meta_info["output_top_logprobs"]` (per position a list of (logprob, token_id, text) tuples; SGLANG-APIS.md
    section 6) as the protocol's [(token, logprob), ...] per output token, most likely first."""
    k = req.params.top_logprobs
    if not k:
        return None
    rows = meta.get("output_top_logprobs") or []
    if len(rows) != n_tokens or any(row is None or len(row) < k for row in rows):
        raise EngineError(f"request {req.rid!r}: asked for {k} top logprobs per token, SGLang returned "
                          f"{len(rows)} rows for {n_tokens} tokens (or a row with fewer than {k})")
    from mtrain.rollout.sglang_stream import top_row
    return [top_row(row, k) for row in rows]


def serialize_bucket(named_tensors: Sequence[tuple[str, torch.Tensor]]) -> bytes:
    """One engine rank's bucket as the bytes SGLang deserializes (CUDA tensors travel as IPC handles).

    Call it in the process that owns the tensors; the bytes can then be gathered to the process that owns
    the engine (update_weights_serialized). The tensors must stay alive and unmodified until that call returns.
    """
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

    # Device by UUID instead of index, as SGLang's receiving side expects (utils/patch_torch.py:41-90).
    monkey_patch_torch_reductions()
    for entry in named_tensors:
        if not (isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[0], str)
                and isinstance(entry[1], torch.Tensor)):
            raise EngineError(f"update_weights: entries must be (str, torch.Tensor), got {entry!r:.80}")
    return MultiprocessingSerializer.serialize([(n, t.detach()) for n, t in named_tensors])
