"""benchmarks/bench_train_throughput.py end to end on CPU at a tiny size, in bf16 with --profile: the profiler
summary (JSON and text) for all three modes, and the logprob numerics beside their noise floor and the float32
reference of the same weights."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_bench_bf16_profile_and_numerics(tmp_path):
    out = tmp_path / "bench.json"
    env = dict(os.environ, TORCHDYNAMO_DISABLE="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_train_throughput.py"), "--model", "tiny",
                           "--samples", "8", "--max-len", "64", "--mbs", "2", "--budget", "128", "--fixed-len", "32",
                           "--steps", "1", "--warmup", "0", "--dtype", "bfloat16", "--profile", "--out", str(out)],
                          env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["dtype"] == "bfloat16"
    assert res["packed_attention"] == {"paths": ["sdpa_per_sequence"], "varlen_error": []}  # CPU: no varlen kernel
    assert set(res["profile"]) == {"padded", "packed", "ceiling", "ceiling_packed"}
    assert res["packed_over_ceiling_packed_tokens_per_s"] > 0
    for mode, p in res["profile"].items():
        assert p["wall_s"] > 0 and p["top_by_self_cpu"], mode
        names = {r["name"] for r in p["top_by_self_cpu"]}
        assert any(n.startswith("aten::") for n in names), (mode, names)
        assert all(r["calls"] >= 1 for r in p["top_by_self_cpu"])
        assert p["host_reads"]["aten::_local_scalar_dense"] > 0  # the optimizer and the metrics read scalars
    text = (tmp_path / "bench.profile.txt").read_text()
    assert all(f"=== {m}:" in text for m in ("padded", "packed", "ceiling", "ceiling_packed"))
    num = res["logprob_numerics"]
    for k in ("packed_vs_padded", "floor_padded_vs_padded_mbs1", "floor_packed_vs_packed_reversed",
              "padded_vs_float32", "packed_vs_float32"):
        assert num[k]["max_abs"] >= num[k]["mean_abs"] >= 0, (k, num[k])
    # bf16 rounds: both paths differ from float32, and the packed path by no more than the padded one's size
    assert num["padded_vs_float32"]["mean_abs"] > 0
    assert num["packed_vs_float32"]["mean_abs"] <= 2 * num["padded_vs_float32"]["mean_abs"], num
    assert num["packed_vs_padded"]["max_abs"] < 0.1, num
