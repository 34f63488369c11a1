"""benchmarks/bench_shared_prefix.py runs end to end at a tiny shape (a smoke test of the figure in docs/results.md,
"Shared-prefix training (CPU)"): both cases, the shared stream shorter than the unshared one by what the groups
share, and the two paths' logprobs equal within float32 rounding."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_tiny_shape_runs_and_the_paths_agree(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "bench_shared_prefix.py"), "--groups", "2", "--samples", "3",
         "--prompt-len", "96", "--mt-prompt-len", "64", "--hidden", "64", "--layers", "1", "--heads", "2",
         "--kv-heads", "1", "--ffn", "128", "--vocab", "512", "--repeats", "1", "--json", str(out)],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
        env=dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", TORCHDYNAMO_DISABLE="1"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"long_prompt", "multi_turn"}
    for case, r in results.items():
        tok = r["stream_tokens"]
        # each group's prompt once instead of `samples` times, but for its last token, which stays in every sample
        # (docs/design-shared-prefix.md): (samples - 1) x (prompt - 1) x groups fewer tokens
        assert tok["unshared"] - tok["shared"] == 2 * 2 * (r["prompt_len"] - 1), (case, tok)
        assert r["logprob_max_abs_diff"] < 1e-4, (case, r["logprob_max_abs_diff"])
