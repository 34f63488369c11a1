"""Separate-placement one_step asynchrony vs colocated synchronous RL at 8 / 64 / 512 GPUs: a roofline model.

    python benchmarks/sim_async.py [--seqs-per-gpu 32] [--median-len 1024] [--sigma 0.6]

Not a measurement: every number comes from the assumptions below (printed with the result). The step times are
modelled per phase, as the trainer's metrics split them (time/rollout, time/logprobs + time/train, time/sync):
- GPU: H200, 989 TFLOP/s bf16 dense peak, 4.8 TB/s HBM, 50 GB/s per GPU between nodes (400 Gb/s NIC per GPU).
- Rollout: each sequence's response length is log-normal (median, sigma, cap); a synchronous step decodes until its
  longest sequence ends. A decode step of an engine of `tp` GPUs holding b running sequences costs
  max(bytes read / (tp x HBM x 0.7), 2 x active params x b / (tp x peak x 0.3)) + 30 us launch, where bytes read =
  min(all params, active params x max(b, 1)) x 2 (MoE: a batch touches more experts as it grows) + KV reads
  (b x context x kv_bytes_per_token). Sequences are spread evenly over the engines; prefill is ignored.
- Train (logprobs + update): 8 x active params x tokens FLOPs at 35 % of peak on the training GPUs.
- Colocated sync: every GPU copies its engine shard locally (2 x params / GPUs bytes at HBM speed) plus releasing
  and resuming the engine memory (1 s, measured order on the SmolLM2 H200 runs). Separate: each engine GPU receives
  its shard (2 x params / engine tp bytes) over the inter-node link while the engines pause (no abort).
- Separate one_step: step = max(rollout on the engine GPUs, train on the training GPUs) + sync; the split
  (engine GPUs, in whole engines) is the best one. Colocated synchronous: step = rollout + train + sync on all GPUs.
- Memory: a layout is refused when the trainer's 16 bytes/param (bf16 params + grads, fp32 Adam and main params,
  spread over the training GPUs) plus the engine's weights do not fit 141 GB x 0.9 per GPU.
"""
from __future__ import annotations

import argparse
import json
import math
import random

H200 = {"flops": 989e12, "hbm": 4.8e12, "ib": 50e9, "mem": 141e9 * 0.9}
MODELS = {  # total params, active params, KV bytes per token (bf16), engine TP
    "qwen3-30b-a3b": {"total": 30.5e9, "active": 3.3e9, "kv_per_token": 48 * 2 * 4 * 128 * 2, "engine_tp": 2},
    "deepseek-v3": {"total": 671e9, "active": 37e9, "kv_per_token": 61 * (512 + 64) * 2, "engine_tp": 16},
}


def lengths(n: int, median: float, sigma: float, cap: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [min(cap, max(1, int(rng.lognormvariate(math.log(median), sigma)))) for _ in range(n)]


def rollout_s(m: dict, gpus: int, lens: list[int], prompt: int) -> float:
    """Decode time of all sequences on `gpus` engine GPUs (engines of engine_tp), until the longest ends."""
    tp = m["engine_tp"]
    engines = max(1, gpus // tp)
    per = sorted(lens[i] for i in range(0, len(lens), engines))  # one engine's share (even spread)
    t, k, running = 0.0, 0, len(per)
    steps = 0
    for L in per:  # decode steps between consecutive finishing lengths run with `running` sequences
        if L > k:
            b = running
            ctx = prompt + (k + L) / 2
            read = min(m["total"], m["active"] * max(b, 1)) * 2 + b * ctx * m["kv_per_token"]
            step = max(read / (tp * H200["hbm"] * 0.7), 2 * m["active"] * b / (tp * H200["flops"] * 0.3)) + 30e-6
            t += step * (L - k)
            steps += L - k
            k = L
        running -= 1
    return t


def train_s(m: dict, gpus: int, tokens: float) -> float:
    return 8 * m["active"] * tokens / (gpus * H200["flops"] * 0.35)


def fits(m: dict, train_gpus: int, engine_gpus_per_engine: int, colocated: bool) -> bool:
    train = 16 * m["total"] / train_gpus
    engine = 2 * m["total"] / engine_gpus_per_engine
    return (train + engine if colocated else max(train, engine)) <= H200["mem"]


def simulate(name: str, gpus: int, seqs_per_gpu: int, median: float, sigma: float, cap: int, prompt: int) -> dict:
    m = MODELS[name]
    lens = lengths(seqs_per_gpu * gpus, median, sigma, cap)
    tokens = sum(lens) + prompt * len(lens)
    out = {"model": name, "gpus": gpus, "sequences": len(lens)}
    if gpus < m["engine_tp"] or not fits(m, gpus, m["engine_tp"], colocated=True):
        out["colocated_sync"] = None
    else:
        sync = 2 * m["total"] / gpus / H200["hbm"] + 1.0
        r, t = rollout_s(m, gpus, lens, prompt), train_s(m, gpus, tokens)
        out["colocated_sync"] = {"step_s": r + t + sync, "rollout_s": r, "train_s": t, "sync_s": sync}
    best = None
    for e in range(m["engine_tp"], gpus, m["engine_tp"]):
        if not fits(m, gpus - e, m["engine_tp"], colocated=False):
            continue
        r, t = rollout_s(m, e, lens, prompt), train_s(m, gpus - e, tokens)
        sync = 2 * m["total"] / m["engine_tp"] / H200["ib"]
        cand = {"step_s": max(r, t) + sync, "engine_gpus": e, "rollout_s": r, "train_s": t, "sync_s": sync}
        if best is None or cand["step_s"] < best["step_s"]:
            best = cand
    out["separate_one_step"] = best
    if best and out["colocated_sync"]:
        out["speedup"] = out["colocated_sync"]["step_s"] / best["step_s"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs-per-gpu", type=int, default=32)
    ap.add_argument("--median-len", type=float, default=1024)
    ap.add_argument("--sigma", type=float, default=0.6)
    ap.add_argument("--cap", type=int, default=8192)
    ap.add_argument("--prompt", type=int, default=512)
    a = ap.parse_args()
    for name in MODELS:
        for gpus in (8, 64, 512):
            r = simulate(name, gpus, a.seqs_per_gpu, a.median_len, a.sigma, a.cap, a.prompt)
            print(json.dumps({k: ({kk: round(vv, 2) for kk, vv in v.items()} if isinstance(v, dict) else
                                  (round(v, 2) if isinstance(v, float) else v)) for k, v in r.items()}))


if __name__ == "__main__":
    main()
