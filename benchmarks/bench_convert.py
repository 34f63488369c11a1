"""Throughput of the Megatron converters on SmolLM2-135M against plain safetensors I/O, measured in the same run.

    python benchmarks/bench_convert.py [--tp 1 3] [--repeats 1]

For each converter: wall time end to end (process spawn, Megatron import and model build included, as a user
sees it) and MB/s of HF checkpoint bytes. Baseline: `safetensors.torch.load_file` + `save_file` of the same
checkpoint in this process (the least any converter must do: read every byte, write every byte). Prints a
table and writes `$OUT/bench_convert.json` when $OUT is set. The "floor" row (spawn a rank, import Megatron,
build the model, convert nothing) shows how much of a small model's time is fixed start-up cost.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def startup_floor(rank: int, world: int, cfg: dict) -> None:
    """What every conversion pays before touching a weight: a spawned rank, Megatron imported, the model built."""
    import torch

    from mtrain.dist import init_distributed
    from mtrain.models import build_model
    init_distributed()
    build_model(cfg, params_dtype=torch.float32)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, nargs="+", default=[1, 3], 
                   help="hf-to-mcore tensor-parallel sizes to time (SmolLM2 has 3 KV heads)")
    p.add_argument("--repeats", type=int, default=1, help="runs per measurement (the fastest is reported)")
    args = p.parse_args(argv)

    from safetensors.torch import load_file, save_file

    from mtrain.converters.hf_to_mcore import hf_to_mcore
    from mtrain.converters.mcore_to_hf import mcore_to_hf
    from mtrain.converters.safetensors_io import HFCheckpoint
    from mtrain.converters.smollm2 import smollm2_hf_dir

    hf = smollm2_hf_dir()
    hf_bytes = HFCheckpoint(hf).total_bytes()
    mb = hf_bytes / 1e6
    rows: list[dict] = []
    work = Path(tempfile.mkdtemp(prefix="bench_convert-"))
    try:
        def best(name: str, make) -> float:
            times = []
            for i in range(args.repeats):
                target = work / f"{name}-{i}"
                times.append(_timed(lambda: make(target)))
                if i < args.repeats - 1:
                    shutil.rmtree(target, ignore_errors=True)
            return min(times)

        def baseline(target: Path) -> None:
            target.mkdir()
            for f in sorted(hf.glob("*.safetensors")):
                save_file(load_file(f), str(target / f.name), metadata={"format": "pt"})

        base = best("baseline", baseline)
        rows.append(dict(step="baseline: safetensors load_file+save_file", seconds=base))
        from mtrain.dist import run_on_ranks
        cfg = HFCheckpoint(hf).config
        floor = best("floor", lambda d: run_on_ranks(startup_floor, 1, cfg))
        rows.append(dict(step="floor: spawn 1 rank + import Megatron + build model", seconds=floor))
        mcore_dirs = {}
        for tp in args.tp:
            t = best(f"mcore-tp{tp}", lambda d, tp=tp: hf_to_mcore(hf, d, tp=tp))
            mcore_dirs[tp] = work / f"mcore-tp{tp}-{args.repeats - 1}"
            rows.append(dict(step=f"hf-to-mcore tp={tp} ({tp} rank{'s' if tp > 1 else ''})", seconds=t))
        src = mcore_dirs[max(mcore_dirs)]
        t = best("back", lambda d: mcore_to_hf(src, d))
        rows.append(dict(step=f"mcore-to-hf (from tp={max(mcore_dirs)}, loaded at tp=1)", seconds=t))
    finally:
        shutil.rmtree(work, ignore_errors=True)

    for r in rows:
        r["MB_per_s"] = mb / r["seconds"]
        r["x_baseline_time"] = r["seconds"] / base
    print(f"SmolLM2-135M: {mb:.1f} MB of HF tensors ({hf}); {os.cpu_count()} CPUs, best of {args.repeats}")
    print(f"{'step':58s} {'seconds':>8s} {'MB/s':>8s} {'x baseline time':>16s}")
    for r in rows:
        print(f"{r['step']:58s} {r['seconds']:8.2f} {r['MB_per_s']:8.1f} {r['x_baseline_time']:16.1f}")
    out = os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        result = dict(model="SmolLM2-135M-Instruct", hf_bytes=hf_bytes, rows=rows, repeats=args.repeats,
                      cpus=os.cpu_count(), python=sys.version.split()[0], machine=platform.machine())
        (Path(out) / "bench_convert.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
