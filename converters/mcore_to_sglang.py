"""mcore-to-sglang: a Megatron dist checkpoint -> one `rank{r}.safetensors` per SGLang engine rank.

Each file holds SGLang's internal parameter names with that rank's shapes (`qkv_proj`, `gate_up_proj`,
FusedMoE's stacked `w13_weight`/`w2_weight`, padded vocab-parallel embedding and head, ...): what
`load_format="direct"`-style loading or `update_weights_from_tensor` with our loader copies without any
renaming or slicing. The checkpoint is loaded at TP1 in one process (Megatron reshards on load), the planner
maps MegatronLayout() -> SGLangLayout(tp, ep), and the engine ranks are written one after another, so memory
is the TP1 model plus one engine rank's shard. MTP layers have no SGLang side (SGLang's draft model loads
them separately) and are not written.
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

from .mcore_io import (build_and_load, chunks_device, check_dist_checkpoint, checkpoint_facts, copy_side_files, dtype_name,
                       layout_for, rank_error, refuse_lora_checkpoint, run_ranks)
from .output_dir import AtomicDir


def rank_file(rank: int) -> str:
    return f"rank{rank}.safetensors"


def _only_rank(plan, r: int):
    """The part of `plan` that writes engine rank r, all of it executed by this one process."""
    from mtrain.reshard.planner import Plan
    pieces = [p for p in plan.pieces if p.dst.rank == r]
    dst = {k: v for k, v in plan.dst_tensors.items() if k[0] == r}
    return Plan(pieces, dst, plan.src_tensors, {r: 0}, {k for k in plan.fp32 if k[0] == r})


@rank_error
def export_rank(rank: int, world: int, job: dict) -> list[int]:
    """Load at TP1, then write every engine rank's file; returns bytes per engine rank."""
    from safetensors.torch import save_file
    from tqdm import tqdm

    from mtrain.dist import init_distributed
    from mtrain.reshard.executor import Executor
    from mtrain.reshard.megatron_side import tensor_lookup
    from mtrain.reshard.placement import MegatronLayout, SGLangLayout
    from mtrain.reshard.planner import build_plan

    init_distributed()
    cfg, mtp, dtype = job["cfg"], job["mtp"], getattr(torch, job["dtype"])
    chunks = build_and_load(cfg, mtp, dtype, job["mcore"])
    plan = build_plan(layout_for(cfg, mtp), MegatronLayout(), SGLangLayout(job["tp"], job["ep"]),
                      colocate=lambda r: 0)
    src = tensor_lookup(chunks)
    sizes = []
    for r in tqdm(range(job["tp"]), desc="mcore-to-sglang", unit="engine rank"):
        executor = Executor(_only_rank(plan, r), 0, lambda ref: src(ref).detach(), dtype=dtype, backend="torch",
                            bucket_bytes=job["bucket_bytes"], device=chunks_device(chunks))
        tensors: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for bucket in executor.stream():
                for name, t in bucket.get(r, []):
                    tensors[name] = t.to("cpu", copy=True)  # the executor reuses its buffer for the next bucket
        save_file(tensors, str(Path(job["out"]) / rank_file(r)), metadata={"format": "pt", "engine_rank": str(r),
                                                                          "engine_tp": str(job["tp"]),
                                                                          "engine_ep": str(job["ep"])})
        sizes.append(sum(t.numel() * t.element_size() for t in tensors.values()))
        del tensors
    return sizes


def mcore_to_sglang(mcore_dir: str | os.PathLike, out_dir: str | os.PathLike, *, engine_tp: int, engine_ep: int = 1,
                    overwrite: bool = False, bucket_bytes: int = 256 << 20) -> Path:
    from mtrain.layouts import LayoutError
    from mtrain.reshard.placement import MegatronLayout, SGLangLayout
    from mtrain.reshard.planner import build_plan

    from .mcore_io import ParallelSizeError

    mcore_dir = Path(mcore_dir)
    staging = AtomicDir(out_dir, overwrite)
    try:
        check_dist_checkpoint(mcore_dir)
        refuse_lora_checkpoint(mcore_dir, "mcore-to-sglang")
        cfg, mtp, dtype = checkpoint_facts(mcore_dir, None)
        model = layout_for(cfg, mtp)
        try:
            # the plan alone (no Megatron process) says whether heads, experts and vocab fit the engine
            build_plan(model, MegatronLayout(), SGLangLayout(engine_tp, engine_ep), colocate=lambda r: 0)
        except LayoutError as e:
            raise ParallelSizeError(f"engine tp={engine_tp} ep={engine_ep}: {e}") from e
        job = dict(cfg=cfg, mtp=mtp, dtype=dtype_name(dtype), mcore=str(mcore_dir), out=str(staging.path),
                   tp=engine_tp, ep=engine_ep, bucket_bytes=bucket_bytes)
        run_ranks(export_rank, 1, job)
        copy_side_files(mcore_dir, staging.path)
    except BaseException:
        staging.abort()
        raise
    return staging.commit()


def run(args: argparse.Namespace) -> int:
    out = mcore_to_sglang(args.mcore, args.out, engine_tp=args.engine_tp, engine_ep=args.engine_ep,
                          overwrite=args.force)
    print(f"wrote SGLang engine-rank shards ({args.engine_tp} ranks) to {out}")
    return 0
