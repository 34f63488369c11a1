"""Rollout routing replay (R3) on one GPU with the real SGLang engine: GRPO with algo.routing_replay off vs rollout.

    source benchmarks/gpu_setup.sh && python benchmarks/gpu_routing_replay.py --out $OUT/routing_replay.json

For each model (tiny DeepSeek-V3 = examples/deepseek_v3/tiny/gpu_config.json: 16 experts top-4, grouped sigmoid
routing with expert bias, one dense layer; and a Qwen3-MoE-shaped model: 128 experts top-8 softmax routing, as
Qwen3-30B-A3B, at a small hidden size) it runs `torchrun --nproc-per-node 1 -m mtrain train` twice with the same
config and seeds, replay off and on (bf16, SGLang colocated, pull sync), and reads each run's metrics.jsonl:
- logprob gap engine vs Megatron per step (`logprob_diff/mean_abs`, `max_abs`), off and on (goal with replay:
  max <= 0.05, mean <= 0.003);
- routing disagreement (share of tokens x MoE layers whose own top-k set differs from SGLang's), measured in the
  replay run's scoring pass (the trainer's own choice, computed next to the replayed one);
- step time (rollout, logprobs, train) and memory (CUDA peak of the trainer, peak RSS of the process tree, which
  holds SGLang's pinned host buffer for the capture) off vs on: the overhead of capture + replay;
- bytes per token of the stored routing (ours) and of SGLang's int32 payload.
The JSON is rewritten after every run, so a run cut short still leaves what finished. Needs no network.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "mtrain" / "configs" / "tiny_llama_grpo.yaml"
MODELS = {  # name -> init-tiny arguments
    "dsv3": ["--config", str(REPO / "examples" / "deepseek_v3" / "tiny" / "gpu_config.json")],
    # Qwen3-30B-A3B's routing (128 experts, top-8, softmax + renormalised top-k) at a size that trains in seconds
    "qwen3moe": ["--arch", "qwen3_moe", "--set", "hidden_size=512", "num_hidden_layers=6", "num_attention_heads=8",
                 "num_key_value_heads=4", "head_dim=128", "num_experts=128", "num_experts_per_tok=8",
                 "moe_intermediate_size=128", "intermediate_size=1024", "vocab_size=4096",
                 "max_position_embeddings=4096", "norm_topk_prob=true"],
}
PER_STEP = ("logprob_diff/mean_abs", "logprob_diff/max_abs", "routing/disagreement", "routing/bytes_per_token",
            "routing/engine_bytes_per_token", "time/rollout", "time/logprobs", "time/train", "time/sync",
            "mem/stage0/cuda_peak_bytes_max", "mem/stage0/peak_rss_bytes_max", "reward/mean", "response_len/mean")


def _env() -> dict[str, str]:
    e = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    return e


def run_one(work: Path, model: str, replay: str, args) -> dict:
    """One training run; returns its per-step metrics and the process tree's peak RSS."""
    hf = work / model / "hf"
    if not (hf / "config.json").exists():
        subprocess.run([sys.executable, "-m", "mtrain", "init-tiny", "--out", str(hf), "--seed", "0", *MODELS[model]],
                       cwd=work, env=_env(), check=True, stdout=subprocess.DEVNULL)
    run_dir = work / model / f"run_{replay}"
    shutil.rmtree(run_dir, ignore_errors=True)
    overrides = [f"model.hf_path={hf}", f"train.run_dir={run_dir}", f"model.dtype={args.dtype}", f"engine.kind={args.engine}",
                 f"engine.mem_fraction_static={args.mem_fraction}", f"train.steps={args.steps}",
                 f"rollout.prompts_per_step={args.prompts}", f"rollout.samples_per_prompt={args.samples}",
                 f"rollout.max_new_tokens={args.new_tokens}", f"train.micro_batch_size={args.prompts * args.samples // 4}",
                 "train.save_interval=-1", "train.eval_interval=0", "train.seed=1234", "data.seed=0",
                 f"reward.fn={REPO / 'tests' / 'trainer' / 'signal_reward.py'}:digit_share",
                 f"algo.routing_replay={replay}"]
    log = work / model / f"log_{replay}.txt"
    t0 = time.perf_counter()
    with open(log, "w") as f:
        # Run outside the checkout (as benchmarks/gpu_rl_loop.sh): `-m` puts the cwd first on sys.path.
        p = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "-m", "mtrain",
                              "train", str(CONFIG), *overrides],
                             cwd=work, env=_env(), stdout=f, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t0
    rc = os.waitstatus_to_exitcode(status)
    metrics = []
    mfile = run_dir / "metrics.jsonl"
    if mfile.exists():
        for line in mfile.read_text().splitlines():
            rec = json.loads(line)
            metrics.append({k: rec[k] for k in ("step", *PER_STEP) if k in rec})
    out = {"model": model, "routing_replay": replay, "exit_code": rc, "wall_s": wall, "steps": metrics,
           "tree_max_rss_mb": usage.ru_maxrss / 1024.0}
    if rc != 0:
        out["log_tail"] = log.read_text()[-4000:]
    return out


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def summarize(off: dict, on: dict) -> dict:
    """Off vs on: gap per step, disagreement, and overheads over the steps after the first (Triton JIT)."""
    def col(run, key, skip_first=False):
        rows = run["steps"][1:] if skip_first and len(run["steps"]) > 1 else run["steps"]
        return [r[key] for r in rows if key in r]

    def step_time(run):
        rows = run["steps"][1:] if len(run["steps"]) > 1 else run["steps"]
        return _mean([r.get("time/rollout", 0) + r.get("time/logprobs", 0) + r.get("time/train", 0) for r in rows])

    s = {"gap_off": [{"step": r["step"], "mean": r.get("logprob_diff/mean_abs"), "max": r.get("logprob_diff/max_abs")}
                     for r in off["steps"]],
         "gap_on": [{"step": r["step"], "mean": r.get("logprob_diff/mean_abs"), "max": r.get("logprob_diff/max_abs")}
                    for r in on["steps"]],
         "routing_disagreement_per_step": col(on, "routing/disagreement"),
         "bytes_per_token": (col(on, "routing/bytes_per_token") or [None])[0],
         "engine_bytes_per_token": (col(on, "routing/engine_bytes_per_token") or [None])[0]}
    on_max, on_mean = col(on, "logprob_diff/max_abs"), col(on, "logprob_diff/mean_abs")
    if on_max and on_mean:
        s["goal_met"] = {"max_le_0.05": max(on_max) <= 0.05, "mean_le_0.003": max(on_mean) <= 0.003}
    t_off, t_on = step_time(off), step_time(on)
    if t_off and t_on:
        s["step_time_s"] = {"off": t_off, "on": t_on, "on_over_off": t_on / t_off}
        for k in ("time/rollout", "time/logprobs", "time/train"):
            a, b = _mean(col(off, k, True)), _mean(col(on, k, True))
            if a and b:
                s["step_time_s"][f"{k}_on_over_off"] = b / a
    for k in ("mem/stage0/cuda_peak_bytes_max", "mem/stage0/peak_rss_bytes_max"):
        a, b = col(off, k), col(on, k)
        if a and b:
            s[k.split("/")[-1] + "_off_on"] = [max(a), max(b)]
    s["tree_max_rss_mb_off_on"] = [off["tree_max_rss_mb"], on["tree_max_rss_mb"]]
    return s


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--models", default="dsv3,qwen3moe", help=f"comma list of {sorted(MODELS)}")
    ap.add_argument("--modes", default="off,rollout", help="algo.routing_replay values to run per model (off and "
                    "rollout are compared in the summary; add trainer to see the update replaying its own routing)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--mem-fraction", type=float, default=0.25)
    ap.add_argument("--work", default="/tmp/mtrain-routing-replay")
    # a dry run of the same plumbing on a CPU: --engine reference --dtype float32 (tiny sizes via --steps etc.)
    ap.add_argument("--engine", default="sglang", choices=["sglang", "reference"])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = ap.parse_args()
    models = [m for m in args.models.split(",") if m]
    bad = [m for m in models if m not in MODELS]
    if bad:
        ap.error(f"unknown models {bad}; known: {sorted(MODELS)}")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    import torch
    result = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
              "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
              "settings": vars(args), "runs": [], "summary": {}}
    for model in models:
        runs = {}
        for replay in [m for m in args.modes.split(",") if m]:
            r = run_one(work, model, replay, args)
            runs[replay] = r
            result["runs"].append(r)
            print(f"== {model} replay={replay}: exit {r['exit_code']}, {len(r['steps'])} steps, {r['wall_s']:.0f} s",
                  flush=True)
            for s in r["steps"]:
                print("   ", {k: (round(v, 5) if isinstance(v, float) else v) for k, v in s.items()
                              if k.startswith(("step", "logprob", "routing/dis", "time/"))}, flush=True)
            out.write_text(json.dumps(result, indent=1))
        if runs.get("off", {}).get("steps") and runs.get("rollout", {}).get("steps"):
            result["summary"][model] = summarize(runs["off"], runs["rollout"])
            print(json.dumps({model: result["summary"][model]}, indent=1), flush=True)
        out.write_text(json.dumps(result, indent=1))
    return 0 if all(r["exit_code"] == 0 for r in result["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
