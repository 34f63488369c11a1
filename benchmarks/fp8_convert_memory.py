"""Peak host memory of `mtrain-convert hf-to-mcore` on a multi-GB FP8 (DeepSeek-V3 release format) checkpoint.

    python benchmarks/fp8_convert_memory.py [--workdir /tmp/fp8mem] [--experts 48] [--keep]

1. writes a DeepSeek-V3-shaped FP8 checkpoint with `mtrain-convert make-fp8 --config` (random weights, MTP
   layer included, 128x128 blocks, 1 GiB shards): sized by --experts/--hidden/--layers, ~2.3 GB by default;
2. converts it with `mtrain-convert hf-to-mcore --dtype bfloat16` (one rank by default) while sampling, every
   0.1 s, the resident memory of the whole process tree (parent + spawned ranks);
3. prints the input size, the output size and the peaks of the tree's summed Pss (proportional set size: shared
   pages divided among the processes that map them, so the sum counts each page once) and of its anonymous part
   (allocated memory, without the file pages of the memory-mapped input), each also divided by the bf16 output
   (the model one rank must hold to save it: the floor of this design).

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


def _rollup(pid: int) -> dict[str, int]:
    """Pss (shared pages divided among their users: sums over processes without double counting) and
    Pss_Anon (anonymous memory: what the process allocated, not file pages of the memory-mapped input), bytes."""
    out = {}
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in ("Pss", "Pss_Anon", "Rss"):
                out[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError):
        pass
    return out


def tree_memory(pid: int) -> dict[str, int]:
    """Summed Pss and Pss_Anon of the process tree, and the largest single process's Rss."""
    import psutil
    try:
        p = psutil.Process(pid)
        procs = [p] + p.children(recursive=True)
    except psutil.NoSuchProcess:
        return {}
    total = {"Pss": 0, "Pss_Anon": 0, "max_rss": 0}
    for q in procs:
        r = _rollup(q.pid)
        total["Pss"] += r.get("Pss", 0)
        total["Pss_Anon"] += r.get("Pss_Anon", 0)
        total["max_rss"] = max(total["max_rss"], r.get("Rss", 0))
    return total


def run_sampled(cmd: list[str], env: dict, log: Path) -> tuple[int, dict, float]:
    """(return code, peaks of tree_memory's values in bytes, seconds); output to `log` (a pipe left unread
    would stall the child once full)."""
    t0 = time.monotonic()
    with open(log, "w") as f:
        p = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, text=True)
        peak: dict[str, int] = {}
        while p.poll() is None:
            for k, v in tree_memory(p.pid).items():
                peak[k] = max(peak.get(k, 0), v)
            time.sleep(0.2)
    if p.returncode != 0:
        print(log.read_text()[-4000:], file=sys.stderr)
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
                                                  "--force"], env, a.workdir.parent / "fp8mem-make.log")
        if rc:
            return rc
        par = ["--ep", "2"] if a.ranks == "ep2" else []
        rc, peak, secs = run_sampled(conv + ["hf-to-mcore", "--hf", str(release), "--out", str(out), "--dtype",
                                             "bfloat16", "--force", *par], env, a.workdir.parent / "fp8mem-convert.log")
        if rc:
            return rc
        fp8_bytes, out_bytes = dir_bytes(release), dir_bytes(out)
        gib = 2 ** 30
        print(f"FP8 checkpoint: {fp8_bytes / gib:.2f} GiB ({len(list(release.glob('*.safetensors')))} shards), "
              f"written in {gen_s:.0f} s; peak Pss {gen_peak.get('Pss', 0) / gib:.2f} GiB")
        print(f"hf-to-mcore ({a.ranks} rank(s), bf16): {secs:.0f} s, output {out_bytes / gib:.2f} GiB; peaks over "
              f"the process tree: Pss {peak.get('Pss', 0) / gib:.2f} GiB ({peak.get('Pss', 0) / out_bytes:.2f} x "
              f"output), anonymous {peak.get('Pss_Anon', 0) / gib:.2f} GiB "
              f"({peak.get('Pss_Anon', 0) / out_bytes:.2f} x output), largest process Rss "
              f"{peak.get('max_rss', 0) / gib:.2f} GiB")
    finally:
        if not a.keep:
            shutil.rmtree(a.workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
