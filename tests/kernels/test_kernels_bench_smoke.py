"""benchmarks/bench_kernel.py --dry-run runs end to end on CPU (interpreter, tiny shapes).

It checks the Triton result against the torch executor before timing and exits non-zero on a
mismatch, so this also covers the benchmark's bucket builders (QKV regroup, gate/up, column slices,
per-expert pieces) as kernel inputs."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_bench_dry_run_writes_json(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path), TRITON_INTERPRET="1", TORCHDYNAMO_DISABLE="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_kernel.py"), "--dry-run",
                           "--scenarios", "dense,moe,cast,tiny"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "bench_kernel.json").read_text())
    assert [r["scenario"] for r in report["results"]] == ["dense", "moe", "cast", "tiny"]
    for r in report["results"]:
        assert r["pieces"] > 0 and r["moved_bytes"] > 0
        assert r["kernel_ms"] > 0 and r["torch_ms"] > 0 and r["copy_ms"] > 0
    assert "kernel/copy" in proc.stdout
