"""`mtrain gap-probe`: the trainer's, the engine's and a float64 HF reference's activations on one sequence."""
import json
import os
import subprocess
import sys

import torch

from mtrain.gap_probe import compare, largest_step
from mtrain.rollout.reference_engine import ReferenceEngine
from mtrain.tiny_hf import write_tiny_hf

CONFIG = os.path.join(os.path.dirname(__file__), "..", "mtrain", "configs", "tiny_llama_grpo.yaml")


def _probe(tmp_path, *overrides):
    hf = write_tiny_hf("llama", tmp_path / "hf")
    out = tmp_path / "report.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCHDYNAMO_DISABLE="1")
    env.pop("WORLD_SIZE", None)
    p = subprocess.run([sys.executable, "-m", "mtrain", "gap-probe", CONFIG, f"model.hf_path={hf}", *overrides,
                        "--new-tokens", "6", "--out", str(out)], capture_output=True, text=True, env=env,
                       timeout=600, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    return hf, p, json.loads(out.read_text())


def test_gap_probe_command_float32(tmp_path):
    hf, p, report = _probe(tmp_path)
    names = [q["point"] for q in report["points"]]
    layers = json.loads((hf / "config.json").read_text())["num_hidden_layers"]
    assert names == ["embed"] + [f"L{i}.{k}" for i in range(layers) for k in ("norm1", "attn", "norm2", "mlp", "out")
                                 ] + ["norm"]
    # float32 on both sides: every capture and every logprob within float32 rounding of the float64 reference
    for q in report["points"]:
        assert q["trainer_vs_reference"] < 1e-5 and q["engine_vs_reference"] < 1e-5, q
    g = report["logprob_gap"]
    assert g["continuation/trainer_vs_engine/max"] < 1e-5 and g["all/trainer_vs_reference/max"] < 1e-5
    assert report["tokens"] > report["prompt_tokens"] > 0
    assert "trainer-engine grows most at" in p.stdout


def test_compare_names_the_layer_that_differs(tmp_path):
    """An engine with one perturbed attention output projection (layer 2): the report's largest step is there
    and blames the engine."""
    hf = write_tiny_hf("llama", tmp_path / "hf")
    ids = [1, 7, 12, 5, 9, 33, 4, 18, 2, 40]
    good = ReferenceEngine.from_pretrained(str(hf)).probe_activations(ids)
    bad_engine = ReferenceEngine.from_pretrained(str(hf))
    with torch.no_grad():
        bad_engine._model.model.layers[2].self_attn.o_proj.weight.mul_(1.05)
    bad = bad_engine.probe_activations(ids)
    reference = ReferenceEngine.from_pretrained(str(hf), dtype=torch.float64).probe_activations(ids)
    report = compare(good, bad, reference, continuation_from=5)
    step = largest_step(report["points"])
    assert step["point"] == "L2.attn"
    assert step["engine_vs_reference"] > 100 * step["trainer_vs_reference"]
    before = {q["point"]: q["trainer_vs_engine"] for q in report["points"]}
    assert max(before[f"L{i}.{k}"] for i in (0, 1) for k in ("attn", "mlp", "out")) < 1e-6
    assert report["logprob_gap"]["continuation/trainer_vs_engine/max"] > 1e-4


def test_gap_probe_puts_a_bf16_engines_share_on_the_engine(tmp_path):
    """engine.weight_dtype=bfloat16 under the float32 trainer: the trainer stays at float32 rounding of the
    reference, the engine carries the whole gap."""
    _, _, report = _probe(tmp_path, "engine.weight_dtype=bfloat16")
    assert report["model_dtype"] == "float32" and report["engine_dtype"] == "bfloat16"
    for q in report["points"]:
        assert q["trainer_vs_reference"] < 1e-5, q
    final = report["points"][-1]
    assert final["engine_vs_reference"] > 100 * final["trainer_vs_reference"], final
    g = report["logprob_gap"]
    assert g["all/trainer_vs_reference/max"] < 1e-5 < g["continuation/trainer_vs_engine/max"], g
