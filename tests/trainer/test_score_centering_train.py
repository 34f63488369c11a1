"""algo.score_centering through `torchrun -m mtrain train` on a tiny model: the reference engine returns each token's
top-k logprobs, the batch carries them (packed micro-batches, TP=2: the trainer's head logprobs are gathered over
the vocabulary slices), the loss adds the term and logs it; bad settings are one line before any work."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from loop_harness import CONFIG, base_overrides, env, launch


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from mtrain.tiny_hf import write_tiny_hf
    return write_tiny_hf("llama", tmp_path_factory.mktemp("hf") / "llama", seed=0)


def test_two_steps_log_the_centering_term(tiny_llama, tmp_path):
    run = tmp_path / "run"
    launch(base_overrides(tiny_llama, run, **{"train.steps": 2, "algo.score_centering": "true",
                                              "algo.score_centering_k": 16, "algo.tis_cap": 2.0,
                                              "train.max_tokens_per_micro_batch": 128}), cwd=tmp_path, timeout=400)
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2]
    for r in recs:
        for key in ("score_centering/loss", "score_centering/coef_abs_sum", "score_centering/tail_mass_engine",
                    "score_centering/tail_mass_trainer"):
            assert key in r and r[key] == r[key], (key, r.get(key))  # present and not NaN
        # 16 of 101 tokens of a random model: a real tail of the distribution outside the head
        assert 0.05 < r["score_centering/tail_mass_engine"] < 0.999
        # the float32 reference engine and the float32 trainer compute the same distribution: the trainer's head
        # logprobs (gathered over two TP vocabulary slices) give the engine's tail mass, and the correction is ~0
        assert abs(r["score_centering/tail_mass_trainer"] - r["score_centering/tail_mass_engine"]) < 1e-4
        assert 0.0 <= r["score_centering/coef_abs_sum"] < 1e-3


@pytest.mark.parametrize("override,message", [
    ("algo.score_centering_k=0", "algo.score_centering_k: must be an int in [1, 1024]"),
    ("rollout.top_p=0.9", "algo.score_centering: needs untruncated sampling"),
    # more than the vocabulary (the default 128 on this 101-token model): was torch.topk's "selected index k out
    # of range" in every engine at the first rollout
    ("algo.score_centering_k=128", "algo.score_centering_k: 128 is more than the model's vocabulary (vocab_size=101)"),
])
def test_bad_settings_are_one_line(tiny_llama, tmp_path, override, message):
    p = subprocess.run([sys.executable, "-m", "mtrain", "train", str(CONFIG),
                        *base_overrides(tiny_llama, tmp_path / "run", **{"parallel.tp": 1}),
                        "algo.score_centering=true", override], cwd=tmp_path, env=env(), capture_output=True,
                       text=True, timeout=120)
    assert p.returncode != 0
    assert f"mtrain: error: ConfigError: {message}" in p.stderr, p.stderr[-2000:]
