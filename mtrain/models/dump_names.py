"""Dump every Megatron parameter name/shape of the five tiny architectures (input to the layout tables).

    python -m mtrain.models.dump_names OUTDIR [--parallel]

Writes OUTDIR/{arch}.txt at TP1/PP1/EP1 in one gloo process: ``name shape dtype`` per parameter from
``named_parameters()``, the persistent buffers (``--- buffers``: e.g. the router's ``expert_bias``), then
``--- sharded_state_dict`` with each checkpoint key and its *global* shape. With ``--parallel`` also
OUTDIR/{arch}.tp2ep2.txt for the MoE architectures (4 ranks: TP2, EP2, ETP=TP=2, rank 0's local shapes).
OUTDIR/TE_NAMES.md says which names the Transformer-Engine spec uses instead.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

from mtrain.models.te_names import TE_NAMES_MD

ARCHS = ("llama", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3")
MOE_ARCHS = ("qwen3_moe", "deepseek_v3")


def describe_model(chunks) -> str:
    """The dump text for this rank's chunks (chunk index prefixed when there are several)."""
    lines: list[str] = []
    many = len(chunks) > 1
    for i, model in enumerate(chunks):
        pre = f"chunk{i}." if many else ""
        for name, p in model.named_parameters():
            lines.append(f"{pre}{name} {tuple(p.shape)} {str(p.dtype).replace('torch.', '')}")
    lines.append("--- buffers (persistent, in state_dict)")
    for i, model in enumerate(chunks):
        pre = f"chunk{i}." if many else ""
        params = {n for n, _ in model.named_parameters()}
        for name, b in model.state_dict(keep_vars=True).items():
            if name in params or name.endswith("_extra_state") or not isinstance(b, torch.Tensor):
                continue
            lines.append(f"{pre}{name} {tuple(b.shape)} {str(b.dtype).replace('torch.', '')}")
    lines.append("--- sharded_state_dict: state-dict key -> checkpoint key, global shape (ShardedTensor)")
    for i, model in enumerate(chunks):
        pre = f"chunk{i}." if many else ""
        for name, value in model.sharded_state_dict().items():
            if name.endswith("_extra_state"):
                continue
            key = getattr(value, "key", "?")
            if hasattr(value, "global_shape"):
                lines.append(f"{pre}{name} -> {key} {tuple(value.global_shape)}")
            else:  # ShardedTensorFactory (e.g. GLU fc1 split into gate/up halves on save): local data only
                data = getattr(value, "data", None)
                shape = tuple(data.shape) if data is not None else "-"
                lines.append(f"{pre}{name} -> {key} local{shape} {type(value).__name__}")
    return "\n".join(lines) + "\n"


def _dump_rank(rank: int, world: int, arch: str, tp: int, ep: int) -> str:
    from mtrain.dist import init_distributed
    from mtrain.models.builder import build_model
    from mtrain.tiny_configs import numerics_config as tiny_config

    init_distributed(tp=tp, ep=ep)
    chunks, _ = build_model(tiny_config(arch))
    return describe_model(chunks)


def _write(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("outdir", type=Path)
    parser.add_argument("--parallel", action="store_true", help="also dump TP2xEP2 shapes for MoE models")
    args = parser.parse_args(argv)
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    args.outdir.mkdir(parents=True, exist_ok=True)
    from mtrain.dist import destroy, run_on_ranks

    for arch in ARCHS:
        # One process per architecture dump keeps parallel_state clean between them.
        text = run_on_ranks(_dump_rank, 1, arch, 1, 1)[0]
        _write(args.outdir / f"{arch}.txt", text)
        print(f"wrote {args.outdir / f'{arch}.txt'}")
    if args.parallel:
        for arch in MOE_ARCHS:
            texts = run_on_ranks(_dump_rank, 4, arch, 2, 2)
            _write(args.outdir / f"{arch}.tp2ep2.txt", texts[0])
            print(f"wrote {args.outdir / f'{arch}.tp2ep2.txt'}")
    _write(args.outdir / "TE_NAMES.md", TE_NAMES_MD)
    destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
