"""verify: a Megatron dist checkpoint gives the same logits as its HF source under transformers.

A vision-language model (Qwen2.5-VL) runs rows with images of several sizes (random pixels,
mtrain.models.vlm_probe) through both: the vision tower, the image scatter and MRoPE are compared too.

The HF model is built by transformers (float32, its own code: the independent reference), the Megatron model
at the requested layout is loaded from the dist checkpoint (Megatron reshards on load), both run the same
random tokens, and the largest logit difference is printed, absolute and relative to the largest |logit|.
Exit status 1 when the relative difference is above the tolerance (default 1e-4 for a float32 forward,
2e-2 for bf16, 1e-2 for fp16). Megatron's forward runs in the checkpoint's dtype unless `dtype` says otherwise:
float32 on a bf16 checkpoint (its values upcast exactly) checks the conversion alone. A bf16 forward against
transformers' float32 also carries bf16's own arithmetic, which on a random MoE model flips top-k expert choices
and exceeds 2e-2 with nothing wrong in the checkpoint (docs/archive/results-2026-11.md, sections 13 and 40).
"""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import CheckpointError
from .mcore_io import build_and_load, check_dist_checkpoint, checkpoint_facts, megatron_layout, layout_for
from .mcore_io import StageSplit, rank_error, run_ranks, stage_split_overrides

DEFAULT_TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 1e-2}


@dataclass
class VerifyResult:
    max_abs: float
    max_rel: float  # max |Δ| / max |HF logit|
    tol: float
    shape: tuple[int, ...]
    dtype: str = "float32"  # Megatron's forward

    @property
    def ok(self) -> bool:
        return self.max_rel <= self.tol


def make_tokens(vocab: int, batch: int = 2, seq: int = 16, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def hf_logits(hf_dir: Path, tokens: torch.Tensor, images: dict | None = None) -> torch.Tensor:
    """images (a vision-language model): pixel_values, image_grid_thw, mm_token_type_ids of the rows."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    auto = AutoModelForImageTextToText if images is not None else AutoModelForCausalLM
    try:
        model = auto.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{hf_dir}: transformers cannot load this HF checkpoint: {e}") from e
    with torch.no_grad():
        return model(input_ids=tokens, **(images or {})).logits.float()


@rank_error
def megatron_logits_rank(rank: int, world: int, job: dict):
    """Logits on the last pipeline stage's first rank, None elsewhere."""
    from megatron.core import parallel_state as ps

    from mtrain.dist import init_distributed
    from mtrain.models import forward_logits

    lay = job["layout"]
    init_distributed(tp=lay.tp, pp=lay.pp, ep=lay.ep, etp=lay.etp)
    chunks = build_and_load(job["cfg"], job["mtp"], getattr(torch, job["dtype"]), job["mcore"],
                            config_overrides=stage_split_overrides(lay))
    for c in chunks:
        c.eval()
    probe = job.get("probe")  # a vision-language model: MRoPE positions and images
    out = forward_logits(chunks, job["tokens"], position_ids=probe and probe["position_ids"],
                         images=probe and {k: probe[k] for k in ("pixel_values", "image_grid_thw")})
    if out is None or ps.get_tensor_model_parallel_rank() != 0:
        return None
    return out.float().cpu()  # the parent compares on the host (the chunks are on CUDA on a GPU machine)


def megatron_logits(mcore_dir: Path, tokens: torch.Tensor, cfg: dict, mtp: bool, dtype: torch.dtype,
                    tp: int = 1, pp: int = 1, ep: int = 1, split: StageSplit = StageSplit(),
                    probe: dict | None = None) -> torch.Tensor:
    """dtype: the forward's; a bf16 checkpoint loads into float32 parameters exactly (Megatron copies on load)."""
    layout, _ = megatron_layout(layout_for(cfg, mtp), tp, pp, ep, None, split=split)
    job = dict(cfg=cfg, mtp=mtp, dtype=str(dtype).removeprefix("torch."), mcore=str(mcore_dir), tokens=tokens,
               layout=layout, probe=probe)
    outs = [o for o in run_ranks(megatron_logits_rank, layout.world, job) if o is not None]
    return outs[0]


def verify(hf_dir: str | os.PathLike, mcore_dir: str | os.PathLike, *, tp: int = 1, pp: int = 1, ep: int = 1,
           tol: float | None = None, tokens: torch.Tensor | None = None, first_stage_layers: int | None = None,
           last_stage_layers: int | None = None, dtype: torch.dtype | None = None) -> VerifyResult:
    """dtype: Megatron's forward dtype (default: the checkpoint's)."""
    hf_dir, mcore_dir = Path(hf_dir), Path(mcore_dir)
    check_dist_checkpoint(mcore_dir, need_config=False)
    cfg, mtp, stored = checkpoint_facts(mcore_dir, hf_dir)
    dtype = dtype or stored
    probe = None
    if layout_for(cfg, mtp).meta.get("vision"):  # rows with images of several sizes (mtrain.models.vlm_probe)
        from mtrain.models.vlm_probe import probe_batch
        probe = probe_batch(cfg)
        tokens = probe["tokens"]
    tokens = make_tokens(layout_for(cfg, mtp).vocab_size) if tokens is None else tokens
    got = megatron_logits(mcore_dir, tokens, cfg, mtp, dtype, tp, pp, ep,
                          split=StageSplit(first_stage_layers, last_stage_layers), probe=probe)
    want = hf_logits(hf_dir, tokens, probe and {k: probe[k] for k in
                                                ("pixel_values", "image_grid_thw", "mm_token_type_ids")})
    if got.shape != want.shape:
        raise CheckpointError(f"logit shapes differ: Megatron {tuple(got.shape)}, transformers {tuple(want.shape)}")
    diff = (got - want).abs().max().item()
    return VerifyResult(diff, diff / max(want.abs().max().item(), 1e-30),
                        DEFAULT_TOL.get(dtype, 2e-2) if tol is None else tol, tuple(want.shape),
                        str(dtype).removeprefix("torch."))


def run(args: argparse.Namespace) -> int:
    r = verify(args.hf, args.mcore, tp=args.tp, pp=args.pp, ep=args.ep, tol=args.tol,
               first_stage_layers=args.first_stage_layers, last_stage_layers=args.last_stage_layers, dtype=args.dtype)
    verdict = "OK" if r.ok else "FAIL"
    print(f"{verdict}: logits {list(r.shape)}: max |diff| {r.max_abs:.3e}, relative {r.max_rel:.3e} "
          f"(tolerance {r.tol:.1e}, forward {r.dtype}, tp={args.tp} pp={args.pp} ep={args.ep}"
          + (f" stages {args.first_stage_layers}/.../{args.last_stage_layers}"
             if args.first_stage_layers or args.last_stage_layers else "") + ")")
    return 0 if r.ok else 1
