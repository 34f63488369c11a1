"""Packed causal attention alone, forward + backward, on one micro-batch of bench_train_throughput's heavy-tailed
batch (the first one its token-budget plan makes): the per-sequence path before issue 18's fix (3-D SDPA slices,
which torch's fused kernels refuse, so the math kernel ran; K/V copied for GQA) against what
`mtrain.models.varlen_attention` runs now (varlen flash on CUDA, 4-D fused SDPA per sequence elsewhere), and on
CUDA also the 4-D per-sequence path with varlen switched off. Times are medians over --repeats in the same run.

    # H200, Llama-3.2-1B attention shape (32 heads, 8 KV heads, head dim 64), bf16, one layer
    python benchmarks/bench_packed_attention.py --max-len 2048 --budget 4096 --samples 128
    # CPU (float32)
    python benchmarks/bench_packed_attention.py --max-len 512 --budget 1024 --samples 32 --repeats 3
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_train_throughput import heavy_tailed_lengths  # noqa: E402

from mtrain.models.varlen_attention import causal_packed_attention  # noqa: E402
from mtrain.trainer.packing import plan_micro_batches  # noqa: E402


def before_fix(q, k, v, cu: list[int], scale: float) -> torch.Tensor:
    """The packed path as it was (mtrain/models/packed_attention.py before issue 18's fix), the baseline."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    q, k, v = (x.transpose(0, 1) for x in (q, k, v))
    outs = [F.scaled_dot_product_attention(q[:, a:b], k[:, a:b], v[:, a:b], is_causal=True, scale=scale)
            for a, b in zip(cu[:-1], cu[1:])]
    return torch.cat(outs, dim=1).transpose(0, 1)


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, repeats: int) -> tuple[float, torch.Tensor, list[float]]:
    """(median seconds, last output, every timed run): the runs go into the JSON as the spread."""
    times, out = [], None
    for _ in range(repeats + 1):  # the first call warms up
        _sync()
        t0 = time.perf_counter()
        out = fn()
        _sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:]), out, times[1:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=int, default=128)
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--budget", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=str, default=None)
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    dev, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    lengths = [p + r for p, r in heavy_tailed_lengths(args.samples, args.max_len, args.seed)]
    rows = plan_micro_batches(lengths, args.budget)[0]
    seqs = [lengths[i] for i in rows]
    cu = [0]
    for n in seqs:
        cu.append(cu[-1] + n)
    g = torch.Generator().manual_seed(args.seed)
    q, k, v = (torch.randn(cu[-1], h, args.head_dim, generator=g).to(dev, dtype)
               for h in (args.heads, args.kv_heads, args.kv_heads))
    grad = torch.randn(cu[-1], args.heads, args.head_dim, generator=g).to(dev, dtype)
    cu_dev = torch.tensor(cu, dtype=torch.int32, device=dev)
    scale = args.head_dim ** -0.5

    def fwd_bwd(fn):
        def run():
            x = [t.detach().requires_grad_(True) for t in (q, k, v)]
            out = fn(*x)
            out.backward(grad)
            return out.detach()
        return run

    paths = {"before_fix_3d": lambda a, b, c: before_fix(a, b, c, cu, scale),
             "now": lambda a, b, c: causal_packed_attention(a, b, c, cu_dev, cu, max(seqs), scale)}
    results = {}
    for name, fn in paths.items():
        results[name] = timed(fwd_bwd(fn), args.repeats)
    if cuda:  # the 4-D per-sequence fallback on the GPU as well
        os.environ["MTRAIN_VARLEN_ATTN"] = "0"
        results["now_per_sequence_4d"] = timed(fwd_bwd(paths["now"]), args.repeats)
        os.environ.pop("MTRAIN_VARLEN_ATTN")
    ref = results["before_fix_3d"][1].float()
    out = {"device": torch.cuda.get_device_name() if cuda else "CPU", "dtype": str(dtype), "torch": torch.__version__,
           "args": vars(args), "sequences": len(seqs), "tokens": cu[-1], "max_len": max(seqs),
           "seconds_fwd_bwd": {k: t for k, (t, _, _) in results.items()},
           "runs_fwd_bwd": {k: runs for k, (_, _, runs) in results.items()},
           "speedup_vs_before": {k: results["before_fix_3d"][0] / t for k, (t, _, _) in results.items()},
           "max_abs_diff_vs_before": {k: float((o.float() - ref).abs().max()) for k, (_, o, _) in results.items()}}
    for k, t in out["seconds_fwd_bwd"].items():
        runs = out["runs_fwd_bwd"][k]
        print(f"{k:22s} {t * 1e3:9.2f} ms fwd+bwd ({min(runs) * 1e3:.2f}-{max(runs) * 1e3:.2f})  "
              f"{out['speedup_vs_before'][k]:6.2f}x  "
              f"max |diff| vs before {out['max_abs_diff_vs_before'][k]:.3g}")
    print(json.dumps(out))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
