"""Where the bitwise mode's scoring pass spends its time: the Actor's logprob pass (the trainer's forward over packed
micro-batches) with numerics.on_policy=off and =bitwise on the same random model, timed and profiled (the CUDA
kernels with the most time, and the host-side wall outside them), one process per mode.

Usage (GPU machine, after `source benchmarks/gpu_setup.sh`; HF_DIR a model folder, e.g. gpu_bitwise.sh's):
    python benchmarks/gpu_bitwise_profile.py --hf HF_DIR --out F.json [--sequences 64 --prompt 64 --response 128]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO))


def one_mode(args) -> dict:
    import torch
    from bench_train_throughput import make_batch, single_process_env
    from mtrain.config import load_config
    from mtrain.dist import init_distributed
    from mtrain.layouts import model_layout
    from mtrain.trainer.engines import weight_loader
    from mtrain.trainer.learner.actor import Actor

    single_process_env()
    hf = Path(args.hf)
    cfg = load_config(str(REPO / "mtrain" / "configs" / "tiny_llama_grpo.yaml"), [
        f"model.hf_path={hf}", "model.dtype=bfloat16", "engine.kind=sglang", "algo.kl_coef=0",
        f"train.max_tokens_per_micro_batch={args.budget}", f"numerics.on_policy={args.mode}",
        f"rollout.max_prompt_len={args.prompt}", f"rollout.max_new_tokens={args.response}"])
    init_distributed(seed=1)
    hf_cfg = json.loads((hf / "config.json").read_text())
    actor = Actor(cfg, hf_cfg, load_weights=weight_loader(cfg, model_layout(hf_cfg, mtp=False), 0))
    batch = make_batch([(args.prompt, args.response)] * args.sequences, hf_cfg["vocab_size"], seed=0)
    cuda = torch.cuda.is_available()  # (runs on a CPU too, to check the script)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    actor.logprobs(batch)  # compile and warm up
    times = []
    for _ in range(args.repeats):
        sync()
        t0 = time.perf_counter()
        actor.logprobs(batch)
        sync()
        times.append(time.perf_counter() - t0)
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=activities) as prof:
        actor.logprobs(batch)
        sync()
    key = (lambda e: e.self_device_time_total) if cuda else (lambda e: e.self_cpu_time_total)
    events = sorted(prof.key_averages(), key=key, reverse=True)
    total = sum(key(e) for e in prof.key_averages()) / 1e6
    top = [{"name": e.key[:90], "self_s": key(e) / 1e6, "calls": e.count} for e in events[:15]]
    return {"mode": args.mode, "logprob_pass_s": times, "median_s": statistics.median(times),
            "device_self_s" if cuda else "cpu_self_s": total, "tokens": int(batch.seq_lens.sum()), "top_kernels": top}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hf", required=True)
    ap.add_argument("--out", default="/tmp/bitwise_profile.json")
    ap.add_argument("--mode", default=None, help="(internal) run one mode in this process")
    ap.add_argument("--sequences", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--response", type=int, default=128)
    ap.add_argument("--budget", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    if args.mode:
        print("RESULT " + json.dumps(one_mode(args)), flush=True)
        return 0
    res = {}
    for mode in ("off", "bitwise"):  # a process each: the bitwise switch of token_logprobs is process-wide
        cmd = [sys.executable, __file__, "--hf", args.hf, "--mode", mode, "--sequences", str(args.sequences),
               "--prompt", str(args.prompt), "--response", str(args.response), "--budget", str(args.budget),
               "--repeats", str(args.repeats)]
        p = subprocess.run(cmd, capture_output=True, text=True)
        lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
        res[mode] = json.loads(lines[-1][7:]) if lines else {"error": p.stderr[-1500:]}
        print(json.dumps(res[mode], indent=1), flush=True)
    if "median_s" in res.get("off", {}) and "median_s" in res.get("bitwise", {}):
        res["ratio"] = res["bitwise"]["median_s"] / res["off"]["median_s"]
        print(f"bitwise / off logprob pass: {res['ratio']:.2f}x")
    Path(args.out).write_text(json.dumps(res, indent=1))
    return 0 if "ratio" in res else 1


if __name__ == "__main__":
    sys.exit(main())
