"""make-fp8: write a checkpoint in the DeepSeek-V3 release format (block-scaled FP8), one tensor at a time.

The release stores every linear projection (`*_proj.weight` and attention's `kv_a_proj_with_mqa.weight`:
attention, dense MLP, routed and shared experts) as float8_e4m3fn plus `*.weight_scale_inv` (float32, one scale
per 128x128 block) and everything else (the embedding, the head, norms, the router and its bias, MTP's `eh_proj`)
unquantised; config.json carries
`quantization_config: {quant_method: fp8, fmt: e4m3, weight_block_size: [128, 128]}`. This module writes such
a checkpoint from

- `--hf DIR`: an existing HF checkpoint, quantised (what a trained model would be published as), or
- `--config config.json`: random weights for every tensor the layout table names, MTP layers included
  (transformers' save_pretrained drops them; the release carries them), MTP copies of the embedding/head equal
  to the main ones, as in the release.

It is test tooling for the converters (`hf-to-mcore` reads the result through `fp8.dequantized_view`) and for
the scaled-down DeepSeek-V3 recipe (examples/deepseek_v3/small). Memory: one tensor (and its float32
temporary) plus the writer's current shard.
"""
from __future__ import annotations

import argparse
import json
import os
import zlib
from pathlib import Path
from typing import Callable, Iterator

import torch

from .errors import ConvertError
from .fp8 import SCALE_SUFFIX, _blocks
from .hf_config_file import complete_config_file
from .safetensors_io import HFCheckpoint, ShardedWriter

E4M3_MAX = 448.0  # largest finite float8_e4m3fn


def release_quantizes(name: str, shape: tuple[int, ...]) -> bool:
    """Does the DeepSeek-V3 release store this tensor as block-scaled FP8? Its linear projections only, MTP's
    eh_proj excepted. kv_a_proj_with_mqa is one (F8_E4M3 576 x 7168 with a 5 x 56 scale in the release)."""
    return (len(shape) == 2 and name.endswith(("_proj.weight", "_proj_with_mqa.weight"))
            and not name.endswith("eh_proj.weight"))


def quantize_fp8_blockwise(t: torch.Tensor, block: int | tuple[int, int] = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, float32 scale_inv) with weight * scale_inv[block] ~= t: each block's largest |value|
    maps to 448 (DeepSeek's quantiser). An all-zero block gets scale 1."""
    br, bc = _blocks(block)
    if t.dim() != 2:
        raise ValueError(f"FP8 block quantisation needs a 2-D tensor, got shape {tuple(t.shape)}")
    rows, cols = t.shape
    nr, nc = -(-rows // br), -(-cols // bc)
    x = torch.nn.functional.pad(t.to(torch.float32), (0, nc * bc - cols, 0, nr * br - rows))
    amax = x.view(nr, br, nc, bc).abs().amax(dim=(1, 3))
    # a tensor divisor: CUDA torch computes `t / 448.0` as t * float32(1/448), one ulp off (kernels/fp8.py)
    scale = torch.where(amax > 0, amax / torch.full_like(amax, E4M3_MAX), torch.ones_like(amax))
    s_full = scale.repeat_interleave(br, 0)[:rows].repeat_interleave(bc, 1)[:, :cols]
    q = (t.to(torch.float32) / s_full).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale


def random_tensors(cfg: dict, seed: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Every HF tensor of the model (MTP included) with random values: norms near 1, the router bias small,
    weights N(0, initializer_range). Each tensor's values depend only on (seed, name): the MTP copies of the
    embedding and head are drawn under the original's name, so they are equal to it."""
    from .mcore_io import hf_expected, layout_for, tied_copies
    model = layout_for(cfg, mtp=bool(cfg.get("num_nextn_predict_layers")))
    original = dict(tied_copies(model))
    std = float(cfg.get("initializer_range", 0.02))
    for name, shape in sorted(hf_expected(model).items()):
        g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(original.get(name, name).encode()))
        t = torch.randn(shape, generator=g)
        if len(shape) == 1:
            t = 1.0 + 0.1 * t if not name.endswith("bias") else 0.01 * t
        else:
            t = t * std
        yield name, t


def write_fp8_release(tensors: Iterator[tuple[str, torch.Tensor]], cfg: dict, out: str | os.PathLike, *,
                      block: int | tuple[int, int] = 128, dtype: torch.dtype = torch.bfloat16,
                      max_shard_bytes: int = 1 << 30, overwrite: bool = False,
                      side_files: Path | None = None) -> Path:
    """Quantise what the release quantises, store the rest as `dtype`, publish the directory atomically."""
    from .mcore_io import copy_side_files, dtype_name
    br, bc = _blocks(block)
    writer = ShardedWriter(out, max_shard_bytes=max_shard_bytes, overwrite=overwrite)
    try:
        for name, t in tensors:
            if release_quantizes(name, tuple(t.shape)):
                q, s = quantize_fp8_blockwise(t, (br, bc))
                writer.add(name, q)
                writer.add(name + SCALE_SUFFIX, s)
            else:
                writer.add(name, t.to(torch.float32 if name.endswith("e_score_correction_bias") else dtype))
        if side_files is not None:
            copy_side_files(side_files, writer.path)
        else:  # random weights (--config): no tokenizer files, the tests' and demos' character tokenizer
            from mtrain.tokenizer_files import write_char_tokenizer_marker
            write_char_tokenizer_marker(writer.path, cfg["vocab_size"])
        cfg = dict(cfg, quantization_config={"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                             "weight_block_size": [br, bc]})
        cfg["torch_dtype"] = dtype_name(dtype)
        cfg.pop("dtype", None)
        (writer.path / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        complete_config_file(writer.path / "config.json")
        return writer.commit()
    except BaseException:
        writer.abort()
        raise


def make_fp8(out: str | os.PathLike, *, hf: str | os.PathLike | None = None, config: str | os.PathLike | None = None,
             seed: int = 0, block: int = 128, max_shard_bytes: int = 1 << 30, overwrite: bool = False) -> Path:
    if (hf is None) == (config is None):
        raise ConvertError("give exactly one of --hf (quantise a checkpoint) and --config (random weights)")
    if hf is not None:
        ckpt = HFCheckpoint(hf)
        if any(n.endswith(SCALE_SUFFIX) for n in ckpt.names()):
            raise ConvertError(f"{hf}: already an FP8 block-scaled checkpoint")
        get: Callable[[str], torch.Tensor] = ckpt.get
        tensors = ((n, get(n)) for n in ckpt.names())
        return write_fp8_release(tensors, ckpt.config, out, block=block, max_shard_bytes=max_shard_bytes,
                                 overwrite=overwrite, side_files=Path(hf))
    try:
        cfg = json.loads(Path(config).read_text())
    except (OSError, ValueError) as e:
        raise ConvertError(f"{config}: unreadable config.json: {e}") from e
    return write_fp8_release(random_tensors(cfg, seed), cfg, out, block=block, max_shard_bytes=max_shard_bytes,
                             overwrite=overwrite)


def run(args: argparse.Namespace) -> int:
    out = make_fp8(args.out, hf=args.hf, config=args.config, seed=args.seed, block=args.block,
                   max_shard_bytes=int(args.shard_gb * (1 << 30)), overwrite=args.force)
    print(f"wrote FP8 (block {args.block}) checkpoint {out}")
    return 0
