"""Synchronous vs partial rollout on a heavy-tailed length task: trained tokens per second with its spread, where
each mode's step time goes, and (optionally) both reward curves on a model that can learn.

    python benchmarks/bench_partial_rollout.py --hf DIR [--nproc 1] [--repeats 3] [--block 3] [--over-sample 2,4]
        [--learn-steps 0 --learn-hf DIR] [key=value ...]

Workload: `data.task=longtail` ("count from 1 to N", N log-normal with median data.longtail.median_count and sigma 1,
every sample capped at 6 N tokens and at rollout.max_new_tokens), `reward.fn=mtrain.data.longtail:count_reward`,
--prompts groups of --samples per step. A model that rarely emits EOS (a random one) generates exactly the capped,
heavy-tailed lengths; both modes see the same task, config and prompts distribution.

Speed (one torchrun job, benchmarks/partial_ab_worker.py): the same trainer alternates blocks of --block steps:
synchronous, then partial rollout at each --over-sample value, --repeats times, after one warm-up step of each
(JIT, an empty buffer). Both modes run with rollout.max_groups_in_flight = ceil(prompts x max over-sample), so the
synchronous step has all its groups in flight at once (its best case) and a partial step keeps
ceil(prompts x over_sample) in flight. Partial: offpolicy=tis (algo.tis_cap=2); rollout.max_staleness is off in the
A/B job because the interleaved blocks age the buffer by steps that are not its own (drops are reported anyway).
Per repeat r: ratio = (trained tokens / wall time of partial block r) / (same of synchronous block r); reported as
median and range. Trained tokens = response tokens of the rows trained (prompts x samples per step, both modes).
Wall time = the whole `train_step` (rollout, logprobs, train, weight sync, bookkeeping).

Learning (--learn-steps N > 0): two separate `mtrain train` runs from the same weights (--learn-hf), synchronous and
partial (over-sample = the first --over-sample, max_staleness=4), reward/mean per step of each.

Writes $OUT/bench_partial_rollout.json (--json) when OUT is set.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "mtrain" / "configs" / "tiny_llama_grpo.yaml"
PHASES = ("time/rollout", "time/logprobs", "time/train", "time/sync")
PARTIAL_KEYS = ("time/rollout_pool", "time/rollout_bookkeeping", "time/abort_wait", "rollout/groups_started",
                "rollout/resumed", "rollout/resume_prefill_tokens", "rollout/offpolicy_token_frac",
                "rollout/buffered_groups", "rollout/dropped_stale_groups", "rollout/groups_in_flight")
TASK = ["data.task=longtail", "reward.fn=mtrain.data.longtail:count_reward", "train.save_interval=-1",
        "train.eval_interval=0", "train.resume=never"]


def torchrun(nproc: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]


def check(p: subprocess.CompletedProcess, name: str, work: Path) -> None:
    (work / f"log_{name}.txt").write_text(p.stdout[-20000:] + p.stderr[-20000:])
    if p.returncode != 0:
        raise SystemExit(f"{name} failed ({p.returncode}):\n{p.stderr[-4000:]}")


def mean(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def breakdown(recs: list[dict]) -> dict:
    """Mean per step of the wall time, each phase, what is left (wall - phases), and the rollout's own metrics."""
    out = {"steps": len(recs), "wall_s": mean(r["wall_s"] for r in recs)}
    for k in PHASES:
        out[k] = mean(r.get(k, 0.0) for r in recs)
    out["other_s"] = out["wall_s"] - sum(out[k] for k in PHASES)
    out["tail_wait_frac"] = mean(r.get("perf/tail_wait_frac") for r in recs) or 0.0
    # slot-seconds empty per engine slot: the tail's cost in seconds of rollout
    out["tail_wait_s"] = mean(r.get("perf/tail_wait_frac", 0.0) * r.get("time/rollout_pool", r["time/rollout"])
                              for r in recs)
    out["response_len"] = mean(r["response_len/mean"] for r in recs)
    for k in PARTIAL_KEYS:
        if any(k in r for r in recs):
            out[k] = mean(r.get(k) for r in recs)
    return out


def speed(args, work: Path, common: list[str]) -> dict:
    overs = [float(o) for o in args.over_sample]
    tag = {o: f"p{o:g}" for o in overs}
    warm = [("s", 1)] + [(tag[o], 1) for o in overs]
    plan = warm + [("s", args.block)] + [(tag[o], args.block) for o in overs]
    plan = warm + (plan[len(warm):]) * args.repeats
    rows = args.prompts * args.samples
    in_flight = math.ceil(args.prompts * max(overs))
    # under $OUT when set: the steps written so far survive a run cut short by a time limit
    out_jsonl = Path(os.environ["OUT"], "partial_ab_steps.jsonl") if os.environ.get("OUT") else work / "ab.jsonl"
    out_jsonl.parent.mkdir(parents=True, exist_ok=True)
    cmd = torchrun(args.nproc) + [str(REPO / "benchmarks" / "partial_ab_worker.py"), "--plan",
                                  ",".join(f"{m}:{k}" for m, k in plan), str(out_jsonl), str(CONFIG),
                                  f"model.hf_path={args.hf}",
                                  f"train.run_dir={work / 'ab'}", f"train.steps={sum(k for _, k in plan)}", *TASK,
                                  *common, f"rollout.max_groups_in_flight={in_flight}", "rollout.partial=true",
                                  "rollout.offpolicy=tis", "rollout.max_staleness=null"]
    check(subprocess.run(cmd, cwd=work, capture_output=True, text=True), "ab", work)
    recs = [json.loads(line) for line in out_jsonl.read_text().splitlines() if line.strip()]
    timed = [r for r in recs if r["block"] >= len(warm)]
    blocks: dict[int, list[dict]] = {}
    for r in timed:
        blocks.setdefault(r["block"], []).append(r)

    def tps(b: list[dict]) -> float:
        return sum(r["response_len/mean"] * rows for r in b) / sum(r["wall_s"] for r in b)

    sync_blocks = [b for _, b in sorted(blocks.items()) if b[0]["mode"] == "s"]
    res = {"plan": plan, "in_flight_groups_max": in_flight, "sync": breakdown([r for b in sync_blocks for r in b]),
           "sync_tokens_per_s": [tps(b) for b in sync_blocks], "partial": {}}
    for o in overs:
        pb = [b for _, b in sorted(blocks.items()) if b[0]["mode"] == tag[o]]
        ratios = [tps(p) / tps(s) for p, s in zip(pb, sync_blocks)]
        res["partial"][f"{o:g}"] = {"breakdown": breakdown([r for b in pb for r in b]),
                                    "tokens_per_s": [tps(b) for b in pb], "ratios": ratios,
                                    "ratio_median": statistics.median(ratios), "ratio_min": min(ratios),
                                    "ratio_max": max(ratios)}
    res["records"] = recs
    return res


def learn(args, work: Path, common: list[str]) -> dict:
    curves = {}
    in_flight = math.ceil(args.prompts * float(args.over_sample[0]))
    for name, extra in (("sync", []), ("partial", ["rollout.partial=true", f"rollout.over_sample={args.over_sample[0]}",
                                                   "rollout.offpolicy=tis", "rollout.max_staleness=4"])):
        run_dir = work / f"learn_{name}"
        cmd = torchrun(args.nproc) + ["-m", "mtrain", "train", str(CONFIG), f"model.hf_path={args.learn_hf or args.hf}",
                                      f"train.run_dir={run_dir}", f"train.steps={args.learn_steps}", *TASK, *common,
                                      f"rollout.max_groups_in_flight={in_flight}",
                                      *args.learn_overrides, *extra]
        check(subprocess.run(cmd, cwd=work, capture_output=True, text=True), f"learn_{name}", work)
        recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
                if line.strip() and "weight_version" in line]
        curves[name] = {"reward": [r["reward/mean"] for r in recs],
                        "response_len": [r["response_len/mean"] for r in recs],
                        "step_s": [sum(r.get(k, 0.0) for k in PHASES) for r in recs],
                        "offpolicy_token_frac": [r.get("rollout/offpolicy_token_frac") for r in recs],
                        "dropped_stale_groups": [r.get("rollout/dropped_stale_groups", 0.0) for r in recs]}
    return curves


def fmt(b: dict) -> str:
    s = (f"wall {b['wall_s']:.2f} s = rollout {b['time/rollout']:.2f} + logprobs {b['time/logprobs']:.2f} + train "
         f"{b['time/train']:.2f} + sync {b['time/sync']:.3f} + other {b['other_s']:.3f}; tail-wait "
         f"{b['tail_wait_frac']:.2f} of rollout slot-time ({b['tail_wait_s']:.2f} s); trained length "
         f"{b['response_len']:.0f}")
    if "time/rollout_pool" in b:
        s += (f"\n      pool {b['time/rollout_pool']:.2f} s, bookkeeping {b['time/rollout_bookkeeping']:.3f} s, "
              f"abort wait {b.get('time/abort_wait') or 0:.3f} s, resumed {b['rollout/resumed']:.0f} samples "
              f"({b['rollout/resume_prefill_tokens']:.0f} prefill tokens), groups started "
              f"{b['rollout/groups_started']:.0f}, in flight {b['rollout/groups_in_flight']:.0f}, off-policy token "
              f"share {b['rollout/offpolicy_token_frac']:.2f}")
    return s


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hf", required=True, help="HF model dir (e.g. from `mtrain init-tiny`)")
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--over-sample", default="2", help="comma list: the partial modes to time (rollout.over_sample)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--block", type=int, default=3, help="steps per block")
    ap.add_argument("--learn-steps", type=int, default=0, help="> 0: also the two reward curves (separate runs)")
    ap.add_argument("--learn-hf", default=None, help="model for the reward curves (default --hf)")
    ap.add_argument("--learn-set", dest="learn_overrides", nargs="*", default=[], help="key=value, learning runs only")
    ap.add_argument("--json", default="bench_partial_rollout.json", help="file name under $OUT")
    ap.add_argument("overrides", nargs="*", help="key=value for every run")
    args = ap.parse_args()
    args.over_sample = [float(o) for o in args.over_sample.split(",")]
    work = Path(tempfile.mkdtemp(prefix="mtrain-partial-"))
    common = [f"rollout.prompts_per_step={args.prompts}", f"rollout.samples_per_prompt={args.samples}",
              f"train.micro_batch_size={args.samples}", "algo.tis_cap=2.0", *args.overrides]
    res = {"args": vars(args), "work": str(work)}
    out = os.environ.get("OUT")

    def save() -> None:
        if out:
            Path(out).mkdir(parents=True, exist_ok=True)
            Path(out, args.json).write_text(json.dumps(res, indent=1))

    if args.repeats > 0:
        res["speed"] = sp = speed(args, work, common)
        save()
        print("synchronous: trained tokens/s per block " + " ".join(f"{x:.0f}" for x in sp["sync_tokens_per_s"]))
        print("   " + fmt(sp["sync"]))
        for o, p in sp["partial"].items():
            print(f"partial over_sample={o}: trained tokens/s per block " + " ".join(f"{x:.0f}" for x in
                                                                                   p["tokens_per_s"]))
            print(f"   ratio vs synchronous: median {p['ratio_median']:.2f}x (range {p['ratio_min']:.2f}-"
                  f"{p['ratio_max']:.2f}, {len(p['ratios'])} repeats: "
                  + " ".join(f"{x:.2f}" for x in p["ratios"]) + ")")
            print("   " + fmt(p["breakdown"]))
    if args.learn_steps > 0:
        res["learn"] = cur = learn(args, work, common)
        save()
        for name, c in cur.items():
            print(f"reward/mean per step {name:8s}: " + " ".join(f"{x:.3f}" for x in c["reward"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
