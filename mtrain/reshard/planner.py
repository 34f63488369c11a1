"""The resharding planner: source shards x destination shards -> a list of 2-D block copies.

For every destination parameter shard on every destination rank, the plan says exactly which rectangle
of which source shard on which source rank fills which rectangle of it, derived from the layout tables
alone (`mtrain.layouts`) and the two placements (`placement.py`). Rows no source covers (vocabulary
padding) get zero-fill pieces. The plan also says which pieces cross processes (src rank's process is not
the one that writes the destination).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from mtrain.layouts.fp8 import check_block_split, check_channel_split, fp8_param
from mtrain.layouts.rules import LayoutError, Rect
from mtrain.layouts.table import ModelLayout, Weight
from mtrain.reshard.placement import Holder, parts_of


@dataclass(frozen=True)
class TensorRef:
    """One parameter on one rank. `shape` is the parameter's real shape (3-D for slotted ones)."""

    rank: int
    chunk: int
    name: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Piece:
    src: TensorRef | None  # None: fill zeros
    src_slot: int | None
    dst: TensorRef
    dst_slot: int | None
    src_row: int
    src_col: int
    dst_row: int
    dst_col: int
    nrows: int
    ncols: int
    weight: str

    @property
    def numel(self) -> int:
        return self.nrows * self.ncols


@dataclass
class Plan:
    pieces: list[Piece]
    dst_tensors: dict[tuple[int, int, str], TensorRef]
    src_tensors: dict[tuple[int, int, str], TensorRef]
    owner: dict[int, int] = field(default_factory=dict)  # dst rank -> process (training rank) that writes it
    fp32: set = field(default_factory=set)  # destination keys that stay float32 whatever the sync dtype
    # destination keys written as block FP8 (an FP8 engine), with their scale parameter (layouts/fp8.py)
    quant: dict = field(default_factory=dict)

    def remote(self, piece: Piece) -> bool:
        return piece.src is not None and self.owner.get(piece.dst.rank, piece.dst.rank) != piece.src.rank


def _tensor_shape(shard2d: tuple[int, int], weight: Weight, slots: int | None) -> tuple[int, ...]:
    if len(weight.shape) > 2:  # a conv kernel: only ever held whole (its rows x the rest, replicated)
        if shard2d != weight.shape2d:
            raise LayoutError(f"{weight.key}: a {len(weight.shape)}-D weight can only be replicated, not split")
        return tuple(weight.shape)
    base = (shard2d[0],) if len(weight.shape) == 1 else shard2d
    return (slots,) + tuple(base) if slots is not None else tuple(base)


def _shard(w: Weight, layout, h: Holder):
    part = parts_of(layout, w)[h.part]
    rows = part.rows[1] - part.rows[0]
    try:
        shape, rects = part.rule.shard((rows, w.shape2d[1]), h.rule_rank, h.rule_world)
    except LayoutError as e:
        raise LayoutError(f"{w.key} on the {layout.side} side: {e}") from None
    # Move rects from part coordinates into the weight's canonical coordinates.
    rects = [Rect(r.row, r.col, r.full_row + part.rows[0], r.full_col, r.nrows, r.ncols) for r in rects]
    return part, shape, rects


def _intersect(a: Rect, b: Rect):
    r0, r1 = max(a.full_row, b.full_row), min(a.full_row + a.nrows, b.full_row + b.nrows)
    c0, c1 = max(a.full_col, b.full_col), min(a.full_col + a.ncols, b.full_col + b.ncols)
    if r0 >= r1 or c0 >= c1:
        return None
    return r0, c0, r1 - r0, c1 - c0


def _slots(model: ModelLayout, layout, w: Weight) -> int | None:
    """How many experts share a slotted destination parameter (SGLang's w13/w2) on one rank."""
    return model.num_experts // layout.ep if w.expert is not None else None


def build_plan(model: ModelLayout, src_layout, dst_layout, *, colocate=None, only_writable: bool = True) -> Plan:
    """Plan every copy from `src_layout` shards into `dst_layout` shards.

    colocate(dst_rank) -> the source rank that lives with it (same GPU/process), preferred among replicas and
    used as the writer of that destination; default: dst rank r is on source rank r.
    """
    src_layout.check(model)
    dst_layout.check(model)
    colocate = colocate or (lambda r: r)
    pieces: list[Piece] = []
    dst_tensors: dict = {}
    src_tensors: dict = {}
    owner: dict[int, int] = {}
    fp32: set = set()
    quant: dict = {}
    fp8 = getattr(dst_layout, "fp8", False)
    scaling = getattr(dst_layout, "fp8_scaling", "block")
    for w in model.weights:
        dst_holders = dst_layout.holders(model, w)
        if only_writable:
            dst_holders = [h for h in dst_holders if parts_of(dst_layout, w)[h.part].write]
        if not dst_holders:
            continue
        src_holders = src_layout.holders(model, w)
        if not src_holders:
            raise LayoutError(f"weight {w.key}: the {dst_layout.side} side needs it but the {src_layout.side} side "
                              f"has no tensor for it")
        # Group source replicas: same part and same shard position hold the same bytes.
        groups: dict[tuple, list[Holder]] = defaultdict(list)
        for h in src_holders:
            _, shape, rects = _shard(w, src_layout, h)
            groups[(h.part, shape, tuple(rects))].append(h)
        src_shards = [(hs, shape, list(rects)) for (_, shape, rects), hs in groups.items()]
        src_slots = _slots(model, src_layout, w) if getattr(src_layout, "side", "") == "sglang" else None
        dst_slots = _slots(model, dst_layout, w) if dst_layout.side == "sglang" else None
        for dh in dst_holders:
            part, dshape, drects = _shard(w, dst_layout, dh)
            slots = dst_slots if part.slot else None
            dref = TensorRef(dh.rank, dh.chunk, dh.name, _tensor_shape(dshape, w, slots))
            key = (dh.rank, dh.chunk, dh.name)
            if dst_tensors.setdefault(key, dref) != dref:
                raise LayoutError(f"{dh.name} on rank {dh.rank}: two table rows disagree on its shape")
            owner.setdefault(dh.rank, colocate(dh.rank))
            if w.fp32:
                fp32.add(key)
            if fp8 and w.block_fp8:
                if scaling == "channel":
                    check_channel_split(w, part)
                else:
                    check_block_split(w, part, dshape, dh.rule_world)
                quant[key] = fp8_param(dh.name, dref.shape, scaling=scaling)
            for dr in drects:
                for hs, sshape, srects in src_shards:
                    for sr in srects:
                        hit = _intersect(dr, sr)
                        if hit is None:
                            continue
                        fr, fc, nr, nc = hit
                        # Prefer the replica on the destination's own device; else spread destinations over
                        # replicas by where they live, so engines do not all pull from the same training rank.
                        home = colocate(dh.rank)
                        pick = next((h for h in hs if h.rank == home), hs[home % len(hs)])
                        spart = parts_of(src_layout, w)[pick.part]
                        sslots = src_slots if spart.slot else None
                        sref = TensorRef(pick.rank, pick.chunk, pick.name, _tensor_shape(sshape, w, sslots))
                        src_tensors.setdefault((pick.rank, pick.chunk, pick.name), sref)
                        pieces.append(Piece(sref, pick.slot, dref, dh.slot,
                                            sr.row + fr - sr.full_row, sr.col + fc - sr.full_col,
                                            dr.row + fr - dr.full_row, dr.col + fc - dr.full_col, nr, nc, w.key))
            for row, col, nr, nc in _padding(drects, dshape, w.key):  # vocabulary / padded-MLP zeros
                pieces.append(Piece(None, None, dref, dh.slot, 0, 0, row, col, nr, nc, w.key))
    _check_coverage(pieces, dst_tensors)
    return Plan(pieces, dst_tensors, src_tensors, owner, fp32, quant)


def _padding(rects: list[Rect], shape: tuple[int, int], key: str) -> list[tuple[int, int, int, int]]:
    """(row, col, nrows, ncols) of the parts of a shard no rect covers: padding rows between or after full-width
    rects (padded vocabularies, SGLang's padded vision MLP [gate_r; up_r]) or padding columns beside full-height
    ones (its row-parallel down_proj)."""
    rows, cols = shape
    if all(r.col == 0 and r.ncols == cols for r in rects):
        spans, axis = sorted((r.row, r.row + r.nrows) for r in rects), 0
    elif all(r.row == 0 and r.nrows == rows for r in rects):
        spans, axis = sorted((r.col, r.col + r.ncols) for r in rects), 1
    else:
        raise LayoutError(f"{key}: a shard's rectangles are neither full rows nor full columns")
    gaps, at = [], 0
    for a, b in spans + [(shape[axis], shape[axis])]:
        if a > at:
            gaps.append((at, 0, a - at, cols) if axis == 0 else (0, at, rows, a - at))
        at = max(at, b)
    return gaps


def _check_coverage(pieces: list[Piece], dst_tensors: dict) -> None:
    """Every destination element is written exactly once: a table or rule bug must not go unnoticed."""
    written: dict = defaultdict(int)
    for p in pieces:
        written[(p.dst.rank, p.dst.chunk, p.dst.name)] += p.numel
    for key, ref in dst_tensors.items():
        n = 1
        for s in ref.shape:
            n *= s
        if written[key] != n:
            raise LayoutError(f"plan writes {written[key]} of {n} elements of {ref.name} on rank {ref.rank}: "
                              f"the layout table does not cover this tensor exactly")


def resolve_fp8_scaling(model: ModelLayout, requested: str, tp: int = 1, ep: int = 1) -> str:
    """engine.fp8_scaling as a run resolves it for an engine of `tp` x `ep`: "block" or "channel" as asked; "auto":
    block where every FP8 weight's per-rank shard meets SGLang's block rules (layouts/fp8.check_block_split), else
    channel, which has no such rule but holds no MoE experts: a MoE model that fits no block keeps the block error.
    Raises LayoutError."""
    if requested != "auto":
        return requested
    from mtrain.reshard.placement import SGLangLayout

    layout = SGLangLayout(tp=tp, ep=ep, fp8=True)
    layout.check(model)
    try:
        for w in model.weights:
            if not w.block_fp8:
                continue
            for h in layout.holders(model, w):
                part, dshape, _ = _shard(w, layout, h)
                check_block_split(w, part, dshape, h.rule_world)
    except LayoutError as err:
        if model.num_experts:
            raise LayoutError(f"{err} (engine.fp8_scaling=auto falls back to per-channel FP8 only for dense models: "
                              "SGLang quantizes a bf16 model's MoE experts per expert)") from None
        return "channel"
    return "block"
