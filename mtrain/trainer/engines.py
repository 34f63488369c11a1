"""What the loop needs from outside the trainer: the tokenizer, the rollout engine, the initial weights."""
from __future__ import annotations

import math
import os
import time
from pathlib import Path

from mtrain.config_checks import lora_live_versions
from mtrain.layouts import model_layout
from mtrain.layouts.table import ModelLayout
from mtrain.models.lora import spec_of as lora_spec_of
from mtrain.trainer.publishers.lora import engine_lora_args
from mtrain.rollout.routing import routing_shape


def load_tokenizer(hf_dir: Path, hf_config: dict, max_pixels: int | None = None):
    """The model's HF tokenizer; a tiny random model without tokenizer files gets the character tokenizer. A vision
    model gets a VisionProcessor (its tokenizer + image processor, pixel budget `max_pixels` = data.max_pixels)."""
    from mtrain.data.vision import is_vision_config, load_vision_processor
    if is_vision_config(hf_config):
        return load_vision_processor(hf_dir, hf_config, max_pixels)
    from mtrain.tokenizer_files import tokenizer_files
    if tokenizer_files(hf_dir):  # the files preflight's check_tokenizer accepts: never a real model's char tokenizer
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(str(hf_dir))
    from mtrain.data.tiny_tokenizer import CharTokenizer
    return CharTokenizer(vocab_size=hf_config["vocab_size"])


def make_engine(cfg, hf_dir: Path, hf_config: dict, decisions, rank: int):
    """The engine of this rank's group (call on the group's leader): SGLang or the CPU reference engine, as decided
    once for the run (`mtrain.trainer.decisions`). Weights arrive by the first sync."""
    fp8 = decisions.engine_fp8  # block-FP8 engine (mtrain/rollout/fp8_engine.py)
    replay = cfg.algo.routing_replay == "rollout"  # engines record routed experts (docs/design-routing-replay.md)
    if decisions.engine_kind == "reference":
        from mtrain.rollout.reference_engine_bitwise import reference_engine_class
        dtype = decisions.engine_dtype
        lora = lora_spec_of(cfg)  # LoRA: the engine holds PEFT adapters next to the base (mtrain/trainer/publishers/lora.py)
        lora_args = engine_lora_args(model_layout(dict(hf_config, num_nextn_predict_layers=0), mtp=False), lora) if lora else None
        if fp8:  # FP8 base (quantized at every base sync), adapters in the engine's dtype on top
            from mtrain.rollout.fp8_engine import Fp8ReferenceEngine
            return Fp8ReferenceEngine(dict(hf_config, num_nextn_predict_layers=0), dtype=dtype, record_routing=replay,
                                      lora=lora_args, scaling=decisions.fp8_scaling)
        return reference_engine_class(cfg.numerics.on_policy)(dict(hf_config, num_nextn_predict_layers=0), dtype=dtype, record_routing=replay,
                               lora=lora_args)
    from mtrain.rollout.sglang_engine import SGLangEngine
    server_args = {"dtype": cfg.engine_dtype}  # the sync casts where it differs from the trainer's (weight_dtype)
    server_args.update(sglang_lora_args(cfg, hf_config))
    if fp8:
        from mtrain.rollout.fp8_engine import fp8_model_dir
        from mtrain.rollout.fp8_engine import server_args as fp8_server_args
        server_args.update(fp8_server_args(decisions.fp8_scaling))
        hf_dir = fp8_model_dir(str(hf_dir), hf_config, scaling=decisions.fp8_scaling)
    if cfg.engine.ep > 1:
        server_args["ep_size"] = cfg.engine.ep  # the layout tables' SGLangLayout(tp, ep) (docs/sglang-layout.md)
    server_args.update(production_server_args(cfg))
    if cfg.numerics.on_policy == "bitwise" and hf_config.get("num_experts"):
        # the bitwise MoE runs the experts its tokens chose (data-dependent shapes): no decode graph can hold that
        server_args["disable_cuda_graph"] = True
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    placement = decisions.groups.sglang_placement(rank, local_rank=local_rank,
                                                  dist_init_addr=engine_rendezvous(decisions.groups, rank))
    tp = placement.pop("tp_size")
    base_gpu_id = placement.pop("base_gpu_id")
    server_args.update(placement)  # nnodes / node_rank / dist_init_addr for an engine spanning nodes
    server_args.update(cfg.engine.server_args)  # the run's own additions (mtrain/engine_args.py refuses overlaps)
    # A start takes 40-110 s, more where kernels are built on first use, and the other ranks wait in silence: say so,
    # with the time it took (the H200 DeepSeek-V3 run's 4-minute start showed nothing in its log, results.md 32).
    graphs = (f"decode CUDA graphs up to batch {server_args['cuda_graph_max_bs_decode']}"
              if not server_args.get("disable_cuda_graph") else "no CUDA graphs")
    print(f"mtrain: rank {rank} starting an SGLang engine (tp={tp}, first GPU {base_gpu_id}, attention "
          f"{server_args['attention_backend']}, {graphs}{', fp32 lm head' if cfg.model.fp32_lm_head else ''})",
          flush=True)
    t0 = time.perf_counter()
    # Each engine gets its own seed: with one shared seed, unseeded requests would sample alike on every engine.
    engine = SGLangEngine(str(hf_dir), tp_size=tp, base_gpu_id=base_gpu_id,
                          mem_fraction_static=cfg.engine.mem_fraction_static, load_format="dummy",
                          random_seed=cfg.train.seed + decisions.groups.group_of(rank), server_args=server_args,
                          routing=routing_shape(hf_config) if replay else None, on_policy=cfg.numerics.on_policy)
    print(f"mtrain: rank {rank}'s SGLang engine started in {time.perf_counter() - t0:.1f} s; its first requests "
          f"compile Triton kernels on a fresh machine (about a minute, seen on an H200)", flush=True)
    return engine


def sglang_lora_args(cfg, hf_config: dict) -> dict:
    """model.lora on SGLang: its LoRA enabled for the adapter table's PEFT names, rank up to the run's; two pool slots
    (the active version and the previous one while requests still name it, mtrain/rollout/lora_adapters.py), under
    stream max_staleness + 1 (config_checks.lora_live_versions).
    engine.server_args may raise max_lora_rank / max_loras_per_batch (config_checks refuses a rank above it)."""
    lora = lora_spec_of(cfg)
    if lora is None:
        return {}
    args = engine_lora_args(model_layout(dict(hf_config, num_nextn_predict_layers=0), mtp=False), lora)
    return {"enable_lora": True, "max_lora_rank": lora.rank, "lora_target_modules": args["target_modules"],
            "max_loras_per_batch": lora_live_versions(cfg)}


def engine_concurrency(cfg) -> int:
    """Requests one engine runs at once in a training step: the groups it holds in flight x the group size."""
    r = cfg.rollout
    groups = r.prompts_per_step * (r.over_sample or 1.0) if r.partial else r.prompts_per_step
    return math.ceil(min(groups, r.max_groups_in_flight)) * r.samples_per_prompt


def production_server_args(cfg) -> dict:
    """The SGLang arguments the run's config decides for speed: decode CUDA graphs captured up to the batch the
    rollout runs (SGLang's own default stops at 256 at TP1 whatever the batch), the attention backend (SGLang's
    FlashAttention-3 where the installed sgl_kernel has it, else Triton: the GPU bundle strips FA3), and the
    float32 LM head."""
    from mtrain.rollout.sglang_preflight import default_attention_backend, sgl_kernel_extensions
    e = cfg.engine
    out = {"attention_backend": e.attention_backend or default_attention_backend(sgl_kernel_extensions()),
           "disable_cuda_graph": not e.cuda_graphs}
    if e.cuda_graphs:
        out["cuda_graph_max_bs_decode"] = e.cuda_graph_max_bs or -(-engine_concurrency(cfg) // 8) * 8
    if cfg.model.fp32_lm_head:
        out["enable_fp32_lm_head"] = True
    return out


def engine_rendezvous(groups, rank: int) -> str | None:
    """host:port where the parts of an engine spanning nodes meet (SGLang's dist_init_addr): the group leader's host,
    published in torchrun's store, and a port above torchrun's (MASTER_PORT + 1 + the leader's rank, distinct per
    engine). None when the engine fits one node."""
    if groups.nnodes == 1:
        return None
    import socket

    from mtrain.rollout.pool import default_store

    store, leader = default_store(), groups.leader(groups.group_of(rank))
    key = f"mtrain/engine/{leader}/rendezvous"
    if rank == leader:
        store.set(key, f"{socket.getfqdn()}:{int(os.environ['MASTER_PORT']) + 1 + leader}")
    return store.get(key).decode()  # blocks until the leader has published it


def weight_loader(cfg, layout: ModelLayout, rank: int):
    """A function that fills freshly built (unwrapped) model chunks: from HF safetensors or a dist checkpoint."""
    def load(chunks) -> None:
        if cfg.model.mcore_ckpt:
            from mtrain.models import load_model_checkpoint
            load_model_checkpoint(chunks, cfg.model.mcore_ckpt)
            return
        from mtrain.converters.safetensors_io import HFCheckpoint
        from mtrain.reshard.megatron_side import current_layout, load_hf_into_megatron
        ckpt = HFCheckpoint(cfg.model.hf_path)
        par = cfg.parallel
        load_hf_into_megatron(layout, chunks, ckpt.get, rank,
                              layout=current_layout(par.first_stage_layers, par.last_stage_layers))
    return load
