"""Resharding kernels (imported as `mtrain.kernels`): execute a planner's piece table.

    execute_pieces(dst, srcs, table, backend="auto")
    execute_scatter(dsts, srcs, scatter_table, backend="auto", quant={d: BlockFp8(scale, shape)})

copy 2-D blocks from flat source tensors into one flat destination, or into many (a ScatterTable
names each row's destination; see pieces.py for the row format and scatter.py). "triton" runs a
table in one launch (scatter: one per destination dtype); "torch" is the reference (and CPU)
executor; "auto" picks Triton for CUDA tensors when Triton imports, torch otherwise. `quant` writes the
named destinations as DeepSeek-style block FP8 with their scales (fp8.py, docs/fp8.md).
"""
from __future__ import annotations

from typing import Mapping, Sequence

import torch

from .pieces import (CAST_DTYPES, FILL, PieceTable, PieceTableError, execute_pieces_torch,
                     validate)
from .fp8 import BlockFp8, dequantize_blocks, quantize_blocks, scale_shape
from .scatter import ScatterTable, execute_scatter_torch, execute_scatter_triton
from .scatter_fp8 import execute_scatter_fp8

try:  # Triton is optional at import time: the torch executor must work without it.
    from .triton_pieces import execute_pieces_triton, is_interpreted as _triton_interpreted
    _TRITON_IMPORT_ERROR: Exception | None = None
except Exception as exc:  # noqa: BLE001 - any import failure means "no Triton backend"
    _TRITON_IMPORT_ERROR = exc

    def execute_pieces_triton(dst, srcs, table, **kwargs):  # type: ignore[no-redef]
        raise RuntimeError(f"Triton backend unavailable: {_TRITON_IMPORT_ERROR!r}")

    def _triton_interpreted() -> bool:
        return False

BACKENDS = ("auto", "torch", "triton")


def triton_available() -> bool:
    return _TRITON_IMPORT_ERROR is None


def execute_pieces(dst: torch.Tensor, srcs: Sequence[torch.Tensor], table: PieceTable,
                   backend: str = "auto") -> None:
    """Write every piece of `table` into `dst` (see the module docstring for backends)."""
    if _resolve_backend(backend, dst) == "triton":
        execute_pieces_triton(dst, srcs, table)
    else:
        execute_pieces_torch(dst, srcs, table)


def execute_scatter(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor], table: ScatterTable,
                    backend: str = "auto", quant: Mapping[int, BlockFp8] | None = None) -> None:
    """Write every piece of `table` into its own destination `dsts[table.dst_index[i]]`; the same
    result as execute_pieces per destination, with one Triton launch per destination dtype.
    quant={d: BlockFp8(scale, shape)}: destination d is float8_e4m3fn, written block-quantized with
    its scale (fp8.py), from the same pieces, in one more launch."""
    use_triton = _resolve_backend(backend, dsts[0] if len(dsts) else None) == "triton"
    if quant:
        if use_triton and not triton_available():
            raise RuntimeError(f"Triton backend unavailable: {_TRITON_IMPORT_ERROR!r}")
        execute_scatter_fp8(dsts, srcs, table, quant, use_triton)
        return
    if use_triton:
        if not triton_available():
            raise RuntimeError(f"Triton backend unavailable: {_TRITON_IMPORT_ERROR!r}")
        execute_scatter_triton(dsts, srcs, table)
    else:
        execute_scatter_torch(dsts, srcs, table)


def _resolve_backend(backend: str, tensor) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        is_cuda = isinstance(tensor, torch.Tensor) and tensor.is_cuda
        return "triton" if triton_available() and is_cuda and not _triton_interpreted() else "torch"
    return backend


__all__ = ["PieceTable", "PieceTableError", "execute_pieces", "execute_pieces_torch",
           "execute_pieces_triton", "validate", "triton_available", "FILL", "CAST_DTYPES", "BACKENDS",
           "ScatterTable", "execute_scatter", "execute_scatter_torch", "execute_scatter_triton",
           "BlockFp8", "quantize_blocks", "dequantize_blocks", "scale_shape"]
