"""Where each side keeps each weight: which ranks, under which parameter name, as which shard.

`MegatronLayout` knows Megatron's rank order (decoder ranks "tp-cp-dp-pp", expert ranks "etp-ep-edp-pp"),
how pipeline (and virtual pipeline) stages split the layers, and how EP spreads routed experts.
`SGLangLayout` knows SGLang's engine ranks (attention TP, MoE TP x EP), `HFLayout` is one rank holding full
tensors. Each answers `holders(model_layout, weight)` with a `Holder` per rank that keeps a copy.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from mtrain.layouts.rules import LayoutError
from mtrain.layouts.table import ModelLayout, Part, Weight


@dataclass(frozen=True)
class Holder:
    rank: int
    chunk: int  # virtual-pipeline model chunk on that rank (0 without VPP; always 0 for engines)
    part: int  # index of the Part in the weight's side tuple
    name: str
    slot: int | None  # index into a stacked parameter's first dim (SGLang's FusedMoE), else None
    rule_rank: int
    rule_world: int


@dataclass(frozen=True)
class MegatronLayout:
    """A Megatron training layout. etp defaults to tp, as in megatron-core.

    first_stage_layers / last_stage_layers: megatron-core's uneven pipeline split (num_layers_in_first/last_
    pipeline_stage), e.g. DeepSeek-V3's 61 layers on PP16 as 3 | 4 x 14 | 2; the middle stages share the rest.
    """

    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    ep: int = 1
    etp: int | None = None
    cp: int = 1
    dp: int = 1
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None
    side = "megatron"

    @property
    def world(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    @property
    def expert_tp(self) -> int:
        return self.etp or self.tp

    @property
    def uneven(self) -> bool:
        return self.first_stage_layers is not None or self.last_stage_layers is not None

    def check(self, model: ModelLayout) -> None:
        per_stage = self.tp * self.cp * self.dp
        if per_stage % (self.expert_tp * self.ep):
            raise LayoutError(f"tp*cp*dp ({per_stage}) is not divisible by etp*ep ({self.expert_tp}*{self.ep})")
        if model.num_experts and model.num_experts % self.ep:
            raise LayoutError(f"num experts ({model.num_experts}) is not divisible by expert parallel size ({self.ep})")
        if not model.num_experts and self.ep > 1:
            raise LayoutError(f"expert parallel size {self.ep} given for a model without experts")
        self.stage_layers(model.num_layers)

    def stage_layers(self, num_layers: int) -> list[int]:
        """Layers per pipeline stage (per virtual chunk when vpp is set: all chunks are equal)."""
        if not self.uneven:
            chunks = self.pp * (self.vpp or 1)
            if num_layers % chunks:
                raise LayoutError(f"num layers ({num_layers}) is not divisible by pp*vpp ({chunks}); set "
                                  f"first_stage_layers/last_stage_layers for an uneven split")
            return [num_layers // self.pp] * self.pp
        if self.vpp:
            raise LayoutError("an uneven pipeline split with virtual pipeline stages is not supported")
        first, last = self.first_stage_layers, self.last_stage_layers
        middle_stages = self.pp - (first is not None) - (last is not None)
        middle = num_layers - (first or 0) - (last or 0)
        if middle_stages < 0 or middle < 0 or (middle_stages == 0 and middle):
            raise LayoutError(f"first/last pipeline stage layers ({first}/{last}) do not fit {num_layers} layers "
                              f"on pp={self.pp}")
        if middle_stages and middle % middle_stages:
            raise LayoutError(f"the {middle} middle layers do not divide over {middle_stages} middle pipeline "
                              f"stages (num layers {num_layers}, first {first}, last {last}, pp {self.pp})")
        counts = [middle // middle_stages if middle_stages else 0] * self.pp
        if first is not None:
            counts[0] = first
        if last is not None:
            counts[-1] = last
        return counts

    @cached_property
    def coords(self) -> list[dict]:
        """Coordinates of every global rank, as megatron-core's parallel_state assigns them by default."""
        from mtrain.dist import rank_coords
        return [vars(c) for c in rank_coords(self.world, self.tp, self.pp, self.ep, self.etp, self.cp)]

    @cached_property
    def _by_stage(self) -> dict:
        """Ranks per pp stage and per (pp stage, ep rank): placement is asked once per weight, on 512+ ranks."""
        out: dict = {}
        for r, c in enumerate(self.coords):
            out.setdefault(c["pp"], []).append((r, c))
            out.setdefault((c["pp"], c["ep"]), []).append((r, c))
        return out

    def stage_of(self, model: ModelLayout, w: Weight) -> tuple[int, int, int | None]:
        """(pp rank, vpp chunk, layer index inside the chunk) that holds weight w."""
        vpp = self.vpp or 1
        if w.region == "embed":
            return 0, 0, None
        if w.region in ("final", "mtp"):
            return self.pp - 1, vpp - 1, w.layer if w.region == "mtp" else None
        if self.uneven:
            start = 0
            for stage, n in enumerate(self.stage_layers(model.num_layers)):
                if w.layer < start + n:
                    return stage, 0, w.layer - start
                start += n
            raise LayoutError(f"layer {w.layer} is past the last pipeline stage")
        per_chunk = model.num_layers // (self.pp * vpp)
        chunk_global, local = divmod(w.layer, per_chunk)  # chunk_global = vchunk * pp + pp_rank
        vchunk, pp_rank = divmod(chunk_global, self.pp)
        return pp_rank, vchunk, local

    def holders(self, model: ModelLayout, w: Weight) -> list[Holder]:
        pp_rank, chunk, local = self.stage_of(model, w)
        out = []
        for pi, part in enumerate(w.megatron):
            if part.name == "output_layer.weight" and model.tied_embeddings and self.pp == 1:
                continue  # a single stage shares the embedding tensor: no separate head parameter
            if w.expert is not None:
                per = model.num_experts // self.ep
                name = part.name.format(layer=local, expert=w.expert % per)
                for r, c in self._by_stage.get((pp_rank, w.expert // per), []):
                    out.append(Holder(r, chunk, pi, name, None, c["etp"], self.expert_tp))
            else:
                name = part.name.format(layer=local) if local is not None else part.name
                for r, c in self._by_stage.get(pp_rank, []):
                    out.append(Holder(r, chunk, pi, name, None, c["tp"], self.tp))
                if w.key == "embed" and model.mtp_layers and self.pp > 1:
                    # MTP on the last stage needs the embedding: megatron-core keeps a copy there (tied to the
                    # first stage's in its checkpoints), which must be filled too.
                    for r, c in self._by_stage.get(self.pp - 1, []):
                        out.append(Holder(r, (self.vpp or 1) - 1, pi, name, None, c["tp"], self.tp))
        return out


@dataclass(frozen=True)
class SGLangLayout:
    """One SGLang engine: attention TP over `tp` ranks; MoE over ep x (tp // ep) (moe_tp) ranks. fp8: the engine
    runs SGLang's FP8 layout, so weights marked `block_fp8` are float8_e4m3fn + a scale (layouts/fp8.py):
    128x128 blocks (fp8_scaling "block") or one scale per output row (fp8_scaling "channel")."""

    tp: int = 1
    ep: int = 1
    fp8: bool = False
    fp8_scaling: str = "block"  # layouts.fp8.SCALINGS; read only with fp8
    side = "sglang"

    @property
    def world(self) -> int:
        return self.tp

    def check(self, model: ModelLayout) -> None:
        if model.meta.get("sglang_unsupported"):
            raise LayoutError(model.meta["sglang_unsupported"])
        if self.fp8 and model.meta.get("vision"):
            # SGLang quantizes the vision tower's linears too (models/qwen2_5_vl.py:648-657 passes quant_config);
            # the tables mark only the language model's linears block-FP8.
            raise LayoutError("an FP8 engine for a vision-language model is not supported (the vision tower's "
                              "FP8 layout is not in the tables)")
        if self.tp % self.ep:
            raise LayoutError(f"engine tp ({self.tp}) is not divisible by engine ep ({self.ep})")
        if model.num_experts and model.num_experts % self.ep:
            raise LayoutError(f"num experts ({model.num_experts}) is not divisible by engine ep ({self.ep})")

    def holders(self, model: ModelLayout, w: Weight) -> list[Holder]:
        out = []
        moe_tp = self.tp // self.ep
        for pi, part in enumerate(w.sglang):
            for r in range(self.tp):
                if w.expert is not None:
                    per = model.num_experts // self.ep
                    ep_rank, moe_tp_rank = divmod(r, moe_tp)
                    if ep_rank != w.expert // per:
                        continue
                    out.append(Holder(r, 0, pi, part.name, w.expert % per if part.slot else None, moe_tp_rank, moe_tp))
                else:
                    out.append(Holder(r, 0, pi, part.name, None, r, self.tp))
        return out


@dataclass(frozen=True)
class HFLayout:
    """HF checkpoint / the CPU reference engine: one rank, full tensors."""

    side = "hf"
    world = 1

    def check(self, model: ModelLayout) -> None:
        return None

    def holders(self, model: ModelLayout, w: Weight) -> list[Holder]:
        return [Holder(0, 0, pi, p.name, None, 0, 1) for pi, p in enumerate(w.hf)]


def parts_of(layout, w: Weight) -> tuple[Part, ...]:
    return w.parts(layout.side)
