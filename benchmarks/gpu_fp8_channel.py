"""GPU check: per-channel FP8 written by mtrain's scatter kernel == SGLang's own online quantization of the same
bf16 weights (engine.fp8_scaling=channel, docs/fp8.md "Per-channel FP8"), on SmolLM2-135M's per-rank shapes.

    source benchmarks/gpu_setup.sh && python benchmarks/gpu_fp8_channel.py --out $OUT/fp8_channel

For each linear layer of SmolLM2 (qkv 960 x 576 fused from q/k/v parts, o_proj 576 x 576, gate_up 3072 x 576
fused from gate/up, down_proj 576 x 1536) at engine TP 1, random bf16 weights at Megatron's init scale (and a
wider spread), with a few special rows (-0.0 mixed in, float32 denormals, one saturating element):
  - SGLang: `per_token_group_quant_fp8(w, K)` on the fused bf16 tensor, the call of Fp8LinearMethod.
    process_weights_after_loading (layers/quantization/fp8.py:841), i.e. sgl_kernel's per-token kernel;
  - mtrain: execute_scatter with BlockFp8(scaling="channel") from the separate parts (as the sync gathers them),
    through the Triton kernel (rcp.approx.ftz, as SGLang's MUFU.RCP) and the torch executor (IEEE reciprocal).
Reports, per layer: bytes and scales equal (Triton vs SGLang: expected all), the rows where the torch executor
differs from SGLang (the reciprocal's cost), and the rows whose maximum is 0 after FTZ, all zeros or float32
denormals (SGLang's two kernels differ there: the small-batch one, rows < 16 x SMs, writes 0x7E for the all-zero
row; ours signed zeros; all dequantize to 0 or below 1e-38). Exit status 1 if a Triton weight or scale differs from
SGLang's outside those rows. Writes <out>/gpu_fp8_channel.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

# SmolLM2-135M: hidden 576, heads 9 x 64, kv heads 3, intermediate 1536
LAYERS = {"qkv_proj": ([576, 192, 192], 576), "o_proj": ([576], 576), "gate_up_proj": ([1536, 1536], 576),
          "down_proj": ([576], 1536)}


def parts_for(rows: list[int], k: int, std: float, gen: torch.Generator, special: bool) -> list[torch.Tensor]:
    out = []
    for i, n in enumerate(rows):
        w = torch.randn(n, k, device="cuda", generator=gen) * std
        w *= torch.exp(torch.randn(n, 1, device="cuda", generator=gen))  # rows over a range of magnitudes
        if special and i == 0:
            w[1, ::3] = -0.0
            w[2] = torch.where(w[2] > 0, 1e-40, -1e-40)  # float32 denormals: amax 0 after FTZ
            w[3, 5] = 3e38
            w[4] = 0.0
        out.append(w.to(torch.bfloat16).contiguous())
    return out


def ours(parts: list[torch.Tensor], backend: str):
    from mtrain.kernels import BlockFp8, ScatterTable, execute_scatter
    from mtrain.kernels.fp8_channel import channel_block
    k = parts[0].shape[1]
    n = sum(p.shape[0] for p in parts)
    dev = parts[0].device
    dst = torch.full((n * k,), 0x7F, dtype=torch.uint8, device=dev).view(torch.float8_e4m3fn)
    scale = torch.full((n,), float("nan"), device=dev)
    rows, r0 = [], 0
    for i, p in enumerate(parts):
        rows.append([i, 0, k, r0 * k, k, p.shape[0], k, 0])
        r0 += p.shape[0]
    execute_scatter([dst], [p.view(-1) for p in parts], ScatterTable.from_rows(rows), backend=backend,
                    quant={0: BlockFp8(scale, (n, k), channel_block(k), scaling="channel")})
    if dev.type == "cuda":
        torch.cuda.synchronize()
    return dst.view(n, k), scale


def compare(q, s, ref_q, ref_s, zero_rows: set[int]) -> dict:
    qb, rb = q.view(torch.uint8), ref_q.view(torch.uint8)
    row_bad = (qb != rb).any(1) | (s.view(-1).view(torch.int32) != ref_s.view(-1).view(torch.int32))
    bad = [int(r) for r in torch.nonzero(row_bad).flatten().tolist()]
    return {"rows_differ": len([r for r in bad if r not in zero_rows]), "zero_rows_differ": len(set(bad) & zero_rows),
            "bytes_differ": int((qb != rb).sum()), "first_rows": bad[:8]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT"))
    ap.add_argument("--seeds", type=int, default=3)
    args = ap.parse_args()
    from sglang.srt.layers.quantization.fp8 import per_token_group_quant_fp8  # the name fp8.py calls
    sm = torch.cuda.get_device_properties(0).multi_processor_count
    res = {"device": torch.cuda.get_device_name(), "sms": sm, "layers": {}}
    ok = True
    for seed in range(args.seeds):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        for name, (rows, k) in LAYERS.items():
            for std, special in ((0.02, seed == 0), (1.0, False)):
                parts = parts_for(rows, k, std, gen, special)
                full = torch.cat(parts).contiguous()
                ref_q, ref_s = per_token_group_quant_fp8(full, full.shape[-1])  # [N, K] e4m3, [N, 1] float32
                torch.cuda.synchronize()
                # rows whose maximum is 0 once FTZ flushes float32 denormals: all zeros (row 4) and denormals (row 2)
                zero = {2, 4} if special else set()
                tag = f"{name}/std{std}/seed{seed}"
                res["layers"][tag] = r = {"shape": list(full.shape), "sglang_kernel": "warp" if full.shape[0] >= 16 * sm
                                          else "small_batch"}
                r["triton"] = compare(*ours(parts, "triton"), ref_q, ref_s, zero)
                r["torch"] = compare(*(t.cuda() for t in ours([p.cpu() for p in parts], "torch")), ref_q, ref_s, zero)
                ok &= r["triton"]["rows_differ"] == 0
                print(f"{tag}: {r['shape']} ({r['sglang_kernel']}) triton rows differing {r['triton']['rows_differ']}"
                      f" (+{r['triton']['zero_rows_differ']} of max 0 after FTZ; rows {r['triton']['first_rows']}),"
                      f" torch {r['torch']['rows_differ']}", flush=True)
    res["triton_bit_equal_to_sglang"] = bool(ok)
    print(f"per-channel FP8: Triton sync bit-equal to SGLang's own quantization: {ok}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "gpu_fp8_channel.json"), "w") as f:
            json.dump(res, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
