"""A model (not a measurement) of synchronous vs partial rollout on the longtail task, to read the H200 numbers.

    python benchmarks/sim_partial_rollout.py [--step-ms 4.0] [--per-request-us 8] [--fixed-s 0.5] [--steps 40]

Decode steps advance every running request by one token; a step takes step_ms + per_request_us x running requests
(an engine without CUDA graphs on a tiny model is launch-bound: the per-request term is the scheduler's Python).
Every sample of a group has the group's length min(6 N, max_new_tokens), N ~ LogNormal(log 20, 1) clipped to
[1, 400] (what a random model generates on `data.task=longtail`). The pool runs at most `slots` groups at once and
refills a freed slot from its queue. Synchronous: the step's groups, to the last. Partial: the buffer first, then fresh
groups; stops when `quota` groups finished; unfinished ones keep their tokens. Prefill, abort latency and sampling
are left out. Each training step also costs fixed_s (logprobs + train + weight sync). Prints trained tokens/s of each
configuration and its ratio to the synchronous one with the same slots.
"""
from __future__ import annotations

import argparse
import math
import random


def lengths(rng: random.Random, k: int, cap: int) -> list[int]:
    return [min(cap, max(8, 6 * int(min(400, max(1, round(rng.lognormvariate(math.log(20), 1.0))))))) for _ in range(k)]


def run_pool(groups: list[list[int]], slots: int, quota: int | None, n: int, a: float, c: float
             ) -> tuple[float, list[int]]:
    """groups: [done, length] per group (mutated). Returns (seconds, indices of the groups that finished, in
    order). quota None: run all."""
    queue = list(range(len(groups)))
    running: list[int] = []
    finished: list[int] = []
    t = 0.0
    while queue or running:
        while queue and len(running) < slots:
            running.append(queue.pop(0))
        if not running:
            break
        # advance to the next group completion in one go (the batch does not change in between)
        k = min(groups[i][1] - groups[i][0] for i in running)
        t += k * (a + c * n * len(running))
        for i in running:
            groups[i][0] += k
        for i in [i for i in running if groups[i][0] >= groups[i][1]]:
            running.remove(i)
            finished.append(i)
            if quota is not None and len(finished) >= quota:
                return t, finished
    return t, finished


def simulate(mode: str, slots: int, over: float, steps: int, args, reserve: bool = True, seed: int = 0) -> float:
    rng = random.Random(seed)
    quota, n = args.prompts, args.samples
    a, c = args.step_ms / 1000, args.per_request_us / 1e6
    buffer: list[list[int]] = []
    tokens = seconds = 0.0
    for s in range(steps):
        if mode == "sync":
            gs = [[0, x] for x in lengths(rng, quota, args.max_new_tokens)]
            t, done = run_pool(gs, slots, None, n, a, c)
        else:
            target = math.ceil(quota * over)
            want = target + quota if reserve else target
            gs = buffer + [[0, x] for x in lengths(rng, max(0, want - len(buffer)), args.max_new_tokens)]
            t, done = run_pool(gs, slots, quota, n, a, c)
            buffer = [g for i, g in enumerate(gs) if i not in set(done)]
        if s >= 2:  # past the ramp-up of the buffer
            tokens += sum(gs[i][1] for i in done[:quota]) * n
            seconds += t + args.fixed_s
    return tokens / seconds


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--step-ms", type=float, default=4.0)
    ap.add_argument("--per-request-us", type=float, default=8.0)
    ap.add_argument("--fixed-s", type=float, default=0.5)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=1024)
    args = ap.parse_args()
    # (sync slots, [(partial slots, over_sample, reserve)]): the 2026-11-30 H200 run (max_groups_in_flight=16 in both
    # modes, 64 groups issued, no reserve), then every group in flight (this branch's bench).
    for slots_sync, configs in ((16, [(16, 2.0, False)]),
                                (32, [(32, 1.0, True), (64, 2.0, False), (64, 2.0, True), (128, 4.0, True)])):
        sync = simulate("sync", slots_sync, 1.0, args.steps, args)
        print(f"sync, {slots_sync} groups in flight: {sync:.0f} trained tokens/s")
        for slots, over, reserve in configs:
            p = simulate("partial", slots, over, args.steps, args, reserve)
            print(f"  partial over_sample={over:g}, {slots} in flight, reserve {'on' if reserve else 'off'}: "
                  f"{p:.0f} tokens/s -> {p / sync:.2f}x")


if __name__ == "__main__":
    main()
