"""CPU cost of numerics.on_policy=bitwise against off: the tiny GRPO run (mtrain/configs/tiny_llama_grpo.yaml, a
random tiny Llama with intermediate_size 128, reference engine) under each mode, alternately, and each phase's
seconds per step (steps after the first), median and range over steps and repeats.

    PYTHONPATH=$PWD python benchmarks/bench_on_policy_cpu.py [--steps 4] [--repeats 1] [--tp 1] [--dtype float32]
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
PHASES = ("time/step", "time/rollout", "time/logprobs", "time/train")


def run(mode: str, hf: Path, out: Path, steps: int, tp: int, dtype: str) -> list[dict]:
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCHDYNAMO_DISABLE="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=str(REPO))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(tp), "-m", "mtrain",
           "train", str(REPO / "mtrain" / "configs" / "tiny_llama_grpo.yaml"), f"model.hf_path={hf}",
           f"train.run_dir={out}", f"train.steps={steps}", "train.save_interval=0", "train.eval_interval=0",
           f"parallel.tp={tp}", "engine.kind=reference", f"model.dtype={dtype}", f"numerics.on_policy={mode}"]
    subprocess.run(cmd, env=env, check=True, capture_output=True, cwd=out.parent)
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [r for r in recs if "weight_version" in r and r["step"] > 1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--dtype", default="float32")
    a = ap.parse_args()
    from mtrain.tiny_hf import write_tiny_hf
    tmp = Path(tempfile.mkdtemp(prefix="bench_on_policy_"))
    hf = write_tiny_hf("llama", tmp / "hf", seed=0, overrides={"intermediate_size": 128})
    per = {"off": [], "bitwise": []}
    for rep in range(a.repeats):
        for mode in per:
            per[mode] += run(mode, hf, tmp / f"{mode}_{rep}", a.steps, a.tp, a.dtype)
    for key in PHASES:
        off = [r[key] for r in per["off"]]
        bit = [r[key] for r in per["bitwise"]]
        print(f"{key:15s} off {statistics.median(off):7.3f} s [{min(off):.3f}, {max(off):.3f}]  "
              f"bitwise {statistics.median(bit):7.3f} s [{min(bit):.3f}, {max(bit):.3f}]  "
              f"ratio {statistics.median(bit) / statistics.median(off):6.2f}x")
    print("logprob_diff/max_abs off", max(r["logprob_diff/max_abs"] for r in per["off"]),
          "bitwise", max(r["logprob_diff/max_abs"] for r in per["bitwise"]))


if __name__ == "__main__":
    main()
