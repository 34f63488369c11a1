"""Sharding rules: how one rank's shard of a tensor is cut out of the canonical full tensor.

Every tensor is handled as 2-D (a 1-D norm or bias of n elements is an (n, 1) matrix). A rule answers, for
rank r of a group of `world` ranks, two things: the shard's 2-D shape, and the list of `Rect`s saying which
rectangle of the shard comes from which rectangle of the full tensor. Rows of the shard that no Rect covers
(vocabulary padding) are zeros. Everything the planner, converters and tests do is rectangle arithmetic on
these lists, so a new layout is a new rule here and nothing else.
"""
from __future__ import annotations

from dataclasses import dataclass


class LayoutError(ValueError):
    """A model or parallel setting that a layout cannot take (names the setting)."""


@dataclass(frozen=True)
class Rect:
    """Shard rows/cols [row, row+nrows) x [col, col+ncols) come from full rows/cols starting at (full_row, full_col)."""

    row: int
    col: int
    full_row: int
    full_col: int
    nrows: int
    ncols: int


def _need_divisible(n: int, world: int, what: str) -> int:
    if world <= 0 or n % world:
        raise LayoutError(f"{what} ({n}) is not divisible by the parallel size ({world})")
    return n // world


@dataclass(frozen=True)
class Replicated:
    """Every rank holds the whole tensor (norms, routers, MLA down-projections in SGLang)."""

    def shard(self, full: tuple[int, int], rank: int, world: int):
        return full, [Rect(0, 0, 0, 0, full[0], full[1])]


@dataclass(frozen=True)
class Split:
    """Even contiguous split along `dim`: 0 for column-parallel layers, 1 for row-parallel ones.

    pad > 1: the dimension is first padded with zeros to a multiple of `pad` (SGLang's Qwen2.5-VL vision MLP
    rounds its intermediate size up to a multiple of 8, models/qwen2_5_vl.py:297); shard entries past the
    real size are zeros."""

    dim: int
    what: str = "split dimension"
    pad: int = 1

    def shard(self, full: tuple[int, int], rank: int, world: int):
        size = -(-full[self.dim] // self.pad) * self.pad
        n = _need_divisible(size, world, self.what)
        real = max(0, min(n, full[self.dim] - rank * n))
        if self.dim == 0:
            return (n, full[1]), ([Rect(0, 0, rank * n, 0, real, full[1])] if real else [])
        return (full[0], n), ([Rect(0, 0, 0, rank * n, full[0], real)] if real else [])


@dataclass(frozen=True)
class Block:
    """One part of a fused tensor: `units` units of `unit_rows` rows each (heads of head_dim rows, or rows)."""

    units: int
    unit_rows: int
    what: str
    pad: int = 1  # units padded with zeros to a multiple of this before the split (see Split.pad)
    replicable: bool = True  # fewer units than ranks: replicate them (KV heads) or refuse (vision heads)

    @property
    def padded_units(self) -> int:
        return -(-self.units // self.pad) * self.pad


@dataclass(frozen=True)
class Fused:
    """Rows are parts [b0; b1; ...] (q,k,v or gate,up); rank r holds [b0_r; b1_r; ...].

    A part with fewer units than ranks is replicated: rank r holds unit r // (world // units). This is how
    SGLang's QKVParallelLinear gives each rank one KV head when engine TP exceeds the KV-head count.
    """

    blocks: tuple[Block, ...]

    def shard(self, full: tuple[int, int], rank: int, world: int):
        rects, row, base = [], 0, 0
        for b in self.blocks:
            units = b.padded_units
            if units >= world or not b.replicable:
                per = _need_divisible(units, world, b.what)
                first = rank * per
            else:
                _need_divisible(world, units, f"parallel size vs {b.what}")
                per, first = 1, rank // (world // units)
            real = max(0, min(per, b.units - first))  # units past b.units are padding: zeros
            if real:
                rects.append(Rect(row, 0, base + first * b.unit_rows, 0, real * b.unit_rows, full[1]))
            row += per * b.unit_rows
            base += b.units * b.unit_rows
        if base != full[0]:
            raise LayoutError(f"fused parts add up to {base} rows but the tensor has {full[0]}")
        return (row, full[1]), rects


@dataclass(frozen=True)
class GroupedQKV:
    """Megatron's linear_qkv: for each query group g, [q heads of g; k_g; v_g]; TP splits whole groups.

    The full (canonical) tensor is HF's [q; k; v], so a group's rows come from three places.
    """

    heads: int
    groups: int
    head_dim: int

    def shard(self, full: tuple[int, int], rank: int, world: int):
        per = _need_divisible(self.groups, world, "query groups (num_key_value_heads)")
        if self.heads % self.groups:
            raise LayoutError(f"attention heads ({self.heads}) not divisible by query groups ({self.groups})")
        qpg, d = self.heads // self.groups, self.head_dim
        k_base, v_base = self.heads * d, (self.heads + self.groups) * d
        rects, row = [], 0
        for g in range(rank * per, (rank + 1) * per):
            for start, n in ((g * qpg * d, qpg * d), (k_base + g * d, d), (v_base + g * d, d)):
                rects.append(Rect(row, 0, start, 0, n, full[1]))
                row += n
        return (row, full[1]), rects


@dataclass(frozen=True)
class VocabSplit:
    """Vocabulary rows padded to a multiple, then split evenly; rows past the real vocabulary are zeros.

    Megatron pads to make_vocab_size_divisible_by x TP (`per_rank_multiple=True`), SGLang to 64 whatever
    its TP (`per_rank_multiple=False`).
    """

    multiple: int
    per_rank_multiple: bool

    def padded(self, vocab: int, world: int) -> int:
        m = self.multiple * world if self.per_rank_multiple else self.multiple
        return -(-vocab // m) * m

    def shard(self, full: tuple[int, int], rank: int, world: int):
        padded = self.padded(full[0], world)
        n = _need_divisible(padded, world, "padded vocabulary")
        start, stop = rank * n, min((rank + 1) * n, full[0])
        rects = [Rect(0, 0, start, 0, stop - start, full[1])] if stop > start else []
        return (n, full[1]), rects
