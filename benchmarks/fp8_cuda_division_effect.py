"""CPU: how often a checkpoint quantized with `amax / 448.0` on a CUDA device (scale = amax * float32(1/448), the
2026-11-30 GPU reference) differs from the IEEE quantization our kernel writes, per FP8 weight of a model shape.

    OMP_NUM_THREADS=1 python benchmarks/fp8_cuda_division_effect.py --model dsv3tiny --seeds 20

Every FP8 weight of the model (SGLang's fused per-rank parameter at engine TP 1) is drawn as Megatron initialises
it (bf16 normal, std = init_method_std, and std / sqrt(2 * layers) for the output projections o_proj / down_proj /
w2, Megatron's output_layer_init_method), quantized twice: `quantize_blocks` (IEEE) and the old formula run under
`fp8_diagnose.CudaScalarDivision` (CUDA's scalar division on the CPU). Reported per weight kind over --seeds
draws: the share of scale blocks that differ (the scale tensor then always differs) and how often the FP8 weight
nevertheless comes out bit-equal (a weight differs only where a block's IEEE scale lands an element exactly on an
e4m3 rounding tie). Writes $OUT/fp8_cuda_division_effect_<model>.json when OUT is set.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_sync import CONFIGS  # noqa: E402
from gpu_fp8_sync import quantize_scalar_div  # noqa: E402

OUTPUT_PROJ = ("o_proj.weight", "down_proj.weight", "w2_weight")


def fp8_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Engine-TP-1 shapes of one instance of every FP8 parameter kind (first layer that has it)."""
    from mtrain.layouts import model_layout
    from mtrain.reshard.placement import MegatronLayout, SGLangLayout
    from mtrain.reshard.planner import build_plan

    layout = model_layout(cfg)
    plan = build_plan(layout, MegatronLayout(), SGLangLayout(tp=1, fp8=True))
    out: dict[str, tuple[int, ...]] = {}
    for key in plan.quant:
        name = key[2]
        parts = name.split(".")
        kind = ".".join(parts[parts.index("layers") + 2:]) if "layers" in parts else name
        out.setdefault(kind, tuple(plan.dst_tensors[key].shape))
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=sorted(CONFIGS), default="dsv3tiny")
    ap.add_argument("--seeds", type=int, default=20)
    args = ap.parse_args()
    from mtrain.kernels import quantize_blocks
    from mtrain.rollout.fp8_diagnose import CudaScalarDivision

    cfg = CONFIGS[args.model]
    std = float(cfg.get("initializer_range", 0.02))
    out_std = std / (2 * int(cfg["num_hidden_layers"])) ** 0.5
    stats: dict = defaultdict(lambda: {"scale_blocks": 0, "scale_blocks_differ": 0, "weights_equal": 0, "draws": 0})
    for kind, shape in sorted(fp8_shapes(cfg).items()):
        s_std = out_std if kind.endswith(OUTPUT_PROJ) else std
        for seed in range(args.seeds):
            g = torch.Generator().manual_seed(seed)
            w = (torch.randn(*shape, generator=g) * s_std).to(torch.bfloat16)
            q, s = quantize_blocks(w)
            with CudaScalarDivision():
                qo, so = quantize_scalar_div(w)
            st = stats[kind]
            st.update(shape=list(shape), std=s_std)
            st["scale_blocks"] += s.numel()
            st["scale_blocks_differ"] += int((s != so).sum())
            st["weights_equal"] += bool(torch.equal(q.view(torch.uint8), qo.view(torch.uint8)))
            st["draws"] += 1
    print(f"{args.model}: {args.seeds} draws per FP8 weight kind; IEEE amax/448 vs CUDA `amax / 448.0`")
    print(f"{'weight':48s} {'shape':>18s} {'std':>8s} {'scale blocks differ':>20s} {'weight bit-equal':>17s}")
    for kind, st in stats.items():
        print(f"{kind:48s} {str(tuple(st['shape'])):>18s} {st['std']:8.4f} "
              f"{st['scale_blocks_differ'] / st['scale_blocks']:19.1%} {st['weights_equal'] / st['draws']:16.0%}")
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, f"fp8_cuda_division_effect_{args.model}.json"), "w") as f:
            json.dump({"model": args.model, "seeds": args.seeds, "kinds": stats}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
