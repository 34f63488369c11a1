"""One torchrun job that alternates synchronous and partial-rollout steps on the same trainer, engine and GPU.

    torchrun --nproc-per-node 1 benchmarks/partial_ab_worker.py --plan PLAN OUT.jsonl CONFIG.yaml [key=value ...]

Launched by benchmarks/bench_partial_rollout.py (read that for the workload). The config has rollout.partial=true;
a synchronous step is the trainer's own synchronous path (its rollout source swapped for a `SynchronousSource`
for that step), so both modes share the process, the engine, its caches, the weights' size and the GPU's state: an
interleaved A/B whose repeats give the ratio's spread without paying a start-up per repeat. PLAN is a comma list of MODE:STEPS blocks, e.g.
"s:1,p2:2,s:3,p2:3,p4:3" (s = synchronous; pX = partial with rollout.over_sample X). The partial buffer survives
the other blocks (its versions age by their steps: see the bench for rollout.max_staleness). Rank 0 writes one JSON line per
step: the block, the mode, the step's wall time and every metric the trainer logs.
"""
from __future__ import annotations

import argparse
import json
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("config")
    ap.add_argument("--plan", required=True)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    plan = []
    for block in args.plan.split(","):
        mode, steps = block.split(":")
        if not (mode == "s" or (mode[:1] == "p" and float(mode[1:]) >= 1)) or int(steps) < 1:
            raise SystemExit(f"--plan: blocks are s:N or pX:N (X = over_sample >= 1, N >= 1), got {block!r}")
        plan.append((mode, int(steps)))

    from mtrain.config import load_config
    from mtrain.preflight import preflight
    from mtrain.run_output import quiet_known_warnings
    quiet_known_warnings()
    cfg = load_config(args.config, args.overrides)
    if not cfg.rollout.partial:
        raise SystemExit("partial_ab_worker: the config needs rollout.partial=true (synchronous steps set it aside)")
    preflight(cfg)
    from mtrain.trainer.loop import Trainer
    trainer = Trainer(cfg)
    from mtrain.trainer.sources.base import SynchronousSource
    partial, synchronous = trainer.source, SynchronousSource(trainer)  # the rollout-source role, swapped per block
    out = open(args.out, "w") if trainer.rank == 0 else None
    try:
        for b, (mode, steps) in enumerate(plan):
            trainer.source = partial if mode != "s" else synchronous
            if mode != "s":
                cfg.rollout.over_sample = float(mode[1:])  # read by every partial step
            for _ in range(steps):
                t0 = time.perf_counter()
                m = trainer.train_step()
                wall = time.perf_counter() - t0
                if out is not None:
                    over = cfg.rollout.over_sample if mode != "s" else None
                    out.write(json.dumps({"block": b, "mode": mode, "over_sample": over, "step": trainer.step,
                                          "wall_s": wall, **m}) + "\n")
                    out.flush()
    finally:
        trainer.source = partial
        trainer.close()
        if out is not None:
            out.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
