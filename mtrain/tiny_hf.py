"""Write a tiny random HF model directory (transformers' own classes, on-disk safetensors names)."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from mtrain.tiny_configs import tiny_config


# Vision-language models are written with their processor (tokenizer, image processor, chat template) by
# mtrain.tiny_vlm: the runnable tiny Qwen2.5-VL, and its variant with SGLang-friendly head sizes.
VLM_ARCHS = ("qwen2_5_vl", "qwen2_5_vl_gpu")


def write_tiny_hf(arch: str | None, out: str | Path, *, seed: int = 0, overrides: dict | None = None,
                  config_path: str | Path | None = None) -> Path:
    """arch: a name in mtrain.tiny_configs (or VLM_ARCHS); or config_path: a full HF config.json to instantiate at
    random."""
    from transformers import AutoConfig, AutoModelForCausalLM
    parsed = {k: json.loads(v) if isinstance(v, str) else v for k, v in (overrides or {}).items()}
    if arch in VLM_ARCHS and config_path is None:
        from mtrain.tiny_vlm import TINY_VLM_GPU_OVERRIDES, write_tiny_vlm
        base = dict(TINY_VLM_GPU_OVERRIDES) if arch == "qwen2_5_vl_gpu" else {}
        return write_tiny_vlm(out, seed=seed, overrides={**base, **parsed})
    if config_path is not None:
        cfg = dict(json.loads(Path(config_path).read_text()), **parsed)
    else:
        cfg = tiny_config(arch, **parsed)
    out = Path(out)
    if (out / "config.json").exists():
        raise FileExistsError(f"{out} already holds a model (config.json): refusing to overwrite it")
    torch.manual_seed(seed)
    hf_cfg = AutoConfig.for_model(**dict(cfg, num_nextn_predict_layers=0) if "num_nextn_predict_layers" in cfg
                                  else cfg)
    model = AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32)
    model.save_pretrained(str(out))
    from mtrain.tokenizer_files import write_char_tokenizer_marker
    write_char_tokenizer_marker(out, hf_cfg.vocab_size)  # no tokenizer files: trained through the char tokenizer
    from mtrain.fileperm import chmod_umask
    for f in out.iterdir():  # transformers writes model.safetensors with mode 0600 through a temp file
        chmod_umask(f)
    return out
