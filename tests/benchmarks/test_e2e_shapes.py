"""benchmarks/gpu_e2e_step.py writes the e2e shapes' random checkpoints from mtrain's layout table (hf_tensors), so
that a MoE shape gets per-expert names whatever the GPU machine's transformers keeps in memory: those names and
shapes equal the ones transformers writes (a tiny Qwen3-MoE saved by save_pretrained) and builds (the dense e2e
shapes on the meta device); and every shape in benchmarks/configs fits one H100 by the memory plan under the
overrides its run_gpu.sh entry passes."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "benchmarks" / "configs"
sys.path.insert(0, str(REPO / "benchmarks"))


def _saved(out: Path) -> dict:
    from safetensors import safe_open
    names = {}
    for f in out.glob("*.safetensors"):
        with safe_open(str(f), "pt") as s:
            names.update({k: tuple(s.get_slice(k).get_shape()) for k in s.keys()})
    return names


def test_moe_names_are_the_ones_transformers_saves(tmp_path):
    from gpu_e2e_step import hf_tensors

    from mtrain.tiny_hf import write_tiny_hf
    out = write_tiny_hf("qwen3_moe", tmp_path / "hf", seed=0)
    assert dict(hf_tensors(json.loads((out / "config.json").read_text()))) == _saved(out)


@pytest.mark.parametrize("name", ["qwen3_1_7b", "qwen3_4b"])
def test_dense_names_are_the_ones_transformers_builds(name):
    from gpu_e2e_step import hf_tensors
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = json.loads((CONFIGS / f"{name}.json").read_text())
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg))
    built = {k: tuple(v.shape) for k, v in meta.state_dict().items()
             if not (cfg.get("tie_word_embeddings") and k == "lm_head.weight")}
    assert dict(hf_tensors(cfg)) == built


H100_BYTES = 85_031_714_816  # torch.cuda.get_device_properties(0).total_memory of an H100 80GB HBM3


def _e2e_entries() -> dict[str, list[str]]:
    """{run_gpu.sh entry: its gpu_e2e_step.py arguments, without --out} for every entry that runs steps (not the
    --write-only set-up): e2e_4b passes optim.cpu_offload, e2e_moe offload, full recompute and a smaller batch."""
    import re
    import shlex
    text = (REPO / "benchmarks" / "run_gpu.sh").read_text()
    body = text[text.index("run_one() {"):text.index("\n}\n", text.index("run_one() {"))].replace("\\\n", " ")
    out = {}
    for name, command in re.findall(r"^    ([a-z0-9_]+)\) (.*?) ;;", body, re.M | re.S):
        if "benchmarks/gpu_e2e_step.py" not in command or "--write-only" in command:
            continue  # (other entries' commands are not all shlex-able: comments with quotes)
        words = shlex.split(re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", command))  # ${E2E_PART:-all}: its default
        args = words[words.index("benchmarks/gpu_e2e_step.py") + 1:]
        if "--out" in args:
            i = args.index("--out")
            del args[i:i + 2]
        out[name] = args
    return out


@pytest.mark.parametrize("entry", sorted(_e2e_entries()))
def test_every_e2e_entry_fits_one_h100_by_the_memory_plan(entry):
    from gpu_e2e_step import parse_args, run_overrides

    from mtrain.config import load_config
    from mtrain.memory_plan import plan
    args = parse_args(_e2e_entries()[entry])
    cfg = load_config(REPO / "mtrain" / "configs" / "tiny_llama_grpo.yaml", run_overrides(args, Path("unused")))
    p = plan(cfg, json.loads((CONFIGS / f"{args.model}.json").read_text()), 1, H100_BYTES, True)
    assert p.problem() is None, p.problem()


def test_every_shape_has_an_e2e_entry():
    from gpu_e2e_step import parse_args
    assert {parse_args(a).model for a in _e2e_entries().values()} == {p.stem for p in CONFIGS.glob("*.json")}
