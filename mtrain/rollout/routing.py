"""Routed experts per token (rollout routing replay, R3): the compact array engines return and trainers replay.

One sample's routing is a tensor `[rows, num_layers, top_k]` of *logical* expert ids: row i is the top-k choice of
every decoder layer for input token i (the prompt's tokens, then the generated ones). The last generated token has
no row (it was never fed forward), so a finished sample of P prompt and R output tokens has P + R - 1 rows: the
shape SGLang 0.5.17 returns (`meta_info["routed_experts"]`, /work/shared/SGLANG-NEXT.md question 1). Dense layers
(DeepSeek-V3's first_k_dense_replace) hold zero rows, as SGLang's zero-initialised buffers do.

Stored small: the dtype is the narrowest that holds every expert id (`routing_dtype`): uint8 up to 256 experts
(DeepSeek-V3, Qwen3-MoE: 8 bytes per token per layer at top-8), int16 up to 32768, int32 above.

The facts (layers, top-k, expert count, which layers are MoE) come from `mtrain.models.hf_config` (one mapping per
architecture), so the engine side and the trainer side agree by construction.
"""
from __future__ import annotations

import base64
from dataclasses import dataclass

import numpy as np
import torch


class RoutingError(ValueError):
    """Routing data that cannot be replayed (wrong layer count, token count or expert id); the message says which."""


def routing_dtype(num_experts: int) -> torch.dtype:
    """The narrowest integer dtype holding ids 0..num_experts-1."""
    if num_experts < 1:
        raise RoutingError(f"num_experts must be >= 1, got {num_experts}")
    if num_experts <= 256:
        return torch.uint8
    if num_experts <= 32768:
        return torch.int16
    return torch.int32


@dataclass(frozen=True)
class RoutingShape:
    """What a routing array of this model looks like."""

    num_layers: int  # decoder layers (HF num_hidden_layers; MTP layers excluded)
    top_k: int
    num_experts: int
    moe_layers: tuple[int, ...]  # 0-based indices of the MoE layers (the others are dense: zero rows)

    @property
    def dtype(self) -> torch.dtype:
        return routing_dtype(self.num_experts)

    @property
    def bytes_per_token(self) -> int:
        """Stored bytes per token (dense layers included, as the engines return them)."""
        return self.num_layers * self.top_k * torch.empty((), dtype=self.dtype).element_size()

    @property
    def sglang_bytes_per_token(self) -> int:
        """What SGLang's int32 payload costs per token before base64 (x4/3 on the wire)."""
        return self.num_layers * self.top_k * 4

    def filler(self) -> torch.Tensor:
        """[num_layers, top_k] routing for a position nobody recorded (a sequence's last token, padding): experts
        0..k-1. Such positions feed no logprob (causal attention: they come after every predicting position of
        their sequence), so the choice only has to be valid."""
        return torch.arange(self.top_k, dtype=self.dtype).expand(self.num_layers, self.top_k).contiguous()

    def check(self, routing: torch.Tensor, rows: int, what: str) -> None:
        """Raise RoutingError unless `routing` is [rows, num_layers, top_k] with ids in range on the MoE layers."""
        if not isinstance(routing, torch.Tensor):
            raise RoutingError(f"{what}: routed experts must be a torch.Tensor, got {type(routing).__name__}")
        if routing.dim() != 3 or routing.shape[1] != self.num_layers or routing.shape[2] != self.top_k:
            raise RoutingError(f"{what}: routed experts have shape {tuple(routing.shape)}; this model needs "
                               f"[tokens, {self.num_layers} layers, top_k {self.top_k}]")
        if routing.shape[0] != rows:
            raise RoutingError(f"{what}: routed experts cover {routing.shape[0]} tokens, expected {rows}")
        if routing.is_floating_point() or routing.dtype == torch.bool:
            raise RoutingError(f"{what}: routed experts must be integers, got {routing.dtype}")
        if rows and self.moe_layers:
            ids = routing[:, list(self.moe_layers)].long()
            lo, hi = int(ids.min()), int(ids.max())
            if lo < 0 or hi >= self.num_experts:
                bad = hi if hi >= self.num_experts else lo
                where = (ids == bad).nonzero()[0].tolist()
                raise RoutingError(f"{what}: expert id {bad} at token {where[0]}, layer "
                                   f"{self.moe_layers[where[1]]} is outside [0, {self.num_experts})")


def routing_shape(hf_config: dict) -> RoutingShape | None:
    """The routing shape of a HF config.json dict; None for a dense model."""
    from mtrain.models.hf_config import map_hf_config

    kw = map_hf_config(hf_config).config_kwargs
    experts = kw.get("num_moe_experts")
    if not experts:
        return None
    n = int(kw["num_layers"])
    freq = kw.get("moe_layer_freq", 1)
    pattern = list(freq) if isinstance(freq, (list, tuple)) else [int(i % int(freq) == 0) for i in range(n)]
    return RoutingShape(num_layers=n, top_k=int(kw["moe_router_topk"]), num_experts=int(experts),
                        moe_layers=tuple(i for i, m in enumerate(pattern) if m))


def decode_sglang(payload: str, shape: RoutingShape, rows: int, what: str) -> torch.Tensor:
    """SGLang's `meta_info["routed_experts"]` (base64 of int32 `[rows, num_layers, top_k]`) -> stored dtype.
    An array or tensor (a path that hands the ids over undecoded) is accepted as it is."""
    if isinstance(payload, (torch.Tensor, np.ndarray)):
        raw = np.asarray(payload.cpu() if isinstance(payload, torch.Tensor) else payload).astype(np.int32).ravel()
    else:
        try:
            raw = np.frombuffer(base64.b64decode(payload, validate=True), dtype=np.int32)
        except (ValueError, TypeError) as e:
            raise RoutingError(f"{what}: routed experts are not base64 int32: {e}") from None
    per = shape.num_layers * shape.top_k
    if raw.size % per:
        raise RoutingError(f"{what}: {raw.size} routed expert ids do not split into rows of {shape.num_layers} "
                           f"layers x top_k {shape.top_k}")
    arr = torch.from_numpy(raw.copy()).view(-1, shape.num_layers, shape.top_k)
    shape.check(arr, rows, what)
    return arr.to(shape.dtype)


def routed_rows(prompt_len: int, output_len: int, start: int = 0) -> int:
    """Rows a request returns: input tokens `start`..prompt + output - 2 (the last generated token is never fed).
    SGLang's rule for `routed_experts_start_len` (SGLANG-NEXT.md question 1), which the reference engine follows."""
    return max(0, prompt_len + output_len - 1 - start)


def held_rows(routing: torch.Tensor | None) -> int:
    """The first position whose routing a caller holding `routing` lacks: what its next request asks from
    (`Request.routed_experts_start`); 0 when it holds none (the engine then sends every row)."""
    return 0 if routing is None else int(routing.shape[0])


def merge_resumed(kept: torch.Tensor | None, new: torch.Tensor | None, rows: int, start: int = 0
                  ) -> torch.Tensor | None:
    """Routing of a sample continued by another request (a partial-rollout resume, a tool trajectory's next turn, an
    agent session's next call): the rows it already had stay as recorded when they were first fed (like their weight
    versions), the new request's rows fill the rest. `new` covers positions start..start + len(new) - 1 (the
    request's `routed_experts_start`, as its Completion says), so it is placed at that offset; a gap between the
    rows held and `start` is an error, never a shift. Returns [rows, L, k]; None when the new request brought none.
    Without kept rows (an engine that returned none for the aborted request) the new rows serve from position 0."""
    if new is None:
        return None
    held = held_rows(kept)
    if start < 0 or start > held:
        raise RoutingError(f"routing from position {start} cannot extend the {held} rows held (positions "
                           f"{held}..{start - 1} would have no routing)")
    if start + new.shape[0] < rows:
        raise RoutingError(f"resumed routing covers {start + new.shape[0]} tokens, the sample has {rows}")
    if kept is None:
        return new[:rows].clone()
    if held >= rows:
        return kept[:rows].clone()
    return torch.cat([kept, new[held - start:rows - start].to(kept.dtype)])


def received_bytes(samples, shape: RoutingShape) -> dict[str, float]:
    """What the engines sent for a step's samples (Completions or Trajectories), in SGLang's int32 payload bytes
    (before base64): per stored routing row (`routing/engine_bytes_per_token`; one payload row per token when every
    request asks only for the rows its caller lacks) and per sample. A Completion's rows received are its
    `routed_rows_received` (a partial-rollout sample's over all its requests) or its own rows; a Trajectory's are
    its `routing_rows_received`."""
    stored = received = 0
    for s in samples:
        rows = held_rows(getattr(s, "routed_experts", None))
        got = getattr(s, "routed_rows_received", None)
        if got is None:
            got = getattr(s, "routing_rows_received", None)
        stored += rows
        received += rows if got is None else int(got)
    if not stored or not samples:
        return {}
    per = shape.sglang_bytes_per_token
    return {"routing/engine_bytes_per_token": received * per / stored,
            "routing/engine_bytes_per_sample": received * per / len(samples)}


def set_disagreement(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[..., k] x [..., k] -> [...] bool: the two expert *sets* differ (the order of the top-k is irrelevant)."""
    return (a.long().sort(-1).values != b.long().sort(-1).values).any(-1)


def batch_routing(shape: RoutingShape, width: int, samples: list[tuple[str, int, torch.Tensor | None, bool]]
                  ) -> torch.Tensor:
    """[B, width, L, k] routing of a padded batch from (rid, tokens, routing or None, trained) per sample. A trained
    sample (it has output tokens) must bring routing of exactly tokens - 1 rows with ids in range: checked for every
    sample before any is used, so bad data fails the step before the trainer starts. Unrecorded positions (each
    sequence's last token, padding, untrained samples) hold `shape.filler()`."""
    out = shape.filler().expand(len(samples), width, shape.num_layers, shape.top_k).clone()
    for i, (rid, n, routed, trained) in enumerate(samples):
        if routed is None:
            if trained:
                raise RoutingError(f"sample {rid!r}: no routed experts recorded; routing replay needs them for every "
                                   f"trained sample (engine started without routing capture?)")
            continue
        shape.check(routed, n - 1, f"sample {rid!r}")
        out[i, :n - 1] = routed.to(shape.dtype)
    return out
