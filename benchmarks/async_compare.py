"""Compare runs of the same config with rollout.async=off, one_step and stream from their metrics.jsonl files.

    python benchmarks/async_compare.py --off RUN_DIR [...] --one-step RUN_DIR [...] [--stream RUN_DIR ...] [--skip 1]

Prints, per mode (mean and spread over the given runs, e.g. seeds): the step time (time/rollout + time/logprobs +
time/train + time/sync + perf/train_wait_s, the trainer's wait for the background rollout), trained tokens/s
(response tokens of a step / its step time), the overlap metrics, and the reward curve (per step, mean over runs),
then the ratio one_step / off (and stream / off) of step time and tokens/s. --skip leaves out the first records (warm-up) from the timing.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

PHASES = ("time/rollout", "time/logprobs", "time/train", "time/sync")


def records(run: Path) -> list[dict]:
    out = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [r for r in out if "weight_version" in r]


def step_seconds(r: dict) -> float:
    """The step's wall time: its phases (time/rollout is the take; in one_step mode it is ~0 once a rollout was
    generated ahead, and perf/train_wait_s is the trainer's wait for the background rollout before the sync). In
    stream mode (records with rollout/pause_s) perf/train_wait_s is the wait for a finished batch, inside
    time/rollout, and the in-place update is inside time/sync."""
    wait = 0.0 if "rollout/pause_s" in r else r.get("perf/train_wait_s", 0.0)
    return sum(r.get(k, 0.0) for k in PHASES) + wait


def rollout_rows(run: Path) -> int:
    """Samples per step, from the run's saved config."""
    import yaml
    r = yaml.safe_load((run / "config.yaml").read_text())["rollout"]
    return r["prompts_per_step"] * r["samples_per_prompt"]


def summarize(runs: list[Path], skip: int) -> dict:
    per_run = [records(r) for r in runs]
    times = [statistics.mean(step_seconds(r) for r in recs[skip:]) for recs in per_run]
    rows = [rollout_rows(r) for r in runs]
    tps = [statistics.mean(r["response_len/mean"] * n / step_seconds(r) for r in recs[skip:])
           for recs, n in zip(per_run, rows)]
    curves = [[r["reward/mean"] for r in recs] for recs in per_run]
    n = min(len(c) for c in curves)
    out = {"runs": len(runs), "step_s": statistics.mean(times),
           "step_s_spread": statistics.pstdev(times) if len(times) > 1 else 0.0,
           "trained_tokens_per_s": statistics.mean(tps),
           "reward_curve": [statistics.mean(c[i] for c in curves) for i in range(n)],
           "reward_last_half": statistics.mean(statistics.mean(c[n // 2:n]) for c in curves),
           "reward_last_half_spread": statistics.pstdev([statistics.mean(c[n // 2:n]) for c in curves])
           if len(curves) > 1 else 0.0}
    for k in ("perf/engine_busy_frac", "perf/train_wait_s", "perf/overlap_s", "rollout/version_lag_mean",
              "rollout/staleness_max", "rollout/staleness_mean", "rollout/pause_s", "rollout/aborted_per_update"):
        vals = [r[k] for recs in per_run for r in recs[skip:] if k in r]
        if vals:
            out[k] = statistics.mean(vals)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--off", nargs="+", type=Path, required=True)
    ap.add_argument("--one-step", nargs="+", type=Path, required=True)
    ap.add_argument("--stream", nargs="*", type=Path, default=[])
    ap.add_argument("--skip", type=int, default=1)
    a = ap.parse_args()
    res = {"off": summarize(a.off, a.skip), "one_step": summarize(a.one_step, a.skip)}
    res["step_time_ratio_one_step_over_off"] = res["one_step"]["step_s"] / res["off"]["step_s"]
    res["speedup_one_step"] = res["off"]["step_s"] / res["one_step"]["step_s"]
    res["tokens_per_s_ratio_one_step_over_off"] = (res["one_step"]["trained_tokens_per_s"]
                                                   / res["off"]["trained_tokens_per_s"])
    if a.stream:
        res["stream"] = summarize(a.stream, a.skip)
        res["step_time_ratio_stream_over_off"] = res["stream"]["step_s"] / res["off"]["step_s"]
        res["speedup_stream"] = res["off"]["step_s"] / res["stream"]["step_s"]
        res["tokens_per_s_ratio_stream_over_off"] = (res["stream"]["trained_tokens_per_s"]
                                                     / res["off"]["trained_tokens_per_s"])
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
