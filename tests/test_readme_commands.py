"""The README's commands, run as written (issue 19, point 10): a documented sequence that fails is a bug.

Each fenced block of README.md that holds `mtrain`/`mtrain-convert`/`torchrun` lines runs line by line in a
shell, in a scratch directory, with this interpreter's scripts first on PATH. Two substitutions, both stated:
* `gguf-to-hf --gguf smollm2` needs the 93 MB SmolLM2 download (tests/converters/test_gguf.py covers it): a tiny
  random Llama with SmolLM2's head counts and vocabulary (9 query heads, 3 KV heads, 49152 tokens, tied
  embeddings) stands in for its output, so the sizes in the README meet the same divisibility rules as on the
  real model;
* repository paths (`mtrain/configs/...`) are copied into the scratch directory, so runs write there.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# SmolLM2-135M's facts that decide which parallel sizes fit (heads, KV heads, vocabulary, tied head), at tiny width.
SMOLLM2_SHAPE = {"hidden_size": 72, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 8,
                 "vocab_size": 49152, "tie_word_embeddings": True}


def readme_blocks() -> list[list[str]]:
    """Command lines of each fenced block that runs mtrain (comments after `#` dropped)."""
    text = (REPO / "README.md").read_text()
    blocks = []
    for body in re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S):
        body = re.sub(r"\\\n\s*", " ", body)  # shell line continuations
        lines = [re.sub(r"\s+#.*$", "", x).strip() for x in body.splitlines()]
        lines = [x for x in lines if x and not x.startswith("#")]
        if lines and all(x.split()[0] in ("mtrain", "mtrain-convert", "torchrun") for x in lines):
            blocks.append(lines)
    return blocks


def scripts_dir(cwd: Path) -> str:
    """PATH entries where `mtrain`, `mtrain-convert` and `torchrun` run this interpreter (a venv that shares the
    system's torch has no torchrun script of its own: one is written next to the scratch directory)."""
    own = Path(sys.executable).parent
    if (own / "torchrun").exists():
        return str(own)
    shim = cwd / ".bin"
    shim.mkdir(exist_ok=True)
    (shim / "torchrun").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m torch.distributed.run "$@"\n')
    (shim / "torchrun").chmod(0o755)
    return f"{shim}{os.pathsep}{own}"


def shell(line: str, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, PATH=f"{scripts_dir(cwd)}{os.pathsep}{os.environ['PATH']}",
               OMP_NUM_THREADS="1", TORCHDYNAMO_DISABLE="1", TOKENIZERS_PARALLELISM="false")
    env.pop("PYTHONPATH", None)
    p = subprocess.run(line, shell=True, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"README command failed ({p.returncode}): {line}\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}"
    return p


def is_run(line: str) -> bool:
    """A training run as the README writes it: mtrain's own launcher (or a plain torchrun)."""
    return line.startswith(("mtrain train --nproc-per-node", "torchrun"))


def test_the_readme_has_both_blocks():
    blocks = readme_blocks()
    assert any(b[0].startswith("mtrain-convert gguf-to-hf") for b in blocks), blocks
    assert any(any(is_run(x) for x in b) for b in blocks), blocks


def test_converter_block_sizes_fit_smollm2():
    """Seconds, no process: every --tp / --engine-tp in the block passes the converters' own planner checks for
    SmolLM2's shape (the README once documented --tp 2, which 3 KV heads refuse)."""
    from mtrain.converters.mcore_io import layout_for, megatron_layout
    from mtrain.reshard.placement import MegatronLayout, SGLangLayout
    from mtrain.reshard.planner import build_plan
    from mtrain.tiny_configs import tiny_config
    model = layout_for(tiny_config("llama", **SMOLLM2_SHAPE), mtp=False)
    (block,) = [b for b in readme_blocks() if b[0].startswith("mtrain-convert gguf-to-hf")]
    checked = 0
    for line in block:
        sizes = {k: int(v) for k, v in re.findall(r"--(tp|pp|ep|engine-tp) (\d+)", line)}
        if "engine-tp" in sizes:
            build_plan(model, MegatronLayout(), SGLangLayout(sizes["engine-tp"], 1), colocate=lambda r: 0)
            checked += 1
        elif sizes:
            megatron_layout(model, sizes.get("tp", 1), sizes.get("pp", 1), sizes.get("ep", 1), None)
            checked += 1
    assert checked >= 3


@pytest.mark.slow  # about a minute of spawned Megatron ranks on 2 cores; the sizes are checked above in seconds
def test_converter_block_runs_as_written(tmp_path):
    from mtrain.tiny_hf import write_tiny_hf
    (block,) = [b for b in readme_blocks() if b[0].startswith("mtrain-convert gguf-to-hf")]
    gguf_line = block[0]
    out = Path(re.search(r"--out (\S+)", gguf_line).group(1))
    write_tiny_hf("llama", tmp_path / out, overrides=SMOLLM2_SHAPE)  # stands in for the GGUF's conversion
    for line in block[1:]:
        shell(line, tmp_path)
    for line in block[1:]:  # every --out the block names now holds a checkpoint
        target = tmp_path / re.search(r"--out (\S+)", line).group(1) if "--out" in line else None
        assert target is None or any(target.iterdir()), line


@pytest.mark.slow  # the launcher runs by default in tests/test_model_folder_and_launch.py
def test_run_blocks_run_as_written(tmp_path):
    """The tiny run (init-tiny, mtrain train --nproc-per-node 2, plot), then the own-data command, which reuses its model."""
    blocks = [b for b in readme_blocks() if any(is_run(x) for x in b)]
    assert blocks[0][0].startswith("mtrain init-tiny"), blocks
    for block in blocks:
        for rel in {m for line in block for m in re.findall(r"(?:mtrain/configs|examples)/\S+", line)}:
            (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(REPO / rel, tmp_path / rel)
        for line in block:
            p = shell(line, tmp_path)
            if line.startswith("mtrain plot"):
                assert p.stdout.strip().endswith(".png") and (tmp_path / p.stdout.strip()).is_file()
    assert len(blocks) == 2 and "data.train_path=" in blocks[1][0]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
