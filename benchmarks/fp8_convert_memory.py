"""Peak host memory of `mtrain-convert hf-to-mcore` on a multi-GB FP8 (DeepSeek-V3 release format) checkpoint.

    python benchmarks/fp8_convert_memory.py [--workdir /tmp/fp8mem] [--experts 48] [--keep]

1. writes a DeepSeek-V3-shaped FP8 checkpoint with `mtrain-convert make-fp8 --config` (random weights, MTP
   layer included, 128x128 blocks, 1 GiB shards): sized by --experts/--hidden/--layers, ~2.3 GB by default;
2. converts it with `mtrain-convert hf-to-mcore --dtype bfloat16` (one rank by default) while sampling, every
   0.1 s, the resident memory of the whole process tree (parent + spawned ranks);
3. prints the input size, the output size, the peak of the tree's summed RSS, and the same conversion's
   peak divided by the bf16 output (the model one rank must hold to save it: the floor of this design).

The FP8 weights are read one tensor at a time (memory-mapped) and dequantised into the rank's Megatron
parameters, so the peak should be about the bf16 model + the runtime, not input + output. Everything is
written under --workdir and deleted at the end unless --keep.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path


def dir_bytes(d: Path) -> int:
    return sum(f.stat().st_size for f in d.rglob("*") if f.is_file())


def tree_rss(pid: int) -> int:
    import psutil
    try:
        p = psutil.Process(pid)
        procs = [p] + p.children(recursive=True)
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for q in procs:
        try:
            total += q.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def run_sampled(cmd: list[str], env: dict) -> tuple[int, int, float]:
    """(return code, peak summed RSS of the tree in bytes, seconds)."""
    t0 = time.monotonic()
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peak = 0
    while p.poll() is None:
        peak = max(peak, tree_rss(p.pid))
        time.sleep(0.1)
    out = p.stdout.read()
    if p.returncode != 0:
        print(out[-4000:], file=sys.stderr)
    return p.returncode, peak, time.monotonic() - t0


def model_config(a) -> dict:
    from mtrain.tiny_configs import tiny_config
    return tiny_config("deepseek_v3_small_gpu", hidden_size=a.hidden, n_routed_experts=a.experts,
                       num_hidden_layers=a.layers, first_k_dense_replace=1, intermediate_size=4 * a.hidden,
                       moe_intermediate_size=a.hidden // 2, vocab_size=32768, num_attention_heads=16,
                       num_key_value_heads=16)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/fp8mem"))
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--experts", type=int, default=48)
    ap.add_argument("--layers", type=int, default=6, help="decoder layers (first one dense) + 1 MTP layer")
    ap.add_argument("--ranks", default="1", help="'1' (tp1) or 'ep2' (2 ranks, EP2)")
    ap.add_argument("--keep", action="store_true")
    a = ap.parse_args()
    a.workdir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCHDYNAMO_DISABLE="1")
    cfg_file = a.workdir / "config.json"
    cfg_file.write_text(json.dumps(model_config(a), indent=1))
    release, out = a.workdir / "release", a.workdir / "mcore"
    try:
        conv = [sys.executable, "-m", "mtrain.converters"]
        rc, gen_peak, gen_s = run_sampled(conv + ["make-fp8", "--config", str(cfg_file), "--out", str(release),
                                                  "--force"], env)
        if rc:
            return rc
        par = ["--ep", "2"] if a.ranks == "ep2" else []
        rc, peak, secs = run_sampled(conv + ["hf-to-mcore", "--hf", str(release), "--out", str(out), "--dtype",
                                             "bfloat16", "--force", *par], env)
        if rc:
            return rc
        fp8_bytes, out_bytes = dir_bytes(release), dir_bytes(out)
        print(f"FP8 checkpoint: {fp8_bytes / 2**30:.2f} GiB ({len(list(release.glob('*.safetensors')))} shards), "
              f"written in {gen_s:.0f} s with peak RSS {gen_peak / 2**30:.2f} GiB")
        print(f"hf-to-mcore ({a.ranks} rank(s), bf16): {secs:.0f} s, output {out_bytes / 2**30:.2f} GiB, "
              f"peak RSS of the process tree {peak / 2**30:.2f} GiB = {peak / fp8_bytes:.2f} x input, "
              f"{peak / out_bytes:.2f} x output")
    finally:
        if not a.keep:
            shutil.rmtree(a.workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
