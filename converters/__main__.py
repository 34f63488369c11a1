"""`mtrain-convert` / `python -m mtrain.converters`: one CLI for every weight converter.

Each subcommand lives in its own module, `mtrain.converters.<module>.run(args) -> int`, imported only
when that subcommand runs (so `gguf-to-hf` never imports Megatron). Errors the user can fix
(ConvertError and subclasses) print one line and exit 2; anything else keeps its traceback.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from typing import Sequence

from mtrain.paths import user_path  # `~` in a path argument, as mtrain's config path keys get it

from .errors import ConvertError

PROG = "mtrain-convert"
# subcommand -> module under mtrain.converters that implements `run(args) -> int`
SUBCOMMANDS = {
    "hf-to-mcore": "hf_to_mcore",
    "mcore-to-hf": "mcore_to_hf",
    "gguf-to-hf": "gguf_to_hf_cli",
    "verify": "verify",
    "mcore-to-sglang": "mcore_to_sglang",
    "make-fp8": "fp8_release",
    "export-lora": "export_lora",
}
DTYPE_NAMES = ("float32", "bfloat16", "float16")


def parse_dtype(name: str):
    """argparse type: 'bfloat16' (or 'bf16', 'fp32', ...) -> torch.dtype."""
    import torch

    aliases = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
    name = aliases.get(name, name)
    if name not in DTYPE_NAMES:
        raise argparse.ArgumentTypeError(f"unknown dtype '{name}' (choose from {', '.join(DTYPE_NAMES)})")
    return getattr(torch, name)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _add_parallel(p: argparse.ArgumentParser, etp: bool = False) -> None:
    p.add_argument("--tp", type=_positive_int, default=1, help="tensor-parallel size")
    p.add_argument("--pp", type=_positive_int, default=1, help="pipeline-parallel size")
    p.add_argument("--ep", type=_positive_int, default=1, help="expert-parallel size")
    if etp:
        p.add_argument("--etp", type=_positive_int, default=None, help="expert tensor-parallel size (default: tp)")


def _add_stage_split(p: argparse.ArgumentParser) -> None:
    # Only where a pipeline layout is built: mcore-to-hf / mcore-to-sglang load at TP1/PP1 (Megatron reshards
    # on load, layer numbers in a dist checkpoint are global), so a stage split does not concern them.
    p.add_argument("--first-stage-layers", type=_positive_int, default=None, metavar="N",
                   help="layers on the first pipeline stage (uneven split; parallel.first_stage_layers)")
    p.add_argument("--last-stage-layers", type=_positive_int, default=None, metavar="M",
                   help="layers on the last pipeline stage (uneven split; parallel.last_stage_layers)")


def _add_force(p: argparse.ArgumentParser) -> None:
    p.add_argument("--force", action="store_true", help="replace an output directory that already holds a checkpoint")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description="Convert model weights between HF, Megatron, GGUF, SGLang.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("hf-to-mcore", help="HF checkpoint -> Megatron dist checkpoint")
    p.add_argument("--hf", required=True, metavar="DIR", type=user_path, help="HF checkpoint directory")
    p.add_argument("--out", required=True, metavar="DIR", type=user_path, help="Megatron checkpoint directory to write")
    _add_parallel(p, etp=True)
    _add_stage_split(p)
    p.add_argument("--dtype", type=parse_dtype, default=None, help="parameter dtype (default: as in the HF config)")
    _add_force(p)

    p = sub.add_parser("mcore-to-hf", help="Megatron dist checkpoint -> HF checkpoint")
    p.add_argument("--mcore", required=True, metavar="DIR", type=user_path, help="Megatron checkpoint directory")
    p.add_argument("--out", required=True, metavar="DIR", type=user_path, help="HF checkpoint directory to write")
    p.add_argument("--hf-config", metavar="DIR", type=user_path, default=None, help="HF directory whose config.json/tokenizer to copy")
    _add_force(p)

    p = sub.add_parser("export-lora", help="LoRA adapters of a Megatron checkpoint -> PEFT adapter (or merged HF)")
    p.add_argument("--mcore", required=True, metavar="DIR", type=user_path, help="Megatron dist checkpoint of a LoRA run")
    p.add_argument("--hf", required=True, metavar="DIR", type=user_path, help="the HF base model the run trained on")
    p.add_argument("--out", required=True, metavar="DIR", type=user_path, help="directory to write")
    p.add_argument("--merge", action="store_true", help="write the base with the adapters merged (a HF checkpoint)")
    _add_force(p)

    p = sub.add_parser("gguf-to-hf", help="GGUF file -> HF checkpoint (dequantised)")
    p.add_argument("--gguf", required=True, metavar="FILE|smollm2", type=user_path,
                   help="GGUF file, or 'smollm2' to fetch SmolLM2-135M-Instruct (cached)")
    p.add_argument("--out", required=True, metavar="DIR", type=user_path, help="HF checkpoint directory to write")
    p.add_argument("--dtype", type=parse_dtype, default=None, help="dtype of the written tensors (default float32)")
    _add_force(p)

    p = sub.add_parser("verify", help="check a Megatron checkpoint against its HF source")
    p.add_argument("--hf", required=True, metavar="DIR", type=user_path, help="HF checkpoint directory")
    p.add_argument("--mcore", required=True, metavar="DIR", type=user_path, help="Megatron checkpoint directory")
    _add_parallel(p)
    _add_stage_split(p)
    p.add_argument("--tol", type=float, default=None, help="tolerance for logits (default: the verifier's)")
    p.add_argument("--dtype", type=parse_dtype, default=None,
                   help="Megatron's forward dtype (default: the checkpoint's); float32 on a bf16 checkpoint checks "
                        "the conversion without bf16's arithmetic noise")

    p = sub.add_parser("mcore-to-sglang", help="Megatron checkpoint -> SGLang engine-rank shards")
    p.add_argument("--mcore", required=True, metavar="DIR", type=user_path, help="Megatron checkpoint directory")
    p.add_argument("--engine-tp", required=True, type=_positive_int, help="SGLang tensor-parallel size")
    p.add_argument("--engine-ep", type=_positive_int, default=1, help="SGLang expert-parallel size")
    p.add_argument("--out", required=True, metavar="DIR", type=user_path, help="directory to write")
    _add_force(p)

    p = sub.add_parser("make-fp8", help="write a DeepSeek-V3-release-style FP8 checkpoint (block-scaled)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--hf", metavar="DIR", type=user_path, help="HF checkpoint to quantise")
    src.add_argument("--config", metavar="FILE", type=user_path, help="config.json: random weights for every tensor, MTP included")
    p.add_argument("--out", required=True, metavar="DIR", type=user_path, help="directory to write")
    p.add_argument("--seed", type=int, default=0, help="random weights' seed (with --config)")
    p.add_argument("--block", type=_positive_int, default=128, help="FP8 block size (the release: 128)")
    p.add_argument("--shard-gb", type=float, default=1.0, help="size cap of one safetensors shard, GiB")
    _add_force(p)
    return parser


def _fail(message: str) -> int:
    # One line, no traceback: newlines inside a message would break that promise.
    print(f"{PROG}: error: {' '.join(str(message).split())}", file=sys.stderr)
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from mtrain.run_output import quiet_known_warnings
    quiet_known_warnings(0, on_gpu=False)  # the ranks do the same (mcore_io.rank_error): no library notices
    if getattr(args, "mcore", None):
        from .mcore_io import weights_dir
        args.mcore = str(weights_dir(args.mcore))  # RUN_DIR/checkpoints/step_N as well as .../step_N/mcore
    module_name = f"{__package__ or 'mtrain.converters'}.{SUBCOMMANDS[args.command]}"
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name == module_name:
            return _fail(f"subcommand '{args.command}' is not available: {module_name} is not part of this install")
        return _fail(f"subcommand '{args.command}' needs the Python package '{e.name}', which is not installed")
    run = getattr(module, "run", None)
    if run is None:
        return _fail(f"subcommand '{args.command}' is not available: {module_name} has no run(args)")
    try:
        return int(run(args) or 0)
    except ConvertError as e:
        return _fail(str(e))
    except KeyboardInterrupt:
        _fail("interrupted (outputs are written atomically: nothing half-written was left behind)")
        return 130


if __name__ == "__main__":
    sys.exit(main())
