"""hf-to-mcore: a HF safetensors checkpoint -> a Megatron-core dist checkpoint (torch_dist) at a chosen layout.

Everything that can be wrong with the input is checked in this process before any rank starts: corrupt files
(HFCheckpoint reads every header), tensors missing or unexpected against the layout table, shapes, integer
tensors, parallel sizes that do not fit (the planner), MTP copies of the embedding/head that differ from the
main ones, an output that already holds a checkpoint. Then world = tp*pp*dp ranks are spawned here (gloo on
CPU, `mtrain.dist.run_on_ranks`); each builds its Megatron chunk(s), reads only the HF tensors its shards need
(the plan's pieces for that rank, one bucket at a time), and all save one dist checkpoint into a temp dir that
becomes --out only when everything is written.

On a GPU box, and for any model too big for one host's spawned CPU ranks, launch the same command under
torchrun (`torchrun --nproc-per-node 8 -m mtrain.converters hf-to-mcore ... --tp 8`): when torchrun's
variables are set, every launched process converts its own rank in place (nccl on GPU) and nothing is
spawned; the world may then be any multiple of tp*pp (the rest is data parallel, as in training).

MTP: when the config announces MTP layers and the checkpoint carries them (the DeepSeek-V3 release does), the
Megatron model is built with MTP and they are converted; when the checkpoint has none of them (transformers'
save_pretrained drops them), the model is built without MTP. mtrain_meta.json records which.
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

from .errors import CheckpointError
from .fp8 import check_fp8_headers, dequantized_view, is_fp8_checkpoint, weight_block_size
from .mcore_io import (StageSplit, check_against_table, config_dtype, copy_side_files, dtype_name, hf_has_mtp, layout_for,
                       megatron_layout, model_config, rank_error, run_ranks, stage_split_overrides, tied_copies,
                       write_meta)
from .output_dir import AtomicDir
from .safetensors_io import HFCheckpoint


def hf_getters(ckpt: HFCheckpoint, out_dtype: torch.dtype) -> dict:
    """name -> getter over the checkpoint, FP8 block-scaled weights dequantised (scales dropped)."""
    getters = {n: (lambda n=n: ckpt.get(n)) for n in ckpt.names()}
    if is_fp8_checkpoint(getters):
        getters = dequantized_view(getters, block=weight_block_size(ckpt.config), out_dtype=out_dtype)
    return getters


def check_input(hf_dir: Path, tp: int, pp: int, ep: int, etp: int | None, split: StageSplit = StageSplit()):
    """All checks that need no Megatron process. Returns (checkpoint, config, mtp, model table, layout)."""
    ckpt = HFCheckpoint(hf_dir)  # every header read: a truncated shard fails here
    cfg = ckpt.config
    if is_fp8_checkpoint(ckpt.names()):
        try:
            check_fp8_headers({n: ckpt.shape(n) for n in ckpt.names()}, {n: ckpt.dtype(n) for n in ckpt.names()},
                              weight_block_size(cfg))
        except ValueError as e:  # a malformed quantization_config.weight_block_size
            raise CheckpointError(f"{hf_dir}: {e}") from e
    names = [n for n in hf_getters(ckpt, torch.float32)]  # the FP8 view's names (no *_scale_inv)
    mtp = hf_has_mtp(cfg, names)
    model = layout_for(cfg, mtp)
    check_against_table(model, {n: ckpt.shape(n) for n in names}, {n: ckpt.dtype(n) for n in names}, str(hf_dir))
    layout, _ = megatron_layout(model, tp, pp, ep, etp, split=split)
    getters = hf_getters(ckpt, torch.float32)
    for copy, original in tied_copies(model):
        # Megatron keeps one embedding (and head) shared with the MTP layers: differing copies would be lost.
        if not torch.equal(getters[copy](), getters[original]()):
            raise CheckpointError(f"{hf_dir}: tensor '{copy}' differs from '{original}'; Megatron shares one "
                                  "tensor for both, so this checkpoint cannot be converted without losing one")
    return ckpt, cfg, mtp, model, layout


@rank_error
def convert_rank(rank: int, world: int, job: dict) -> int:
    """One rank: build its chunks, fill them from the HF files through the planner, save its shards.
    Returns the bytes of HF tensors this rank read."""
    from megatron.core import dist_checkpointing
    from tqdm import tqdm

    from mtrain.dist import init_distributed
    from mtrain.models import build_model, model_sharded_state_dict
    from mtrain.reshard.megatron_side import load_hf_into_megatron
    from mtrain.reshard.placement import HFLayout, MegatronLayout
    from mtrain.reshard.planner import build_plan

    layout: MegatronLayout = job["layout"]
    init_distributed(tp=layout.tp, pp=layout.pp, ep=layout.ep, etp=layout.etp)
    dtype = getattr(torch, job["dtype"])
    ckpt = HFCheckpoint(job["hf"])
    getters = hf_getters(ckpt, dtype)
    model = layout_for(ckpt.config, job["mtp"])
    chunks, _ = build_model(model_config(ckpt.config, job["mtp"]), params_dtype=dtype,
                            config_overrides=stage_split_overrides(layout))

    plan = build_plan(model, HFLayout(), layout)
    # the HF tensors this rank reads: sources of the pieces it writes (for the progress bar's total)
    mine = {p.src.name for p in plan.pieces if p.src is not None and plan.owner.get(p.dst.rank, p.dst.rank) == rank}
    bar = tqdm(total=len(mine), desc=f"hf-to-mcore rank {rank}/{world}", unit="tensor", disable=rank != 0)
    read = 0

    def hf_get(name: str) -> torch.Tensor:
        nonlocal read
        t = getters[name]()
        read += t.numel() * t.element_size()
        bar.update(1)
        return t

    load_hf_into_megatron(model, chunks, hf_get, rank, layout)
    bar.close()
    dist_checkpointing.save(model_sharded_state_dict(chunks), job["out"])
    return read


def _finish(staging: AtomicDir, hf_dir: Path, ckpt: HFCheckpoint, model, layout, dtype, read: list) -> None:
    copy_side_files(hf_dir, staging.path)
    write_meta(staging.path, source=str(hf_dir.resolve()), format="torch_dist", dtype=dtype_name(dtype),
               mtp_layers=model.mtp_layers, arch=model.arch, hf_bytes=ckpt.total_bytes(), rank_bytes_read=read,
               layout=dict(tp=layout.tp, pp=layout.pp, ep=layout.ep, etp=layout.expert_tp, dp=layout.dp,
                           first_stage_layers=layout.first_stage_layers, last_stage_layers=layout.last_stage_layers))


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ and "RANK" in os.environ


def hf_to_mcore(hf_dir: str | os.PathLike, out_dir: str | os.PathLike, *, tp: int = 1, pp: int = 1, ep: int = 1,
                etp: int | None = None, dtype: torch.dtype | None = None, overwrite: bool = False,
                first_stage_layers: int | None = None, last_stage_layers: int | None = None) -> Path:
    """first/last_stage_layers: the uneven pipeline split (parallel.first_stage_layers/last_stage_layers), e.g.
    DeepSeek-V3's 61 layers on pp=16 as 3 | 4 x 14 | 2. The checkpoint itself holds global layer numbers: any
    later layout (training's, verify's, the exporters' TP1) loads it."""
    hf_dir = Path(hf_dir)
    split = StageSplit(first_stage_layers, last_stage_layers)
    if under_torchrun():
        return _hf_to_mcore_torchrun(hf_dir, Path(out_dir), tp, pp, ep, etp, dtype, overwrite, split)
    staging = AtomicDir(out_dir, overwrite)  # refuses an existing checkpoint before any slow work
    try:
        ckpt, cfg, mtp, model, layout = check_input(hf_dir, tp, pp, ep, etp, split)
        dtype = dtype or config_dtype(cfg)
        job = dict(hf=str(hf_dir), out=str(staging.path), layout=layout, dtype=dtype_name(dtype), mtp=mtp)
        read = run_ranks(convert_rank, layout.world, job)
        _finish(staging, hf_dir, ckpt, model, layout, dtype, read)
    except BaseException:
        staging.abort()
        raise
    return staging.commit()


def _hf_to_mcore_torchrun(hf_dir: Path, out_dir: Path, tp, pp, ep, etp, dtype, overwrite, split) -> Path:
    """This process is one of torchrun's: every rank checks the input (same answer everywhere, no collective
    needed to fail together), rank 0 owns the temp dir, all ranks save into it, rank 0 publishes it."""
    import torch.distributed as dist

    from mtrain.dist import init_distributed

    from .errors import ConvertError
    from .output_dir import check_output_dir

    check_output_dir(out_dir, overwrite)
    ckpt, cfg, mtp, model, _ = check_input(hf_dir, tp, pp, ep, etp, split)
    layout, _ = megatron_layout(model, tp, pp, ep, etp, world=int(os.environ["WORLD_SIZE"]), split=split)
    dtype = dtype or config_dtype(cfg)
    info = init_distributed(tp=tp, pp=pp, ep=ep, etp=etp)
    staging = AtomicDir(out_dir, overwrite) if info.rank == 0 else None
    path = [str(staging.path) if staging else None]
    dist.broadcast_object_list(path, src=0)
    try:
        job = dict(hf=str(hf_dir), out=path[0], layout=layout, dtype=dtype_name(dtype), mtp=mtp)
        result = convert_rank(info.rank, info.world_size, job)
        results = [None] * info.world_size
        dist.all_gather_object(results, result)
        errors = [r["error"] for r in results if "error" in r]
        if errors:
            raise ConvertError(errors[0])
        if staging is not None:
            _finish(staging, hf_dir, ckpt, model, layout, dtype, [r["ok"] for r in results])
    except BaseException:
        if staging is not None:
            staging.abort()
        raise
    out = staging.commit() if staging is not None else out_dir
    dist.barrier()  # no rank returns before the checkpoint is published
    return out


def run(args: argparse.Namespace) -> int:
    out = hf_to_mcore(args.hf, args.out, tp=args.tp, pp=args.pp, ep=args.ep, etp=args.etp, dtype=args.dtype,
                      overwrite=args.force, first_stage_layers=args.first_stage_layers,
                      last_stage_layers=args.last_stage_layers)
    if os.environ.get("RANK", "0") == "0":
        print(f"wrote Megatron dist checkpoint {out}")
    return 0
