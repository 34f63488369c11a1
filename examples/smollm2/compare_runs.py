"""Side-by-side learning curves of several runs of the SmolLM2 addition task (GRPO teacher, distillation student,
PPO, ...): held-out accuracy per eval step, distill/reverse_kl per step, the median step-time split, and the first
eval step at which each run reaches a target accuracy (by default the first run's final eval, the teacher's).
    python examples/smollm2/compare_runs.py NAME=RUN_DIR [NAME=RUN_DIR ...] [--target ACC] [--base RUN_DIR] [--out DIR]
Prints one JSON line per run; with --out also writes DIR/summary.json and DIR/curves.png (matplotlib).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from mtrain.metrics import read_metrics
from mtrain.run_files import SUMMARY_FILE

SPLIT = ("rollout", "logprobs", "train", "sync")


def run_summary(name: str, run_dir: str, target: float | None, base: dict | None = None) -> dict:
    recs = read_metrics(run_dir)
    evals = [{"step": r["step"], "accuracy": r["eval/reward_mean"]} for r in recs if "eval/reward_mean" in r]
    if base is not None and not any(e["step"] == 0 for e in evals):  # a run that skipped val_before_train
        evals.insert(0, base)
    steps = [r for r in recs if "weight_version" in r]  # one record per training step
    out = {"name": name, "run_dir": str(run_dir), "eval_curve": evals,
           "train_reward_per_step": [r.get("reward/mean") for r in steps],
           "median_step_split_s": {k: statistics.median(r.get(f"time/{k}", 0.0) for r in steps) for k in SPLIT}
           if steps else {}}
    for key in ("distill/reverse_kl", "critic/value_loss", "critic/explained_var"):
        if any(key in r for r in steps):
            out[key.replace("/", "_") + "_per_step"] = [r.get(key) for r in steps]
    if target is not None:
        out["target_accuracy"] = target
        out["first_step_at_target"] = next((e["step"] for e in evals if e["accuracy"] >= target - 1e-9), None)
    cfg = Path(run_dir) / SUMMARY_FILE
    if cfg.is_file():  # examples/smollm2/summarize.py's file: the resolved config and the command
        s = json.loads(cfg.read_text())
        out.update({k: s[k] for k in ("command", "wall_time_s", "mean_step_s", "config") if k in s})
    return out


def plot(runs: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    kl_runs = [r for r in runs if "distill_reverse_kl_per_step" in r]
    fig, axes = plt.subplots(1, 2 if kl_runs else 1, figsize=(11 if kl_runs else 6, 4), squeeze=False)
    ax = axes[0][0]
    for r in runs:
        ax.plot([e["step"] for e in r["eval_curve"]], [e["accuracy"] for e in r["eval_curve"]], "o-", label=r["name"])
    if runs and runs[0].get("target_accuracy") is not None:
        ax.axhline(runs[0]["target_accuracy"], color="grey", ls=":", label="target")
    ax.set(xlabel="step", ylabel="held-out accuracy (greedy exact match)", title="eval/reward_mean")
    ax.legend()
    if kl_runs:
        ax = axes[0][1]
        for r in kl_runs:
            kl = r["distill_reverse_kl_per_step"]
            ax.plot(range(1, len(kl) + 1), kl, ".-", label=r["name"])
        ax.set(xlabel="step", ylabel="mean per-token log p_s - log p_t", title="distill/reverse_kl")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _rounded(x):
    if isinstance(x, float):
        return round(x, 4)
    if isinstance(x, dict):
        return {k: _rounded(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_rounded(v) for v in x]
    return x


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("runs", nargs="+", help="NAME=RUN_DIR; the first is the reference (teacher) run")
    ap.add_argument("--target", type=float, default=None, help="accuracy to reach (default: first run's final eval)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--base", default=None, help="RUN_DIR of a run of the same base model and eval set whose step-0 "
                    "eval is prepended (marked from_base_run) to runs that skipped val_before_train")
    args = ap.parse_args(argv)
    pairs = []
    for spec in args.runs:
        name, sep, path = spec.partition("=")
        if not sep or not Path(path, "metrics.jsonl").is_file():
            sys.exit(f"compare_runs: error: {spec!r}: want NAME=RUN_DIR with a metrics.jsonl")
        pairs.append((name, path))
    target = args.target
    if target is None:
        first = [r["eval/reward_mean"] for r in read_metrics(pairs[0][1]) if "eval/reward_mean" in r]
        target = first[-1] if first else None
    base = None
    if args.base:
        base = next(({"step": 0, "accuracy": r["eval/reward_mean"], "from_base_run": args.base}
                     for r in read_metrics(args.base) if r.get("step") == 0 and "eval/reward_mean" in r), None)
        if base is None:
            sys.exit(f"compare_runs: error: --base {args.base}: no eval at step 0 in its metrics.jsonl")
    runs = [run_summary(n, p, target, base) for n, p in pairs]
    for r in runs:
        brief = {k: v for k, v in r.items() if k not in ("config", "train_reward_per_step", "command")}
        print(json.dumps(_rounded(brief)))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "summary.json").write_text(json.dumps({"runs": runs}, indent=2) + "\n")
        plot(runs, out / "curves.png")
        print(f"wrote {out / 'summary.json'}, {out / 'curves.png'}")


if __name__ == "__main__":
    main()
