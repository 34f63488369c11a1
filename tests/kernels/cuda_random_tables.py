"""Compiled Triton (CUDA) == torch executor on the same random tables the interpreter tests use.

Run by test_kernels_cuda.py in a subprocess with TRITON_INTERPRET=0 (the test suite's conftest
turns the interpreter on for everything else). Exits non-zero and names the case on a mismatch."""
from __future__ import annotations

import sys

import numpy as np
import torch

from kernel_tables import coverage, make_sources, random_table
from mtrain.kernels import execute_pieces, execute_pieces_torch
from mtrain.kernels.triton_pieces import execute_pieces_triton, is_interpreted

CASES = [(torch.bfloat16, [torch.bfloat16] * 3), (torch.float32, [torch.float32] * 2),
         (torch.bfloat16, [torch.float32] * 2), (torch.float32, [torch.bfloat16] * 2),
         (torch.bfloat16, [torch.float32, torch.bfloat16, torch.float16]),
         (torch.float16, [torch.float32, torch.bfloat16])]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def main() -> int:
    assert not is_interpreted() and torch.cuda.is_available()
    failures = []
    for seed in range(4):
        for dst_dt, src_dts in CASES:
            for block in (256, 8192):
                rng = np.random.default_rng(seed)
                srcs = make_sources(rng, src_dts, 3000, device="cuda")
                table, n = random_table(rng, [s.numel() for s in srcs], n_pieces=40)
                want = torch.full((n,), float("nan"), device="cuda").to(dst_dt)
                got, auto = want.clone(), want.clone()
                execute_pieces_torch(want, srcs, table)
                execute_pieces_triton(got, srcs, table, block=block)
                execute_pieces(auto, srcs, table)
                covered = torch.from_numpy(coverage(table, n)).cuda()
                ok = (torch.equal(bits(got), bits(want)) and torch.equal(bits(auto), bits(want))
                      and not got[covered].isnan().any() and bool(got[~covered].isnan().all()))
                if not ok:
                    failures.append(f"seed={seed} dst={dst_dt} srcs={src_dts} block={block}")
    print("\n".join(failures) or "all cases equal")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
