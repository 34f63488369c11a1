"""Preflight of the checkpoint a run resumes from: it holds the model of model.hf_path.

A run dir trained with one model and started again with another (model.hf_path changed, train.resume=auto) built
every model and engine, then died in megatron-core's checkpoint loader with a shape-mismatch or missing-key
traceback per rank. The checkpoint's own index (names and global shapes, no tensor read) says it first: its hidden
size, its layer count, and each tensor the layout table names as the checkpoint names it (stacked over layers or
one per layer) must be the model's; a tensor the model has under one name in every naming (a Qwen3 q_layernorm)
must be there (the norms before a linear excepted: where they are stored depends on the saving run's specs). The
embedding and output layer are left out (their rows are padded by the saving run's TP), and so are the routed
experts (stored stacked under a name of their own).
"""
from __future__ import annotations

import re
from pathlib import Path

from mtrain.config import ConfigError, RunConfig

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
# the norms in front of a linear, which Transformer Engine's specs (and the CPU shim's) may fold into it as
# `linear_*.layer_norm_weight`, per layer kind: their names say nothing about the model
_FUSABLE_NORM = re.compile(r"(input_layernorm|pre_mlp_layernorm|layer_norm_weight)")


def check_resume_model(cfg: RunConfig, hf_config: dict) -> None:
    from mtrain.trainer.checkpoint import resume_path
    path = resume_path(cfg.train.resume, cfg.train.run_dir, report=None)  # the checkpoint the trainer will load
    if path is None or not (path / "mcore").is_dir():
        return  # check_resume names a broken explicit path
    problem = model_mismatch(path / "mcore", hf_config)
    if problem:
        how = ("set train.resume to a checkpoint of this model, or train.resume=never" if cfg.train.resume != "auto"
               else "pick another train.run_dir for this model")
        raise ConfigError(f"train.resume: {path} holds another model than model.hf_path={cfg.model.hf_path} "
                          f"({problem}): resume with the model it was trained from, or {how}")
    problem = lora_mismatch(path / "mcore", cfg)
    if problem:
        how = "another train.resume" if cfg.train.resume != "auto" else "another train.run_dir"
        raise ConfigError(f"train.resume: {path} {problem}, or pick {how} to train this way")


def _adapters(rank: int, targets) -> str:
    return f"LoRA adapters of rank {rank} on {', '.join(targets)}" if targets else "no LoRA adapters (full fine-tuning)"


def lora_mismatch(mcore_dir: Path, cfg: RunConfig) -> str | None:
    """The checkpoint's adapters (lora.json beside its shards) against model.lora: another rank or target set, or
    adapters on one side only, was megatron-core's missing-key traceback per rank after every model was built."""
    from mtrain.layouts.lora import read_meta
    saved, lo = read_meta(mcore_dir), cfg.model.lora
    have = (saved.rank, list(saved.targets)) if saved else (None, [])
    want = (lo.rank, list(lo.targets)) if lo.targets else (None, [])
    if (have[0], sorted(have[1])) == (want[0], sorted(want[1])):
        return None
    keys = (f"model.lora.targets=[{','.join(saved.targets)}] model.lora.rank={saved.rank}" if saved else
            "model.lora.targets=[]")
    return f"holds {_adapters(*have)}, this run asks for {_adapters(*want)}: resume it with {keys}"


def _model_index(mcore_dir: Path) -> dict[str, tuple[int, ...]]:
    from mtrain.converters.mcore_io import _tensor_index
    out = {}
    for name, meta in _tensor_index(mcore_dir).items():
        size = getattr(meta, "size", None)
        if size is None or name.startswith(("optimizer.", "common_state", "rng_state")) or "_extra_state" in name:
            continue
        out[name] = tuple(size)
    return out


def model_mismatch(mcore_dir: Path, hf_config: dict) -> str | None:
    """How the dist checkpoint in `mcore_dir` differs from the model of `hf_config` (one clause), or None."""
    from mtrain.layouts import model_layout
    from mtrain.layouts.rules import VocabSplit
    from mtrain.models.hf_config import map_hf_config
    index = _model_index(mcore_dir)
    if not index:
        return None  # an unreadable index is check_resume's to name
    kw = map_hf_config(hf_config).config_kwargs
    hidden, layers = kw.get("hidden_size"), kw.get("num_layers")
    norm = index.get("decoder.final_layernorm.weight")
    if norm and hidden and norm[0] != hidden:
        return f"hidden size {norm[0]}, the model's is {hidden}"
    counts = {shape[0] for name, shape in index.items() if name.startswith("decoder.layers.") and not
              _LAYER.match(name) and shape}
    per_layer = [int(m.group(1)) for m in map(_LAYER.match, index) if m]
    if per_layer:  # a model of mixed layers (dense and MoE) is saved one layer at a time
        counts.add(max(per_layer) + 1)
    if layers and counts and counts != {layers}:
        return f"{max(counts)} layers, the model has {layers}"
    config = dict(hf_config, num_nextn_predict_layers=0)
    namings = [model_layout(config, te=te, mtp=False) for te in (False, True)]
    required = None
    for layout in namings:
        names = set()
        for w in layout.weights:
            if len(w.megatron) != 1 or w.expert is not None or w.region == "mtp":
                continue
            part = w.megatron[0]
            if part.slot or isinstance(part.rule, VocabSplit) or "{expert}" in part.name:
                continue
            names.add(part.name)
            if "{layer}" not in part.name:
                if part.name in index and index[part.name] != w.shape:
                    return f"{part.name} has shape {list(index[part.name])}, the model's is {list(w.shape)}"
                continue
            stacked, one = part.name.replace(".{layer}", ""), part.name.replace("{layer}", str(w.layer))
            if stacked in index and index[stacked][1:] != w.shape:
                return f"{stacked} has shape {list(index[stacked][1:])} per layer, the model's is {list(w.shape)}"
            if one in index and index[one] != w.shape:
                return f"{one} has shape {list(index[one])}, the model's is {list(w.shape)}"
        required = names if required is None else required & names
    from mtrain.layouts.lora import read_meta
    if read_meta(mcore_dir) is not None:
        return None  # LoRA wraps the base linears under names of its own
    for name in sorted(n for n in required or () if "{layer}" in n and not _FUSABLE_NORM.search(n)):
        stacked = name.replace(".{layer}", "")
        if stacked not in index and not any(name.replace("{layer}", str(i)) in index for i in range(layers or 0)):
            return f"it has no {stacked}, which the model has"
    return None
