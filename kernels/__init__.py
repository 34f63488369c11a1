"""Resharding kernels (imported as `mtrain.kernels`): execute a planner's piece table.

    execute_pieces(dst, srcs, table, backend="auto")

copies 2-D blocks from flat source tensors into one flat destination (see pieces.py for the row
format). "triton" runs the whole table in one launch; "torch" is the reference (and CPU) executor;
"auto" picks Triton for CUDA tensors when Triton imports, torch otherwise.
"""
from __future__ import annotations

from typing import Sequence

import torch

from .pieces import (CAST_DTYPES, FILL, PieceTable, PieceTableError, execute_pieces_torch,
                     validate)

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
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        use_triton = triton_available() and dst.is_cuda and not _triton_interpreted()
        backend = "triton" if use_triton else "torch"
    if backend == "triton":
        execute_pieces_triton(dst, srcs, table)
    else:
        execute_pieces_torch(dst, srcs, table)


__all__ = ["PieceTable", "PieceTableError", "execute_pieces", "execute_pieces_torch",
           "execute_pieces_triton", "validate", "triton_available", "FILL", "CAST_DTYPES", "BACKENDS"]
