"""Sequence packing: token-budget micro-batches, balanced over data-parallel ranks, packed end to end (THD).

Three pure functions, no model in sight (docs/design-packing.md):
- `balanced_dp_rows(lengths, dp_rank, dp_size)`: which samples of a minibatch this DP rank trains, chosen so that
  every rank gets about the same number of tokens (longest first onto the lightest rank).
- `plan_micro_batches(lengths, budget)`: this rank's samples grouped into as few micro-batches of at most
  `budget` tokens as the same greedy finds, balanced against each other.
- `pack(...)` / `unpack(...)`: one micro-batch's rows laid end to end as a [1, S] stream with `cu_seqlens`, and
  any per-token tensor moved between the row layout [n, W, ...] and the packed layout [S, ...].

Per-token tensors come in two widths (mtrain/rollout/rollout_batch.py): W = T, one value per *input* token (tokens,
per-token weight versions, routed experts for routing replay), and W = T - 1, one value per *predicting*
position (masks, logprobs, advantages: position t predicts token t + 1). Packed, both live at the position of
their token in the stream; a W = T - 1 field has no value at the last token of a sequence (it would predict the
first token of the next one) and holds 0 there. Trailing dims are carried as they are, so a field added later
(e.g. [B, T, layers, top_k] routed experts) packs and unpacks without code here knowing about it.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import torch


class PackingError(ValueError):
    """A batch that cannot be packed under the configured budget; the message names the sample and the key."""


BUDGET_KEY = "train.max_tokens_per_micro_batch"


def _lpt(items: list[tuple[int, int]], bins: int) -> list[list[int]]:
    """Longest-processing-time greedy: items (index, size), sorted largest first, each onto the lightest bin.
    Deterministic (ties go to the lower bin, then the lower index), so every rank computes the same plan."""
    heap = [(0, b) for b in range(bins)]
    out: list[list[int]] = [[] for _ in range(bins)]
    for idx, size in sorted(items, key=lambda x: (-x[1], x[0])):
        load, b = heapq.heappop(heap)
        out[b].append(idx)
        heapq.heappush(heap, (load + size, b))
    return [sorted(b) for b in out]


def balanced_dp_rows(lengths: list[int] | torch.Tensor, dp_rank: int, dp_size: int) -> torch.Tensor:
    """Indices (ascending) of the samples this data-parallel rank trains, token totals balanced over ranks."""
    lengths = [int(x) for x in lengths]
    if len(lengths) < dp_size:
        raise PackingError(f"{len(lengths)} samples cannot give each of {dp_size} data-parallel ranks at least one")
    return torch.tensor(_lpt(list(enumerate(lengths)), dp_size)[dp_rank], dtype=torch.long)


def plan_micro_batches(lengths: list[int] | torch.Tensor, budget: int, count_multiple: int = 1,
                       budget_name: str | None = None) -> list[list[int]]:
    """Group samples (by index into `lengths`) into micro-batches of at most `budget` tokens each.

    Starts from the fewest micro-batches the tokens allow (ceil(total / budget), rounded up to a multiple of
    `count_multiple`: the interleaved (VPP) pipeline schedule wants a multiple of the pipeline size) and adds
    more until the greedy balanced split fits; n micro-batches of one sample always fit. Refuses a sample
    longer than the budget with one error naming it (budget_name: how the budget came about, for that error)."""
    lengths = [int(x) for x in lengths]
    budget_name = budget_name or f"{BUDGET_KEY}={budget}"
    if budget < 1:
        raise PackingError(f"{BUDGET_KEY} must be >= 1, got {budget}")
    if not lengths:
        raise PackingError("no samples to pack")
    for i, n in enumerate(lengths):
        if n > budget:
            raise PackingError(f"sample {i} has {n} tokens, more than {budget_name}: raise the budget "
                               f"(or shorten rollout.max_prompt_len + rollout.max_new_tokens)")
    k = -(-max(1, -(-sum(lengths) // budget)) // count_multiple) * count_multiple
    while True:
        if k > len(lengths):
            if count_multiple == 1:
                k = len(lengths)
            else:
                raise PackingError(f"{len(lengths)} samples cannot fill {k} micro-batches (a multiple of "
                                   f"{count_multiple}, the pipeline size, for the interleaved schedule): give each "
                                   f"data-parallel rank more samples per step")
        bins = _lpt(list(enumerate(lengths)), k)
        if all(sum(lengths[i] for i in b) <= budget for b in bins):
            return bins
        k += count_multiple


@dataclass
class Pack:
    """Where each row of a micro-batch sits in its packed stream."""
    rows: torch.Tensor  # [n] long: indices into the batch the rows came from
    lengths: torch.Tensor  # [n] long: tokens of each row
    offsets: torch.Tensor  # [n] long: first packed position of each row
    total: int  # packed length S, padding segment included
    cu_seqlens: torch.Tensor  # [n + 1 (+1 with a padding segment)] int32, ends at S
    max_seqlen: int
    index_cache: dict = field(default_factory=dict, repr=False, compare=False)  # unpack_index's, per device

    def position_ids(self) -> torch.Tensor:
        """[1, S]: each sequence (and the padding segment) counts from 0."""
        seg = self.cu_seqlens.long()
        starts = torch.repeat_interleave(seg[:-1], seg[1:] - seg[:-1])
        return (torch.arange(self.total) - starts).unsqueeze(0)

    def cp_indices(self, cp: int, rank: int) -> torch.Tensor:
        """Stream positions context-parallel rank `rank` holds: chunks rank and 2cp-1-rank of every segment."""
        cu = self.cu_seqlens.tolist()
        parts = []
        for a, b in zip(cu[:-1], cu[1:]):
            m = (b - a) // (2 * cp)
            parts += [torch.arange(a + rank * m, a + (rank + 1) * m),
                      torch.arange(a + (2 * cp - 1 - rank) * m, a + (2 * cp - rank) * m)]
        return torch.cat(parts)

    def packed_seq_params(self, device, host_cu_seqlens: bool = False, rope_positions: torch.Tensor | None = None):
        """Megatron's PackedSeqParams for this stream. host_cu_seqlens: hand megatron-core the host copy of
        cu_seqlens (only with mtrain's local core attention; TE's attention needs it on the device): its unfused
        THD RoPE reads the sequence lengths with .tolist() for the query and the key of every layer, a device
        sync each (4 per layer with the `freqs.size(0) == cu_seqlens[-1]` test), which a host tensor avoids.
        rope_positions ([S] on the device, with host_cu_seqlens; only where every RoPE of the model is a
        mtrain.models.packed_rope.PerTokenRotaryEmbedding and nothing else reads cu_seqlens_q, Actor.rope_per_token):
        megatron-core gets the single segment [0, S] and the positions, so its THD RoPE takes one slice instead
        of a split, a slice and a cat per sequence in every layer (mtrain/models/packed_rope.py). The attention
        reads the real boundaries from the mtrain_* attributes either way."""
        from megatron.core.packed_seq_params import PackedSeqParams
        dev = self.cu_seqlens.to(device)
        cu = self.cu_seqlens if host_cu_seqlens else dev
        if rope_positions is not None:
            if not host_cu_seqlens:
                raise ValueError("rope_positions needs host_cu_seqlens (mtrain's local attention)")
            cu = torch.tensor([0, self.total], dtype=torch.int32)
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                 max_seqlen_q=self.max_seqlen, max_seqlen_kv=self.max_seqlen)
        # read by mtrain.models.packed_attention on the local path: no device-to-host copy in every layer, and
        # the device copy for the varlen kernel
        params.mtrain_host_cu_seqlens = self.cu_seqlens.tolist()
        params.mtrain_device_cu_seqlens = dev
        if rope_positions is not None:
            params.mtrain_rope_positions = rope_positions.reshape(-1)
        return params


def make_pack(rows: torch.Tensor | list[int], lengths: torch.Tensor | list[int], pad_to_multiple: int = 1,
              min_total: int = 0, seq_multiple: int = 1) -> Pack:
    """Rows laid end to end; the stream is padded at the end to at least `min_total` tokens and to a multiple of
    `pad_to_multiple` (sequence parallelism splits it over TP ranks) with one extra segment of its own, so
    nothing attends across it. seq_multiple > 1 (context parallelism: 2 * cp) pads every sequence's slot to a
    multiple at its end (causal: nothing before the padding sees it)."""
    rows = torch.as_tensor(rows, dtype=torch.long)
    lengths = torch.as_tensor(lengths, dtype=torch.long)
    if rows.shape != lengths.shape or rows.dim() != 1 or rows.numel() == 0:
        raise PackingError(f"rows {tuple(rows.shape)} and lengths {tuple(lengths.shape)} must be equal, non-empty 1-D")
    if bool((lengths < 1).any()):
        raise PackingError(f"every packed sequence needs at least one token, got lengths {lengths.tolist()}")
    slots = -(-lengths // seq_multiple) * seq_multiple
    ends = torch.cumsum(slots, 0)
    used = int(ends[-1])
    total = -(-max(used, min_total) // pad_to_multiple) * pad_to_multiple
    if (total - used) % seq_multiple:
        raise PackingError(f"padding of {total - used} tokens is not a multiple of {seq_multiple}: pad_to_multiple "
                           f"({pad_to_multiple}) must be a multiple of seq_multiple")
    cu = [0] + ends.tolist() + ([total] if total > used else [])
    return Pack(rows=rows, lengths=lengths, offsets=ends - slots, total=total,
                cu_seqlens=torch.tensor(cu, dtype=torch.int32),
                max_seqlen=int(max(slots.max().item(), total - used)))


def _row_positions(pack: Pack, width: int, shift: int, writing: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(row index into the row layout, column, packed position) of every valid element of a width-W field;
    a row holds lengths - shift valid values (shift 1 for per-predicting-position fields). A shared-prefix stream
    (mtrain/trainer/prefix_tree.py TreePack) says where its rows sit itself (writing: who fills a shared prefix)."""
    if hasattr(pack, "row_positions"):
        return pack.row_positions(width, shift, writing)
    counts = (pack.lengths - shift).clamp(min=0).clamp(max=width)
    local = torch.repeat_interleave(torch.arange(len(counts)), counts)
    starts = torch.cumsum(counts, 0) - counts
    col = torch.arange(int(counts.sum())) - torch.repeat_interleave(starts, counts)
    return local, col, pack.offsets[local] + col


def _shift(width: int, seq_width: int, name: str) -> int:
    if width == seq_width:
        return 0
    if width == seq_width - 1:
        return 1
    raise PackingError(f"per-token field {name!r} has width {width}; expected {seq_width} (per input token) or "
                       f"{seq_width - 1} (per predicting position)")


def pack(pack_: Pack, x: torch.Tensor, seq_width: int, name: str = "field") -> torch.Tensor:
    """Row layout [B, W, ...] (indexed by pack_.rows) -> packed [S, ...]; 0 where a row has no value."""
    shift = _shift(x.shape[1], seq_width, name)
    local, col, dst = _row_positions(pack_, x.shape[1], shift, writing=True)
    out = x.new_zeros((pack_.total, *x.shape[2:]))
    out[dst.to(x.device)] = x[pack_.rows[local].to(x.device), col.to(x.device)]
    return out


def unpack_index(pack_: Pack, width: int, seq_width: int, device, name: str = "field") -> tuple:
    """(destination in the flattened row layout, source position in the stream) for `unpack`, on `device`;
    cached on the Pack. The trainer builds them with the micro-batch, so the loss function copies nothing from
    the host (a pageable host-to-device copy waits for the device: one sync per micro-batch otherwise)."""
    shift = _shift(width, seq_width, name)
    key = (width, shift, str(torch.device(device)))
    if key not in pack_.index_cache:
        local, col, src = _row_positions(pack_, width, shift)
        pack_.index_cache[key] = ((local * width + col).to(device), src.to(device))
    return pack_.index_cache[key]


def unpack(pack_: Pack, packed: torch.Tensor, width: int, seq_width: int, name: str = "field") -> torch.Tensor:
    """Packed [S', ...] (S' >= the last valid position, e.g. S - 1 for logprobs) -> row layout [n, W, ...] in the
    order of pack_.rows, 0 past each row's values. A gather: gradients flow back to `packed`."""
    n = len(pack_.lengths)
    flat, src = unpack_index(pack_, width, seq_width, packed.device, name)
    out = packed.new_zeros((n * width, *packed.shape[1:]))
    out = out.index_copy(0, flat, packed.index_select(0, src))
    return out.view(n, width, *packed.shape[1:])


def padded_cp_inputs(tokens: torch.Tensor, cp: int, cp_rank: int, chunk_multiple: int = 1) -> dict:
    """Padded rows [n, T] under context parallelism: each row is padded at its end to a multiple of 2 * cp and
    split like a packed sequence (chunks cp_rank and 2cp-1-cp_rank; megatron-core's RoPE picks the same
    positions for unpacked input). Returns this rank's `tokens` and `position_ids`, the `labels` each of its
    positions predicts (shifted on the whole row before the split), `cp_index` (the row positions of every CP
    rank's values, rank-major, for putting the gathered outputs back in order) and `cp_width` (T).
    chunk_multiple: each chunk's length a multiple of it (sequence parallelism splits a rank's rows over TP)."""
    n, width = tokens.shape
    unit = 2 * cp * chunk_multiple
    padded = -(-width // unit) * unit
    tokens = torch.nn.functional.pad(tokens, (0, padded - width))
    m = padded // (2 * cp)

    def mine(r: int) -> torch.Tensor:
        return torch.cat([torch.arange(r * m, (r + 1) * m), torch.arange((2 * cp - 1 - r) * m, (2 * cp - r) * m)])

    own = mine(cp_rank)
    return {"tokens": tokens[:, own], "labels": torch.nn.functional.pad(tokens[:, 1:], (0, 1))[:, own],
            "position_ids": own.unsqueeze(0).expand(n, -1).contiguous(),
            "cp_index": torch.cat([mine(r) for r in range(cp)]), "cp_width": width}
