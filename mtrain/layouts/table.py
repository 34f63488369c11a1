"""The weight-layout table: one row per logical weight, naming it on every side.

A `Weight` is one logical tensor in a canonical full form: HF's on-disk tensors concatenated along rows
(q;k;v for attention, gate;up for a gated MLP). Each side (Megatron, HF, SGLang) lists the `Part`s that
hold it: a parameter name, which canonical rows it covers, and the rule that shards it. Converters, the
resharding planner, the engines and the tests all read these rows; no other module spells a weight name.

Name templates: HF and SGLang names are concrete (global layer index). Megatron names carry `{layer}` (the
layer's index inside its pipeline chunk) and `{expert}` (the expert's index on its EP rank), resolved by
`mtrain.reshard.placement` because they depend on the training layout.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union

from mtrain.layouts.rules import Fused, GroupedQKV, Replicated, Split, VocabSplit

Rule = Union[Replicated, Split, Fused, GroupedQKV, VocabSplit]
SIDES = ("megatron", "hf", "sglang")


@dataclass(frozen=True)
class Part:
    name: str
    rows: tuple[int, int]
    rule: Rule = Replicated()
    slot: bool = False  # the parameter is [slots, rows, cols]; this weight fills one slot (SGLang's FusedMoE)
    write: bool = True  # False: readable alias that is never written (a tied lm_head read from the embedding)


@dataclass(frozen=True)
class Weight:
    key: str
    shape: tuple[int, ...]
    megatron: tuple[Part, ...]
    hf: tuple[Part, ...]
    sglang: tuple[Part, ...]
    region: str = "decoder"  # "embed" | "decoder" | "final" | "mtp": which pipeline stage holds it
    layer: int | None = None  # global decoder layer (or MTP depth for region "mtp")
    expert: int | None = None  # global routed-expert index
    fp32: bool = False  # kept in float32 on every side whatever the model dtype (DeepSeek's expert bias)
    # A linear layer's weight: block-FP8 checkpoints (DeepSeek-V3's release, Qwen3-*-FP8) and SGLang's FP8 layout
    # store it as float8_e4m3fn + weight_scale_inv. Everything else (embedding, head, norms, biases, routers) stays
    # in the model dtype there (mtrain/layouts/fp8.py, docs/fp8.md).
    block_fp8: bool = False

    @property
    def shape2d(self) -> tuple[int, int]:
        """Rows x the product of the other dims (a conv kernel [out, in, t, h, w] is out x in*t*h*w)."""
        cols = 1
        for s in self.shape[1:]:
            cols *= s
        return (self.shape[0], cols)

    def parts(self, side: str) -> tuple[Part, ...]:
        return getattr(self, side)


@dataclass
class ModelLayout:
    """All logical weights of one model, plus the facts placement needs."""

    arch: str
    weights: list[Weight]
    num_layers: int
    num_experts: int = 0
    mtp_layers: int = 0
    tied_embeddings: bool = False
    vocab_size: int = 0
    meta: dict = field(default_factory=dict)

    def by_key(self) -> dict[str, Weight]:
        return {w.key: w for w in self.weights}

    def total_bytes(self, itemsize: int) -> int:
        n = 0
        for w in self.weights:
            k = 1
            for s in w.shape:
                k *= s
            n += k
        return n * itemsize


def one(name: str, rows: int, rule: Rule = Replicated(), **kw) -> tuple[Part, ...]:
    """A side that holds the weight as a single parameter."""
    return (Part(name, (0, rows), rule, **kw),)


def stacked(names_rows: list[tuple[str, int]], rule: Rule = Replicated()) -> tuple[Part, ...]:
    """A side that holds the canonical rows as several parameters one after another (HF's q/k/v)."""
    parts, start = [], 0
    for name, n in names_rows:
        parts.append(Part(name, (start, start + n), rule))
        start += n
    return tuple(parts)


COL = Split(0, "output features")
ROW = Split(1, "input features")
