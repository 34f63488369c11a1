"""Turn a finished `examples/smollm2_tools/run.sh` run into RUN_DIR/summary.json and RUN_DIR/summary.png.

    python examples/smollm2_tools/summarize.py RUN_DIR --wall-s 1234 --command "bash examples/smollm2_tools/run.sh"

Every number comes from RUN_DIR/metrics.jsonl as the trainer wrote it. Key names: the trainer prefixes the
multi-turn group metrics with "tools/" (so the tool-call rate is "tools/tools/call_rate") and the eval's with
"eval/tools/".
"""
from __future__ import annotations

import datetime
import importlib.util
import os
import platform
from pathlib import Path

from mtrain.metrics import read_metrics

# the machine line and the atomic write are the addition demo's (examples/smollm2/summarize.py)
_spec = importlib.util.spec_from_file_location("smollm2_summarize", Path(__file__).parents[1] / "smollm2" / "summarize.py")
_base = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_base)

CALL, VALID, ERR = "tools/tools/call_rate", "tools/tools/valid_rate", "tools/tools/error_rate"
EVAL_KEYS = {"accuracy": "eval/reward_mean", "tool_call_rate": f"eval/{CALL}", "valid_call_rate": f"eval/{VALID}",
             "drift_tokens": "eval/tools/traj/drift/tokens"}
TRAIN_KEYS = {"reward": "reward/mean", "tool_call_rate": CALL, "valid_call_rate": VALID,
              "tool_errors_per_call": ERR, "drift_tokens": "tools/traj/drift/tokens",
              "logprob_diff_max_abs": "logprob_diff/max_abs", "model_tokens": "tools/traj/model_tokens"}
PLOT_KEYS = ("reward/mean", CALL, VALID, "logprob_diff/max_abs")  # eval/reward_mean is drawn over reward/mean


def summarize(run_dir: Path, wall_s: float, command: str) -> dict:
    records = read_metrics(run_dir)
    evals = [r for r in records if "eval/reward_mean" in r]
    train = [r for r in records if "reward/mean" in r]
    if not evals or evals[0]["step"] != 0 or not train:
        raise SystemExit(f"{run_dir}: need an eval at step 0 (val_before_train) and training steps; got evals at "
                         f"{[r['step'] for r in evals]} and {len(train)} training steps")
    cfg = __import__("yaml").safe_load((run_dir / "config.yaml").read_text())
    k = max(1, len(train) // 3)  # first vs last third of the steps: single steps are noisy

    def mean(rows, key):
        vals = [r[key] for r in rows if key in r]
        return sum(vals) / len(vals) if vals else None

    step_times = [sum(r.get(f"time/{p}", 0.0) for p in ("rollout", "logprobs", "train", "sync")) for r in train]
    return {
        "what": "GRPO, SmolLM2-135M-Instruct learns to call the calculator (3-digit products); mtrain train: "
                "Megatron-core on CPU, CPU reference engine, multi-turn tool rollouts (multi_turn.rollout_fn)",
        "eval_metric": "greedy multi-turn rollout on the held-out prompts; accuracy = exact match of the final turn",
        "eval_prompts": sum(1 for line in Path(cfg["data"]["eval_path"]).read_text().splitlines() if line.strip()),
        "evals": [{"step": r["step"], **{name: r.get(key) for name, key in EVAL_KEYS.items()}} for r in evals],
        "train_first_steps": {"steps": [r["step"] for r in train[:k]],
                              **{name: mean(train[:k], key) for name, key in TRAIN_KEYS.items()}},
        "train_last_steps": {"steps": [r["step"] for r in train[-k:]],
                             **{name: mean(train[-k:], key) for name, key in TRAIN_KEYS.items()}},
        "train_per_step": [{"step": r["step"], **{name: r.get(key) for name, key in TRAIN_KEYS.items()}}
                           for r in train],
        "samples_per_step": cfg["rollout"]["prompts_per_step"] * cfg["rollout"]["samples_per_prompt"],
        "mean_step_s": sum(step_times) / len(step_times),
        "mean_times_s": {p: mean(train, f"time/{p}") for p in ("rollout", "logprobs", "train", "sync")},
        "wall_time_s": round(wall_s, 1),
        "machine": f"{os.cpu_count()} CPU cores ({_base._cpu_model()}), no GPU, shared with other jobs; "
                   f"{platform.system()} {platform.machine()}, Python {platform.python_version()}",
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": command,
        "config": cfg,
    }


def main() -> None:
    _base.main(summarize, PLOT_KEYS, hide=("config", "train_per_step"), description=__doc__)


if __name__ == "__main__":
    main()
