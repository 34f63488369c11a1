"""execute_scatter with block-FP8 destinations: `quant={dst index: BlockFp8}` quantizes those destinations while
the rest of the table is copied as usual.

Everything is checked before anything is written: the usual per-destination validation (bounds, overlaps, source
reads), the FP8 specs (fp8 weight, float32 scale of the right size), the sources an FP8 destination reads (fp32,
bf16 or fp16), the block plan (every touched block covered whole) and that no written destination or scale shares
bytes with another. Then the plain destinations go through execute_scatter's usual path (one launch per dtype)
and the FP8 ones through one more launch (`triton_fp8`), or the torch executors for backend "torch".
Derived data is cached on the ScatterTable like the rest: the split and block plans per FP8 geometry, the rebased
device tables for the latest pointers.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np
import torch

from .fp8 import SRC_DTYPES, WHOLE, BlockFp8, check_specs, execute_fp8_torch, plan_blocks
from .pieces import PieceTableError, SrcMeta
from .scatter import ScatterTable, _prepare, _structure, _sweep, _validate_sizes

Quant = Mapping[int, BlockFp8]


def _split(st: ScatterTable, quant: Quant):
    """(ScatterTable of the plain rows or None, {d: (blocks, subs, sources read)} for the FP8 destinations)."""
    key = ("fp8", tuple(sorted((d, tuple(q.shape), tuple(q.block)) for d, q in quant.items())))
    cache = st.derived()
    if key not in cache:
        subs = _structure(st)
        plain = np.flatnonzero(~np.isin(st.dst_index, list(quant)))
        plain_st = None
        if plain.size:
            rows = st.table.numpy()[plain]
            plain_st = ScatterTable.from_rows(np.concatenate([rows, st.dst_index[plain, None]], 1))
        plans = {}
        for d, spec in quant.items():
            sub = subs.get(d)
            if sub is None:
                continue
            blocks, parts = plan_blocks(sub.table.numpy(), sub.ids, spec, name=f"dsts[{d}]")
            plans[d] = (blocks, parts, sub.used_srcs)
        cache[key] = (plain_st, plans)
    return cache[key]


def _check_src_dtypes(plans, smeta: list[SrcMeta]) -> None:
    for d, (_, _, used) in plans.items():
        for i in used.tolist():
            if smeta[i].dtype not in SRC_DTYPES:
                raise PieceTableError(f"srcs[{i}] has dtype {smeta[i].dtype}: a block-FP8 destination (dsts[{d}]) "
                                      f"is quantized from {[str(t) for t in SRC_DTYPES]} only")


def _check_disjoint(named: list[tuple[str, torch.Tensor]]) -> None:
    """No two written tensors (destinations, scales) may share bytes: one launch writes them all at once."""
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), n) for n, t in named if t.numel())
    for (a0, a1, an), (b0, _, bn) in zip(spans, spans[1:]):
        if b0 < a1:
            raise PieceTableError(f"{an} and {bn} overlap in memory: two written tensors over the same bytes would race")


def prepare_fp8(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor], st: ScatterTable, quant: Quant):
    """Every check, before any write; returns (plain ScatterTable or None, plans, source metadata)."""
    if not isinstance(st, ScatterTable):
        raise PieceTableError(f"table must be a ScatterTable, got {type(st).__name__}")
    _, smeta = _sweep(dsts, srcs)  # tensors, flat, contiguous, one device: before the specs look at them
    check_specs(dsts, quant)
    subs = _structure(st)
    cache = st.derived()
    sizes = (tuple(d.numel() for d in dsts), tuple(m.numel for m in smeta))
    if ("valid", *sizes) not in cache:  # the same per-destination validation execute_scatter runs
        _validate_sizes(st, subs, *sizes)
        cache[("valid", *sizes)] = True
    plain_st, plans = _split(st, quant)
    _check_src_dtypes(plans, smeta)
    if plain_st is not None:
        _prepare(dsts, srcs, plain_st)
    written = [(f"dsts[{d}]", dsts[d]) for d, sub in subs.items() if sub.writes]
    written += [(f"the scale of dsts[{d}]", quant[d].scale) for d in plans]
    layout = tuple((t.data_ptr(), t.numel() * t.element_size()) for _, t in written)
    if cache.get("fp8_disjoint") != layout:  # the latest pointers only, as execute_scatter does
        _check_disjoint(written)
        cache["fp8_disjoint"] = layout
    return plain_st, plans, smeta


def execute_scatter_fp8(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor], st: ScatterTable, quant: Quant,
                        use_triton: bool) -> None:
    from .scatter import execute_scatter_torch, execute_scatter_triton

    plain_st, plans, smeta = prepare_fp8(dsts, srcs, st, quant)
    if use_triton:
        from . import triton_pieces as tp

        if dsts:
            tp.check_device(dsts[0])
        _launch(dsts, srcs, smeta, st, quant, plans)
        if plain_st is not None:
            execute_scatter_triton(dsts, srcs, plain_st)
        return
    if plain_st is not None:
        execute_scatter_torch(dsts, srcs, plain_st)
    subs = _structure(st)
    for d, (blocks, _, _) in plans.items():
        execute_fp8_torch(dsts[d], quant[d], srcs, subs[d].table, blocks)


def _launch(dsts, srcs, smeta: list[SrcMeta], st: ScatterTable, quant: Quant, plans) -> None:
    from . import triton_fp8 as tf

    if not plans:
        return
    by_block: dict[tuple[int, int], list[int]] = {}
    for d in plans:
        by_block.setdefault(tuple(quant[d].block), []).append(d)
    for i in sorted({i for _, _, used in plans.values() for i in used.tolist()}):
        if smeta[i].data_ptr % smeta[i].dtype.itemsize:  # before any launch
            raise PieceTableError(f"srcs[{i}] data pointer is not aligned to its {smeta[i].dtype.itemsize}-byte "
                                  "elements")
    cache = st.derived()
    for block, members in sorted(by_block.items()):
        used = np.unique(np.concatenate([plans[d][2] for d in members])) if members else np.zeros(0, np.int64)
        layout = (block, tuple(dsts[d].data_ptr() for d in members), tuple(quant[d].scale.data_ptr() for d in members))
        hit = cache.get(("fp8_launch", block))
        if hit is None or hit[0] != layout:
            smaps = [np.searchsorted(used, np.arange(len(smeta))) for _ in members]
            b, s, wa, sa = tf.rebase([plans[d][:2] for d in members], [dsts[d].data_ptr() for d in members],
                                     [quant[d].scale.data_ptr() for d in members], smaps)
            dev = dsts[members[0]].device
            hit = (layout, torch.from_numpy(b).to(dev), torch.from_numpy(s).to(dev), members[wa], members[sa],
                   int(b[:, WHOLE].sum()))
            if dev.type == "cuda":
                torch.cuda.current_stream(dev).synchronize()
            cache[("fp8_launch", block)] = hit
        _, b_dev, s_dev, wa, sa, n_whole = hit
        tf.launch_fp8(dsts[wa], quant[sa].scale, 0, 0, b_dev, s_dev, [srcs[i] for i in used.tolist()],
                      [smeta[i] for i in used.tolist()], block, n_whole=n_whole)

