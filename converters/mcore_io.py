"""Shared pieces of the Megatron converters: table checks, the parallel layout, dist-checkpoint files, metadata.

Nothing here spells a weight name: expected HF tensors, the MTP decision and the tied copies all come from the
layout tables (`mtrain.layouts.model_layout`). The megatron-dependent helpers (`build_and_load`) import
Megatron lazily so that the checks run in the parent process before any rank is spawned.
"""
from __future__ import annotations

import functools
import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch

from mtrain.layouts.models import canonical_config

from .errors import CheckpointError, ConvertError, TensorMismatchError

META_FILE = "mtrain_meta.json"
# Files a dist checkpoint (torch_dist format) cannot be read without. Its common (non-tensor) state is a
# `common.pt` beside them up to megatron-core 0.16, and from 0.19 on a "common_state" object inside the torch_dist
# shards (whose presence and length the .metadata check below covers); 0.19 reads both.
DIST_REQUIRED = ("metadata.json", ".metadata")
# Small files that travel with the weights (config, tokenizer, generation settings, chat template).
_SIDE_SUFFIXES = (".json", ".txt", ".model", ".jinja", ".tiktoken")
_NOT_SIDE_FILES = {"model.safetensors.index.json", "metadata.json", META_FILE}


class ParallelSizeError(ConvertError):
    """The parallel sizes do not fit the model (heads/groups vs tp, experts vs ep, layers vs pp)."""


# ------------------------------------------------------------------------------------------ config and dtype

def config_dtype(cfg: Mapping[str, Any]) -> torch.dtype:
    """The dtype a HF config.json declares (`dtype` in transformers 5, `torch_dtype` before), else float32."""
    name = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise CheckpointError(f"config.json declares dtype {name!r}, which is not a floating-point torch dtype")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


normalized_config = canonical_config  # the keys the layout tables read (Qwen3-MoE's expert count)


def model_config(cfg: dict, mtp: bool) -> dict:
    """The config the Megatron model is built from: MTP layers only when the checkpoint carries them."""
    cfg = normalized_config(cfg)
    return cfg if mtp else dict(cfg, num_nextn_predict_layers=0)


# ------------------------------------------------------------------------------------------ the layout table

def layout_for(cfg: dict, mtp: bool):
    from mtrain.layouts import LayoutError, model_layout
    try:
        return model_layout(model_config(cfg, mtp), mtp=mtp)
    except LayoutError as e:
        raise ConvertError(f"unsupported model: {e}") from e


def hf_expected(model) -> dict[str, tuple[int, ...]]:
    """Every HF tensor name the table reads or writes, with its on-disk shape."""
    out: dict[str, tuple[int, ...]] = {}
    for w in model.weights:
        for part in w.hf:
            rows = part.rows[1] - part.rows[0]
            shape = (rows,) + tuple(w.shape[1:])
            if out.setdefault(part.name, shape) != shape:
                raise ConvertError(f"layout table bug: {part.name} listed with shapes {out[part.name]} and {shape}")
    return out


def hf_has_mtp(cfg: dict, names: Iterable[str]) -> bool:
    """Does the HF checkpoint carry the MTP layers that its config announces?

    Decided from the table's MTP rows: none of their HF tensors present -> build without MTP (transformers'
    save_pretrained drops them); any present -> build with MTP, and the table check names what is missing.
    """
    if not cfg.get("num_nextn_predict_layers"):
        return False
    from mtrain.layouts import model_layout
    with_mtp = model_layout(normalized_config(cfg), mtp=True)
    main = set(hf_expected(model_layout(model_config(cfg, False), mtp=False)))
    mtp_only = set(hf_expected(with_mtp)) - main
    return bool(mtp_only & set(names))


def check_against_table(model, shapes: Mapping[str, tuple[int, ...]], dtypes: Mapping[str, torch.dtype],
                        where: str) -> None:
    """Missing, unexpected, wrong-shape and non-float tensors, each named (a few of each kind)."""
    expected = hf_expected(model)
    missing = sorted(set(expected) - set(shapes))
    unexpected = sorted(set(shapes) - set(expected))
    if missing:
        raise CheckpointError(f"{where}: missing tensor(s) the model needs: {_few(missing)}")
    if unexpected:
        raise CheckpointError(f"{where}: unexpected tensor(s) that the {model.arch} layout does not know: "
                              f"{_few(unexpected)}")
    for name, want in expected.items():
        if tuple(shapes[name]) != want:
            raise TensorMismatchError(f"{where}: tensor '{name}' has shape {list(shapes[name])}, "
                                      f"the config implies {list(want)}")
        if not dtypes[name].is_floating_point:
            # A float of another width is cast to the requested dtype; an integer tensor is not a weight.
            raise TensorMismatchError(f"{where}: tensor '{name}' has dtype {dtypes[name]}, expected a "
                                      "floating-point weight")


def _few(names: list[str], n: int = 5) -> str:
    return ", ".join(names[:n]) + (f" (and {len(names) - n} more)" if len(names) > n else "")


def tied_copies(model) -> list[tuple[str, str]]:
    """(copy, original) HF names of tensors that Megatron shares: rows whose Megatron side is a read-only alias
    of another row's Megatron tensor (DeepSeek's MTP embedding/head). Tied lm_heads read the same HF name."""
    writer: dict[str, str] = {}
    for w in model.weights:
        for part in w.megatron:
            if part.write and len(w.hf) == 1:
                writer.setdefault(part.name, w.hf[0].name)
    out = []
    for w in model.weights:
        for part in w.megatron:
            if not part.write and len(w.hf) == 1 and part.name in writer and w.hf[0].name != writer[part.name]:
                out.append((w.hf[0].name, writer[part.name]))
    return out


# ------------------------------------------------------------------------------------------ parallel layout

@dataclass(frozen=True)
class StageSplit:
    """An uneven pipeline split: layers on the first and on the last stage (None: even share)."""
    first: int | None = None
    last: int | None = None


def stage_split_overrides(layout) -> dict[str, int]:
    """The MegatronLayout's uneven split as megatron-core TransformerConfig fields (for build_model)."""
    from mtrain.models.builder import pipeline_split_overrides
    return pipeline_split_overrides(layout.first_stage_layers, layout.last_stage_layers)


def megatron_layout(model, tp: int, pp: int, ep: int, etp: int | None, world: int | None = None,
                    split: StageSplit = StageSplit()):
    """The MegatronLayout for these sizes on `world` ranks (default: the smallest data-parallel size that
    makes EP fit), and the HF -> Megatron plan.

    Megatron needs tp*dp to be a multiple of etp*ep (experts are spread over the data-parallel ranks too):
    tp=2, ep=2 (etp=tp) therefore runs on 4 ranks, tp=2, ep=2, etp=1 on 2.
    """
    from mtrain.layouts import LayoutError
    from mtrain.reshard.placement import HFLayout, MegatronLayout
    from mtrain.reshard.planner import build_plan
    expert_tp = etp or tp
    dp = math.lcm(tp, expert_tp * ep) // tp
    if world is not None:
        if world % (tp * pp) or (world // pp) % (expert_tp * ep):
            raise ParallelSizeError(f"{world} processes cannot hold tp={tp} pp={pp} ep={ep} etp={expert_tp}: the "
                                    f"world must be a multiple of tp*pp and world/pp a multiple of etp*ep")
        dp = world // (tp * pp)
    if (split.first is not None or split.last is not None) and pp == 1:
        raise ParallelSizeError(f"--first-stage-layers/--last-stage-layers ({split.first}/{split.last}) need "
                                "--pp > 1: with one pipeline stage there is nothing to split")
    for flag, n in (("--first-stage-layers", split.first), ("--last-stage-layers", split.last)):
        if n is not None and n < 1:
            raise ParallelSizeError(f"{flag} must be >= 1, got {n}")
    layout = MegatronLayout(tp=tp, pp=pp, ep=ep, etp=etp, dp=dp, first_stage_layers=split.first,
                            last_stage_layers=split.last)
    try:
        layout.stage_layers(model.num_layers)
        plan = build_plan(model, HFLayout(), layout)
    except LayoutError as e:
        split_text = f" first_stage_layers={split.first} last_stage_layers={split.last}" if layout.uneven else ""
        raise ParallelSizeError(f"parallel sizes tp={tp} pp={pp} ep={ep} etp={expert_tp}{split_text} do not fit "
                                f"the model ({model.num_layers} layers): {e}") from e
    return layout, plan


# ------------------------------------------------------------------------------------------ dist checkpoints

def weights_dir(path: str | Path) -> Path:
    """The dist checkpoint inside a trainer checkpoint as users name it (RUN_DIR/checkpoints/step_N holds its
    weights in mcore/); any other path as given."""
    path = Path(path)
    if (path / "mcore").is_dir() and not (path / "metadata.json").exists():
        return path / "mcore"
    return path


def refuse_lora_checkpoint(mcore: str | Path, command: str) -> None:
    """A LoRA run's checkpoint holds a frozen base plus adapters: exporting only the base would silently drop what
    was trained."""
    from mtrain.layouts.lora import read_meta
    spec = read_meta(mcore)
    if spec is not None:
        raise ConvertError(f"{mcore} is a LoRA checkpoint (rank {spec.rank} on {', '.join(spec.targets)}): {command} "
                           f"would write the base model without what was trained. Use `mtrain-convert export-lora "
                           f"--mcore {mcore} --hf BASE_HF_DIR --out DIR` (PEFT adapters), with --merge for a full HF "
                           f"checkpoint with the adapters merged in")


def check_dist_checkpoint(path: str | Path, need_config: bool = True) -> Path:
    """A complete torch_dist checkpoint directory, or one CheckpointError naming what is missing or short."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: Megatron checkpoint directory does not exist")
    absent = [f for f in DIST_REQUIRED if not (path / f).is_file()]
    if absent:
        raise CheckpointError(f"{path}: incomplete Megatron dist checkpoint (half-written?): "
                              f"missing {', '.join(absent)}")
    try:
        fmt = json.loads((path / "metadata.json").read_text()).get("sharded_backend")
    except (OSError, ValueError, AttributeError) as e:
        raise CheckpointError(f"{path / 'metadata.json'}: unreadable: {e}") from e
    if fmt != "torch_dist":
        raise CheckpointError(f"{path}: sharded backend {fmt!r} is not supported (expected torch_dist)")
    from torch.distributed.checkpoint import FileSystemReader
    try:
        storage = FileSystemReader(str(path)).read_metadata().storage_data
    except Exception as e:  # noqa: BLE001 - any unpickling failure means the file is damaged
        raise CheckpointError(f"{path / '.metadata'}: unreadable (corrupt or truncated): {e}") from e
    need: dict[str, int] = {}
    for info in storage.values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    for rel, end in sorted(need.items()):
        f = path / rel
        if not f.is_file():
            raise CheckpointError(f"{path}: incomplete Megatron dist checkpoint: shard file {rel} is missing")
        if f.stat().st_size < end:
            raise CheckpointError(f"{f}: truncated shard: {f.stat().st_size} bytes, the checkpoint index needs {end}")
    if need_config and not (path / "config.json").is_file():
        raise CheckpointError(f"{path}: no config.json (pass --hf-config DIR with the model's HF config)")
    return path


def read_meta(path: Path) -> dict:
    f = path / META_FILE
    if not f.is_file():
        return {}
    try:
        return json.loads(f.read_text())
    except ValueError as e:
        raise CheckpointError(f"{f}: unreadable: {e}") from e


def write_meta(path: Path, **fields: Any) -> None:
    from importlib.metadata import PackageNotFoundError, version  # not `import megatron`: seconds in the parent
    versions = {}
    for pkg in ("torch", "megatron-core", "transformers", "safetensors"):
        try:
            versions[pkg] = version(pkg)
        except PackageNotFoundError:
            versions[pkg] = None
    fields["versions"] = versions
    (path / META_FILE).write_text(json.dumps(fields, indent=2, sort_keys=True) + "\n")


def copy_side_files(src: Path, dst: Path) -> list[str]:
    """config.json, tokenizer and generation files; never weights, indexes or our own metadata."""
    copied = []
    for f in sorted(src.iterdir()):
        if f.is_file() and f.suffix in _SIDE_SUFFIXES and f.name not in _NOT_SIDE_FILES:
            shutil.copy2(f, dst / f.name)
            copied.append(f.name)
    return copied


def checkpoint_facts(mcore_dir: Path, hf_config_dir: Path | None) -> tuple[dict, bool, torch.dtype]:
    """(HF config, MTP carried?, parameter dtype) of a dist checkpoint written by hf-to-mcore (or by training).

    Without mtrain_meta.json (a training run's checkpoint) the checkpoint's own index decides: MTP when it holds
    `mtp.*` tensors (RL trains without them, model.mtp=false), the dtype of its embedding; the config only when
    the index cannot be read.
    """
    cfg_dir = hf_config_dir or mcore_dir
    try:
        cfg = json.loads((cfg_dir / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{cfg_dir / 'config.json'}: unreadable: {e}") from e
    meta = read_meta(mcore_dir)
    if "mtp_layers" in meta and "dtype" in meta:
        return cfg, bool(meta["mtp_layers"]), getattr(torch, meta["dtype"])
    index = _tensor_index(mcore_dir)
    if index:
        mtp = any(k.startswith("mtp.") for k in index)
        emb = index.get("embedding.word_embeddings.weight")
        dtype = getattr(getattr(emb, "properties", None), "dtype", None) or config_dtype(cfg)
        return cfg, mtp, dtype
    return cfg, bool(cfg.get("num_nextn_predict_layers") or 0), config_dtype(cfg)


def _tensor_index(mcore_dir: Path) -> dict:
    """name -> torch.distributed.checkpoint tensor metadata of a torch_dist checkpoint ({} when unreadable)."""
    from torch.distributed.checkpoint import FileSystemReader
    try:
        return dict(FileSystemReader(str(mcore_dir)).read_metadata().state_dict_metadata)
    except Exception:  # noqa: BLE001 - check_dist_checkpoint reports a damaged index; here only a fallback
        return {}


def build_and_load(cfg: dict, mtp: bool, dtype: torch.dtype, mcore_dir: str, config_overrides: dict | None = None):
    """Inside a live parallel_state: build this rank's chunks and fill them from the dist checkpoint
    (Megatron reshards on load, so the checkpoint's own layout, uneven stages included, does not matter)."""
    from mtrain.models import build_model, load_model_checkpoint
    chunks, _ = build_model(model_config(cfg, mtp), params_dtype=dtype, config_overrides=config_overrides)
    load_model_checkpoint(chunks, mcore_dir)
    return chunks


def chunks_device(chunks) -> torch.device:
    """Where build_model put the chunks (CUDA when there is a GPU): the converters' executors gather there, so a
    conversion on a GPU machine neither mixes devices nor copies every source tensor to the host first."""
    return next(p for c in chunks for p in c.parameters()).device


def return_freed_memory() -> None:
    """Make glibc give large freed blocks back to the OS in this process.

    glibc raises its mmap threshold to the size of any mmap-ed block that is freed (up to 32 MiB), after which
    such blocks come from the heap, and a converter's freed per-tensor temporaries (FP8 dequantisation, bucket
    buffers) stay resident: converting a 2.1 B-parameter FP8 checkpoint to bf16 held 2.2x the model. A fixed
    threshold (1 MiB) switches that adjustment off (measured: docs/results.md, FP8 conversion memory). No-op
    where there is no glibc."""
    import ctypes
    import ctypes.util
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


def rank_error(fn):
    """Run a rank body, turning user errors into a returned message (the parent re-raises it as one error)
    instead of a traceback per rank. functools.wraps keeps the module-level name, so spawn can pickle it."""
    @functools.wraps(fn)
    def wrapped(rank: int, world: int, *args):
        from mtrain.run_output import quiet_known_warnings
        quiet_known_warnings(rank)  # before megatron's imports: its TE/Apex notices need no action (run_output.py)
        from mtrain.layouts import LayoutError
        from mtrain.models import ModelConfigError
        return_freed_memory()
        try:
            return {"ok": fn(rank, world, *args)}
        except (ConvertError, LayoutError, ModelConfigError) as e:
            return {"error": str(e)}
    return wrapped


def run_ranks(fn, world: int, *args, timeout: float = 3600.0) -> list:
    """run_on_ranks with user errors re-raised here as one ConvertError."""
    from mtrain.dist import run_on_ranks
    results = run_on_ranks(fn, world, *args, timeout=timeout)
    for r in results:
        if "error" in r:
            raise ConvertError(r["error"])
    return [r["ok"] for r in results]
