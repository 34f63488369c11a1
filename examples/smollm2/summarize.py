"""Turn a finished demo run into RUN_DIR/summary.json (measured numbers) and RUN_DIR/summary.png (mtrain/run_files.py's
SUMMARY_FILE and SUMMARY_PLOT).

    python examples/smollm2/summarize.py RUN_DIR --wall-s 1234 --command "bash examples/smollm2/run.sh"

The committed docs/smollm2_demo.{json,png} change only by the explicit `bash examples/smollm2/update_docs.sh RUN_DIR`.

Every number comes from RUN_DIR/metrics.jsonl as the trainer wrote it; nothing here is typed in by hand.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import tempfile
from pathlib import Path

from mtrain.fileperm import chmod_umask
from mtrain.metrics import read_metrics
from mtrain.plot import plot_run
from mtrain.run_files import SUMMARY_FILE, SUMMARY_PLOT

# mtrain.plot overlays eval/reward_mean on the reward/mean panel; no KL panel: the demo runs with kl_coef 0.
PLOT_KEYS = ("reward/mean", "response_len/mean", "logprob_diff/max_abs")


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _engine_words(cfg: dict) -> str:
    """What ran the rollouts and the training, from the run's own config (the same script sums up CPU and GPU runs)."""
    engine = cfg.get("engine", {})
    kind = "SGLang" if engine.get("kind") == "sglang" else "the CPU reference engine"
    return f"{kind} + Megatron-core ({cfg.get('model', {}).get('dtype', 'bfloat16')} training)"


def _machine_words() -> str:
    """The machine this summary is written on (the run's own machine: run.sh calls it at the end of the run)."""
    try:
        import torch

        if torch.cuda.is_available():
            names = sorted({torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())})
            return f"{torch.cuda.device_count()} x {', '.join(names)}, {os.cpu_count()} CPU cores"
    except Exception:  # a torch without CUDA support, or a driver that cannot answer: say what is certain
        pass
    return f"{os.cpu_count()} CPU cores ({_cpu_model()}), no GPU, shared with other jobs"


def summarize(run_dir: Path, wall_s: float, command: str) -> dict:
    records = read_metrics(run_dir)
    evals = [(r["step"], r["eval/reward_mean"]) for r in records if "eval/reward_mean" in r]
    train = [(r["step"], r["reward/mean"]) for r in records if "reward/mean" in r]
    if not evals or evals[0][0] != 0 or not train:
        raise SystemExit(f"{run_dir}: need an eval at step 0 (val_before_train) and training steps; "
                         f"got evals at {[s for s, _ in evals]} and {len(train)} training steps")
    cfg = json.loads(json.dumps(__import__("yaml").safe_load((run_dir / "config.yaml").read_text())))
    k = max(1, len(train) // 4)  # first vs last quarter of the steps: single steps are noisy
    first = [v for _, v in train[:k]]
    last = [v for _, v in train[-k:]]
    step_times = [sum(r.get(f"time/{p}", 0.0) for p in ("rollout", "logprobs", "train", "sync"))
                  for r in records if "reward/mean" in r]
    return {
        "what": f"GRPO on two-number addition, SmolLM2-135M-Instruct, {_engine_words(cfg)}",
        "eval_metric": "eval/reward_mean: exact match of the greedy answer on held-out prompts",
        "eval_prompts": cfg["data"]["arithmetic"]["num_eval"],
        "accuracy_before": evals[0][1],
        "accuracy_after": evals[-1][1],
        "accuracy_after_step": evals[-1][0],
        "eval_curve": [{"step": s, "accuracy": v} for s, v in evals],
        "train_reward_first_quarter_mean": sum(first) / len(first),
        "train_reward_last_quarter_mean": sum(last) / len(last),
        "train_reward_per_step": [v for _, v in train],
        "steps": train[-1][0],
        "samples_per_step": cfg["rollout"]["prompts_per_step"] * cfg["rollout"]["samples_per_prompt"],
        "mean_step_s": sum(step_times) / len(step_times),
        "wall_time_s": round(wall_s, 1),
        "machine": f"{_machine_words()}; {platform.system()} {platform.machine()}, Python {platform.python_version()}",
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": command,
        "config": cfg,
    }


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    chmod_umask(tmp)  # mkstemp makes 0600
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def main(summarize_fn=None, plot_keys=None, hide: tuple[str, ...] = ("config",), description: str | None = None
         ) -> None:
    """The summary command line; the tool demo's summarize.py calls it with its own summary and plot keys."""
    summarize_fn, plot_keys = summarize_fn or summarize, plot_keys or PLOT_KEYS
    p = argparse.ArgumentParser(description=description or __doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("run_dir", type=Path)
    p.add_argument("--wall-s", type=float, required=True)
    p.add_argument("--command", required=True)
    p.add_argument("--json", type=Path, default=None, help=f"default RUN_DIR/{SUMMARY_FILE}")
    p.add_argument("--png", type=Path, default=None, help=f"default RUN_DIR/{SUMMARY_PLOT}")
    args = p.parse_args()
    # in the run dir under run_files' names: a train.resume=never start sets them aside with the run they sum up
    args.json = args.json or args.run_dir / SUMMARY_FILE
    args.png = args.png or args.run_dir / SUMMARY_PLOT
    summary = summarize_fn(args.run_dir, args.wall_s, args.command)
    _write_atomic(args.json, json.dumps(summary, indent=2) + "\n")
    plot_run(args.run_dir, args.png, keys=plot_keys)
    # On screen only the single figures, one per line; the curves, the config and the command are in the JSON.
    for k, v in summary.items():
        if k not in hide and not isinstance(v, (list, dict)) and k != "command":
            print(f"{k}: {round(v, 4) if isinstance(v, float) else v}")
    print(f"results: {args.json}, {args.png}")


if __name__ == "__main__":
    main()
