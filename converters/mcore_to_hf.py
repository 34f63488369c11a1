"""mcore-to-hf: a Megatron-core dist checkpoint (any layout it was saved at) -> a HF safetensors checkpoint.

One process: Megatron reshards on load, so the checkpoint is loaded into a TP1/PP1/EP1 model
(`dist_checkpointing.load` with that model's sharded state dict), then the planner maps Megatron's tensors to
HF's (MegatronLayout() -> HFLayout(), names and fusions from the layout tables) and the executor streams them,
bucket by bucket, into a ShardedWriter that publishes the directory atomically. A half-written dist
checkpoint (no metadata.json/.metadata, a missing or short shard file) is refused up front.
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

from .mcore_io import (build_and_load, chunks_device, check_dist_checkpoint, checkpoint_facts, config_dtype, copy_side_files,
                       dtype_name, layout_for, rank_error, refuse_lora_checkpoint, run_ranks)
from .hf_config_file import complete_config_file
from .output_dir import check_output_dir
from .safetensors_io import ShardedWriter


@rank_error
def export_rank(rank: int, world: int, job: dict) -> int:
    """Load at TP1 and stream every HF tensor into the writer; returns the bytes written."""
    from tqdm import tqdm

    from mtrain.dist import init_distributed
    from mtrain.reshard.executor import Executor
    from mtrain.reshard.megatron_side import tensor_lookup
    from mtrain.reshard.placement import HFLayout, MegatronLayout
    from mtrain.reshard.planner import build_plan

    init_distributed()
    cfg, mtp, dtype = job["cfg"], job["mtp"], getattr(torch, job["dtype"])
    chunks = build_and_load(cfg, mtp, dtype, job["mcore"])
    plan = build_plan(layout_for(cfg, mtp), MegatronLayout(), HFLayout())
    src = tensor_lookup(chunks)
    executor = Executor(plan, 0, lambda ref: src(ref).detach(), dtype=dtype, backend="torch",
                        bucket_bytes=job["bucket_bytes"], device=chunks_device(chunks))
    writer = ShardedWriter(job["out"], max_shard_bytes=job["shard_bytes"], overwrite=job["overwrite"])
    try:
        with torch.no_grad():
            for bucket in tqdm(executor.stream(), total=len(executor.buckets), desc="mcore-to-hf", unit="bucket"):
                for name, tensor in bucket.get(0, []):
                    writer.add(name, tensor.to("cpu", copy=True))  # the executor reuses its buffer for the next bucket
        copy_side_files(Path(job["side_files"]), writer.path)
        set_config_dtype(writer.path / "config.json", dtype)
        complete_config_file(writer.path / "config.json")
        writer.commit()
    except BaseException:
        writer.abort()
        raise
    return writer.total_size


def set_config_dtype(config_file: Path, dtype: torch.dtype) -> None:
    """The written tensors' dtype in config.json (hf-to-mcore --dtype may have changed it from the source's),
    and no quantization_config: the tensors written are plain (an FP8 release was dequantised on the way in),
    and transformers would otherwise try to load them as FP8."""
    if not config_file.is_file():
        return
    cfg = json.loads(config_file.read_text())
    if config_dtype(cfg) != dtype or "quantization_config" in cfg:
        keys = [k for k in ("dtype", "torch_dtype") if k in cfg] or ["dtype"]
        cfg.update({k: dtype_name(dtype) for k in keys})
        cfg.pop("quantization_config", None)
        config_file.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def mcore_to_hf(mcore_dir: str | os.PathLike, out_dir: str | os.PathLike, *, hf_config_dir=None,
                overwrite: bool = False, max_shard_bytes: int = 5 * 1024**3, bucket_bytes: int = 256 << 20) -> Path:
    mcore_dir = Path(mcore_dir)
    out = check_output_dir(out_dir, overwrite)
    hf_config_dir = Path(hf_config_dir) if hf_config_dir else None
    check_dist_checkpoint(mcore_dir, need_config=hf_config_dir is None)
    refuse_lora_checkpoint(mcore_dir, "mcore-to-hf")
    cfg, mtp, dtype = checkpoint_facts(mcore_dir, hf_config_dir)
    layout_for(cfg, mtp)  # an unsupported model fails here, not in the spawned process
    job = dict(cfg=cfg, mtp=mtp, dtype=dtype_name(dtype), mcore=str(mcore_dir), out=str(out), overwrite=overwrite,
               side_files=str(hf_config_dir or mcore_dir), shard_bytes=max_shard_bytes, bucket_bytes=bucket_bytes)
    run_ranks(export_rank, 1, job)
    return out


def run(args: argparse.Namespace) -> int:
    out = mcore_to_hf(args.mcore, args.out, hf_config_dir=args.hf_config, overwrite=args.force)
    print(f"wrote HF checkpoint {out}")
    return 0
