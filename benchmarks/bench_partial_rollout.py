"""Synchronous vs partial rollout on a heavy-tailed length task: trained tokens per second, step time, reward.

    python benchmarks/bench_partial_rollout.py --hf DIR [--nproc 1] [--steps 6] [key=value ...]

Runs `torchrun -m mtrain train` twice with the same config (the `longtail` task: "count from 1 to N", N log-normal,
per-sample token budgets, so a model that rarely emits EOS produces heavy-tailed lengths): once synchronous, once
with rollout.partial=true (over-sampling, abort at the quota, resume next step; off-policy tokens kept with TIS).
Reports, from each run's metrics.jsonl, the trained response tokens per second of step time (rollout + logprobs +
train + sync, steps after the first), the median step time, their ratio (partial / sync) measured in the same
invocation, and both reward curves over the same steps. Writes $OUT/bench_partial_rollout.json when OUT is set.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "mtrain" / "configs" / "tiny_llama_grpo.yaml"
STEP_KEYS = ("time/rollout", "time/logprobs", "time/train", "time/sync")


def run(name: str, hf: str, work: Path, nproc: int, steps: int, extra: list[str]) -> list[dict]:
    run_dir = work / name
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), "-m",
           "mtrain", "train", str(CONFIG), f"model.hf_path={hf}", f"train.run_dir={run_dir}", f"train.steps={steps}",
           "train.save_interval=0", "train.eval_interval=0", "train.resume=never", "data.task=longtail",
           "reward.fn=mtrain.data.longtail:count_reward", *extra]
    p = subprocess.run(cmd, cwd=work, capture_output=True, text=True)
    (work / f"log_{name}.txt").write_text(p.stdout[-20000:] + p.stderr[-20000:])
    if p.returncode != 0:
        raise SystemExit(f"{name} failed ({p.returncode}):\n{p.stderr[-4000:]}")
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if line.strip() and "weight_version" in line]


def summary(recs: list[dict], rows: int) -> dict:
    timed = recs[1:]  # step 1 carries start-up costs (kernel JIT, first sync of sources)
    step_s = [sum(r.get(k, 0.0) for k in STEP_KEYS) for r in timed]
    tokens = [r["response_len/mean"] * rows for r in timed]
    return {"trained_tokens_per_s": sum(tokens) / sum(step_s), "step_s_median": statistics.median(step_s),
            "step_s": step_s, "reward": [r["reward/mean"] for r in recs],
            "response_len": [r["response_len/mean"] for r in recs],
            "offpolicy_token_frac": [r.get("rollout/offpolicy_token_frac") for r in recs],
            "resumed": [r.get("rollout/resumed") for r in recs]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hf", required=True, help="HF model dir (e.g. from `mtrain init-tiny`)")
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--over-sample", type=float, default=2.0)
    ap.add_argument("overrides", nargs="*", help="key=value for both runs")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="mtrain-partial-"))
    common = [f"rollout.prompts_per_step={args.prompts}", f"rollout.samples_per_prompt={args.samples}",
              f"train.micro_batch_size={args.samples}", "algo.tis_cap=2.0", *args.overrides]
    rows = args.prompts * args.samples
    sync = summary(run("sync", args.hf, work, args.nproc, args.steps, common), rows)
    part = summary(run("partial", args.hf, work, args.nproc, args.steps,
                       common + ["rollout.partial=true", f"rollout.over_sample={args.over_sample}",
                                 "rollout.offpolicy=tis", "rollout.max_staleness=4"]), rows)
    res = {"sync": sync, "partial": part, "args": vars(args),
           "ratio_trained_tokens_per_s": part["trained_tokens_per_s"] / sync["trained_tokens_per_s"],
           "ratio_step_time": sync["step_s_median"] / part["step_s_median"]}
    print(f"trained tokens/s: sync {sync['trained_tokens_per_s']:.0f}, partial {part['trained_tokens_per_s']:.0f} "
          f"-> {res['ratio_trained_tokens_per_s']:.2f}x; median step {sync['step_s_median']:.2f} s vs "
          f"{part['step_s_median']:.2f} s")
    print("reward/mean per step  sync:   " + " ".join(f"{x:.3f}" for x in sync["reward"]))
    print("reward/mean per step  partial:" + " ".join(f"{x:.3f}" for x in part["reward"]))
    print("off-policy token share (partial): " + " ".join(f"{x:.2f}" for x in part["offpolicy_token_frac"]))
    out = os.environ.get("OUT")
    if out:
        Path(out, "bench_partial_rollout.json").write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
