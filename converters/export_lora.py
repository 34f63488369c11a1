"""export-lora: the adapters of a LoRA-trained Megatron dist checkpoint -> a PEFT adapter directory (HF names), or
with --merge a full HF checkpoint of the base with the adapters merged in.

The checkpoint may have been saved at any TP/PP layout: it is loaded into a TP1/PP1 model carrying the same
adapters (Megatron reshards on load), then the planner maps the adapter rows of the layout table
(mtrain/layouts/lora.py) to PEFT's names: one lora_A/lora_B per HF linear (q/k/v, gate/up split back apart).
The adapter's rank, alpha and targets come from the checkpoint's lora.json (written with every LoRA checkpoint).
On a MoE model a dense layer's MLP and the shared experts are PEFT target_parameters (`peft_targets` says why).
--merge uses PEFT's own merge (PeftModel.merge_and_unload) on the HF base read from --hf.
"""
from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

import torch

from .errors import CheckpointError
from .mcore_io import check_dist_checkpoint, rank_error, run_ranks
from .output_dir import check_output_dir

PEFT_PREFIX = "base_model.model."  # PEFT's adapter files name tensors from the PeftModel wrapper down


@rank_error
def adapter_rank(rank: int, world: int, job: dict) -> int:
    """Load at TP1 and collect every adapter tensor by its HF name; writes adapter_model.safetensors."""
    from safetensors.torch import save_file

    from mtrain.dist import init_distributed
    from mtrain.layouts.lora import LoraSpec
    from mtrain.models import build_model, load_model_checkpoint
    from mtrain.models.lora import attach_lora
    from mtrain.reshard.executor import Executor
    from mtrain.reshard.megatron_side import tensor_lookup
    from mtrain.reshard.placement import HFLayout, MegatronLayout
    from mtrain.reshard.planner import build_plan

    init_distributed()
    cfg = job["cfg"]
    spec = LoraSpec(job["rank"], job["alpha"], tuple(job["targets"]))
    chunks, _ = build_model(cfg, params_dtype=torch.float32)
    table = attach_lora(chunks, cfg, spec)
    load_model_checkpoint(chunks, job["mcore"])
    plan = build_plan(table, MegatronLayout(), HFLayout())
    src = tensor_lookup(chunks)
    out = {}
    with torch.no_grad():
        for bucket in Executor(plan, 0, lambda ref: src(ref).detach(), dtype=torch.float32,
                               backend="torch").stream():
            for name, tensor in bucket.get(0, []):
                out[PEFT_PREFIX + name] = tensor.to("cpu", copy=True).contiguous()
    save_file(out, str(Path(job["out"]) / "adapter_model.safetensors"), metadata={"format": "pt"})
    return len(out)


def write_adapter(mcore: Path, hf: Path, out: Path) -> int:
    """adapter_config.json + adapter_model.safetensors into `out` (an existing directory); returns the tensor count."""
    from peft import LoraConfig

    from mtrain.layouts import model_layout
    from mtrain.layouts.lora import lora_layout, read_meta

    spec = read_meta(mcore)
    if spec is None:
        raise CheckpointError(f"{mcore}: no lora.json: not a checkpoint of a LoRA run (model.lora.targets)")
    try:
        cfg = json.loads((hf / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{hf / 'config.json'}: unreadable: {e}") from e
    cfg = dict(cfg, num_nextn_predict_layers=0)
    table = lora_layout(model_layout(cfg, mtp=False), spec)
    LoraConfig(r=spec.rank, lora_alpha=spec.alpha, lora_dropout=0.0, task_type="CAUSAL_LM",
               base_model_name_or_path=str(hf), **peft_targets(table, hf)).save_pretrained(str(out))
    stable_adapter_config(out / "adapter_config.json")
    job = dict(cfg=cfg, rank=spec.rank, alpha=spec.alpha, targets=list(spec.targets), mcore=str(mcore), out=str(out))
    return run_ranks(adapter_rank, 1, job)[0]


def peft_targets(table, hf: Path) -> dict:
    """LoraConfig's target_modules and target_parameters for the adapter table (tensors keep the table's HF names).

    PEFT 0.21 under transformers 5 rewrites, on a MoE model, every target_modules entry ending in gate_proj /
    up_proj / down_proj into the fused experts' parameters (peft.utils.transformers_weight_conversion: adapters saved
    on transformers 4's per-expert linears); PEFT 0.22 reads the model's modules and leaves real linears alone.
    Routed experts rely on the rewrite: their per-expert tensors and last-component targets are what it converts on
    load. Where the installed PEFT would take a dense layer's MLP or DeepSeek's shared experts off their linears
    (`rewritten_by_peft` asks it), those linears are named by weight in target_parameters (`mlp.gate_proj.weight`,
    `shared_experts.down_proj.weight`): PEFT wraps a 2-d parameter as W + (alpha/r) B A, with the same
    `<module>.lora_A.weight` tensor names, and never rewrites target_parameters."""
    from dataclasses import replace

    from mtrain.layouts.lora import peft_module_path, peft_module_paths, peft_target_modules

    dense = replace(table, weights=[w for w in table.weights if w.expert is None])
    experts = replace(table, weights=[w for w in table.weights if w.expert is not None])
    moved = rewritten_by_peft(peft_module_paths(dense), hf)
    kept = [w for w in dense.weights if peft_module_path(w.hf[0].name) not in moved]
    modules = set(peft_target_modules(experts)) | set(peft_target_modules(replace(table, weights=kept)))
    out = {"target_modules": sorted(modules) or None}
    if moved:
        out["target_parameters"] = sorted(f"{m}.weight" for m in moved)
    return out


def rewritten_by_peft(module_paths: list[str], hf: Path) -> set[str]:
    """The target_modules entries PEFT's transformers-5 conversion takes off their modules for the model in `hf`
    (asked of PEFT itself, on a config naming only them). PEFT 0.22 reads the model's modules to decide, so it is
    given the model itself, built on the meta device (no weights, no memory); only for model types that
    transformers converts at all (MoE models), as for the others PEFT changes nothing."""
    import torch
    from peft import LoraConfig
    from peft.utils.transformers_weight_conversion import convert_peft_config_for_transformers
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    config = AutoConfig.from_pretrained(str(hf))
    if not module_paths or get_checkpoint_conversion_mapping(config.model_type) is None:
        return set()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    cfg = LoraConfig(target_modules=list(module_paths))
    convert_peft_config_for_transformers(cfg, model, None)
    return set(module_paths) - set(cfg.target_modules or ())


def stable_adapter_config(path: Path) -> None:
    """PEFT keeps target_modules as a set and writes it in hash order, which changes from one process to the next:
    sorted here (and every key), so two exports of one checkpoint are the same bytes."""
    cfg = json.loads(path.read_text())
    for key in ("target_modules", "target_parameters"):
        if isinstance(cfg.get(key), list):
            cfg[key] = sorted(cfg[key])
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def merge(adapter_dir: Path, hf: Path, out: Path) -> None:
    """PEFT's merge of the adapter into the HF base, saved as a HF checkpoint (with the base's tokenizer files)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(hf), dtype="auto")
    merged = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
    merged.save_pretrained(str(out))
    for f in hf.iterdir():
        if f.is_file() and (f.name.startswith("tokenizer") or f.name in ("special_tokens_map.json", "vocab.json",
                                                                           "merges.txt", "chat_template.jinja")):
            shutil.copy2(f, out / f.name)


def refuse_vision_language(hf: Path) -> None:
    """A LoRA run of Qwen2.5-VL trains adapters on the language model and, with model.train_vision, the whole vision
    tower: a PEFT directory of it needs transformers' in-memory names (model.language_model.*) and the tower as
    PEFT modules_to_save, which this exporter does not write yet. Refused before any work rather than exported
    without the tower."""
    try:
        cfg = json.loads((hf / "config.json").read_text())
    except (OSError, ValueError):
        return  # write_adapter names the unreadable file
    if cfg.get("vision_config") is not None:
        raise CheckpointError(f"{hf}: export-lora of a vision-language model ({cfg.get('model_type')}) is not built "
                              f"yet (the adapters' transformers names and the trained vision tower as PEFT "
                              f"modules_to_save); the run's checkpoint holds both")


def export_lora(mcore, hf, out, *, merged: bool = False, overwrite: bool = False) -> Path:
    mcore, hf = Path(mcore), Path(hf)
    refuse_vision_language(hf)
    out = check_output_dir(out, overwrite)
    check_dist_checkpoint(mcore, need_config=False)
    if not merged:
        out.mkdir(parents=True, exist_ok=True)
        write_adapter(mcore, hf, out)
        return out
    with tempfile.TemporaryDirectory() as tmp:
        write_adapter(mcore, hf, Path(tmp))
        out.mkdir(parents=True, exist_ok=True)
        merge(Path(tmp), hf, out)
    return out


def run(args: argparse.Namespace) -> int:
    out = export_lora(args.mcore, args.hf, args.out, merged=args.merge, overwrite=args.force)
    print(f"wrote {'merged HF checkpoint' if args.merge else 'PEFT adapter'} {out}")
    return 0
