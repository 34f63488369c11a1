"""`mtrain-convert gguf-to-hf`: a GGUF file, or the name `smollm2` for the cached SmolLM2-135M-Instruct GGUF.

Apart from gguf_to_hf.py because the `smollm2` name needs smollm2.py, which itself converts through gguf_to_hf.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from .gguf_to_hf import gguf_to_hf
from .smollm2 import fetch_smollm2_gguf


def run(args: argparse.Namespace) -> int:
    """CLI entry: `mtrain-convert gguf-to-hf --gguf FILE|smollm2 --out DIR [--dtype] [--force]`."""
    gguf = args.gguf
    if gguf == "smollm2" and not Path(gguf).exists():
        gguf = fetch_smollm2_gguf()
    dtype = args.dtype or torch.float32
    out = gguf_to_hf(gguf, args.out, dtype=dtype, overwrite=args.force)
    print(f"wrote {out}")
    return 0
