"""Random piece tables for the kernel tests, plus an independent coverage map.

Tables mix the shapes the planner produces (row-contiguous runs, column blocks of a wider matrix
interleaved row by row, zero fills) with awkward ones (1x1, 3x17, 129x5, row strides larger than
the width, overlapping source reads, a zero source stride that repeats one row).
"""
from __future__ import annotations

import numpy as np
import torch

from mtrain.kernels import PieceTable

ODD_SHAPES = [(1, 1), (3, 17), (129, 5), (2, 64), (7, 1), (1, 300), (16, 24), (5, 129), (33, 8)]


def random_table(rng: np.random.Generator, src_numels: list[int], n_pieces: int,
                 fill_fraction: float = 0.1) -> tuple[PieceTable, int]:
    """Return (table, dst_numel): pieces laid out left to right in dst with random gaps."""
    rows, cursor = [], int(rng.integers(0, 5))
    while len(rows) < n_pieces:
        nr, nc = ODD_SHAPES[rng.integers(len(ODD_SHAPES))]
        src = -1 if rng.random() < fill_fraction else int(rng.integers(len(src_numels)))
        if rng.random() < 0.25 and nr > 1:
            # Two column blocks of one [nr, width] matrix region, interleaved row by row in dst.
            split = int(rng.integers(1, nc + 1))
            width = nc + int(rng.integers(0, 3))
            for c0, cw in ((0, split), (split, width - split)):
                if cw:
                    rows.append(_src_part(rng, src, src_numels, nr, cw) + [cursor + c0, width, nr, cw])
            cursor += nr * width + int(rng.integers(0, 9))
            continue
        ds = nc + (int(rng.integers(0, 7)) if rng.random() < 0.5 else 0)
        rows.append(_src_part(rng, src, src_numels, nr, nc) + [cursor, ds, nr, nc])
        cursor += (nr - 1) * ds + nc + int(rng.integers(0, 9))
    if rng.random() < 0.5:
        rows.append([0, 0, 0, cursor, 0, 0, 5])  # an empty piece, legal and skipped
    order = rng.permutation(len(rows))  # the table order must not matter
    return PieceTable.from_rows([rows[i] for i in order]), cursor + int(rng.integers(0, 5))


def _src_part(rng, src: int, src_numels: list[int], nr: int, nc: int) -> list[int]:
    if src < 0:
        return [-1, 0, 0]
    pick = rng.random()
    ss = 0 if (pick < 0.05 and nr > 1) else nc + int(rng.integers(0, 40)) if pick < 0.5 else nc
    if pick > 0.9 and nc > 2:
        ss = nc - 1  # consecutive rows overlap in the source: allowed, only dst must not overlap
    span = (nr - 1) * ss + nc
    if span > src_numels[src]:  # a small source: re-read one row instead
        ss, span = 0, nc
    return [src, int(rng.integers(0, src_numels[src] - span + 1)), ss]


def coverage(table: PieceTable, dst_numel: int) -> np.ndarray:
    """Which dst elements the table writes, by a plain loop over pieces (independent of the kernels)."""
    covered = np.zeros(dst_numel, bool)
    for _, _, _, do, ds, nr, nc in table.rows.tolist():
        for r in range(nr):
            covered[do + r * ds: do + r * ds + nc] = True
    return covered


def make_sources(rng: np.random.Generator, dtypes: list[torch.dtype], numel: int,
                 device: str = "cpu") -> list[torch.Tensor]:
    """Random finite sources of varying sizes; some are views at odd element offsets of a bigger
    allocation so that source addresses are not 16-byte aligned."""
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    out = []
    for i, dt in enumerate(dtypes):
        n = numel + int(rng.integers(0, 50))
        lead = int(rng.integers(0, 4)) if i % 3 == 1 else 0
        base = torch.randn(n + lead, generator=gen, dtype=torch.float32) * 3
        src = base.to(device=device, dtype=dt)[lead:]
        if i % 4 == 2 and src.numel() % 2 == 0:
            src = src.view(2, -1)  # any contiguous shape is accepted, not only 1-D
        out.append(src)
    return out


class ScatterCase:
    """A random scatter: per destination a random_table over an allowed subset of the sources.
    Destinations are either separate allocations or views at odd element offsets into one shared
    buffer per dtype (the way row ranges of one parameter, or parameters packed in one allocation,
    look to the loader); make_dsts() builds a fresh NaN-poisoned set of them every call."""

    def __init__(self, rng: np.random.Generator, src_numels: list[int], dst_specs: list[tuple],
                 n_pieces: int = 6, device: str = "cpu"):
        """dst_specs: (dtype, "own" | "view", allowed source indices or None for all)."""
        from mtrain.kernels import ScatterTable
        self.specs, self.device, rows, self.sub_tables, self.numels = dst_specs, device, [], [], []
        for d, (_, _, allowed) in enumerate(dst_specs):
            allowed = list(range(len(src_numels))) if allowed is None else list(allowed)
            table, n = random_table(rng, [src_numels[i] for i in allowed], n_pieces)
            sub = table.rows.clone()
            live = sub[:, 0] >= 0
            sub[live, 0] = torch.tensor(allowed)[sub[live, 0]]
            self.sub_tables.append(PieceTable(sub))
            self.numels.append(n)
            rows += [r + [d] for r in sub.tolist()]
        order = rng.permutation(len(rows))  # destinations interleaved: the row order must not matter
        self.table = ScatterTable.from_rows([rows[i] for i in order])
        # Odd element offsets (and gaps) inside the shared buffers, so views are not 16-byte aligned.
        self.offsets, cursor = [], {}
        for d, (dt, where, _) in enumerate(dst_specs):
            if where == "view":
                start = cursor.get(dt, 0) + int(rng.integers(1, 6)) * 2 - 1
                self.offsets.append(start)
                cursor[dt] = start + self.numels[d]
            else:
                self.offsets.append(None)
        self.buffer_numels = {dt: end + 3 for dt, end in cursor.items()}

    def make_dsts(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(dsts, every allocation behind them), all NaN-filled."""
        def nan(n, dt):
            return torch.full((n,), float("nan"), dtype=torch.float32, device=self.device).to(dt)
        buffers = {dt: nan(n, dt) for dt, n in self.buffer_numels.items()}
        dsts = []
        for d, (dt, where, _) in enumerate(self.specs):
            off = self.offsets[d]
            dsts.append(buffers[dt][off:off + self.numels[d]] if where == "view" else nan(self.numels[d], dt))
        own = [t for t, (_, where, _) in zip(dsts, self.specs) if where != "view"]
        return dsts, own + list(buffers.values())

    def coverage(self, allocation_of: list[torch.Tensor], dsts: list[torch.Tensor]) -> list[np.ndarray]:
        """Per allocation, which elements the scatter writes (mapped through the views)."""
        out = []
        for alloc in allocation_of:
            cov = np.zeros(alloc.numel(), bool)
            for d, dst in enumerate(dsts):
                if dst.untyped_storage().data_ptr() == alloc.untyped_storage().data_ptr():
                    off = dst.storage_offset() - alloc.storage_offset()
                    cov[off:off + dst.numel()] |= coverage(self.sub_tables[d], dst.numel())
            out.append(cov)
        return out
