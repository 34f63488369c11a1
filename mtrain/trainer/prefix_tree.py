"""Shared-prefix packed micro-batches (train.shared_prefix, docs/design-shared-prefix.md): the n samples of a group
share their prompt, so a micro-batch holds that prompt once and each sample's continuation after it.

Layout of one group of rows r_1..r_m with a common prefix of P tokens (P = their longest common prefix, at most
every row's length, minus 1: the last shared token stays in each sample, so every predicting position of a
response lies in the sample's own continuation and predicts the next token of the same segment):

    [ tokens[r_1, :P] ][ tokens[r_1, P:L_1] ][ tokens[r_2, P:L_2] ] ... [ tokens[r_m, P:L_m] ]
      positions 0..P-1   positions P..L_1-1    positions P..L_2-1

A row that shares nothing (a group of one, or no common prefix) is an ordinary packed sequence. The attention
(mtrain/models/tree_attention.py) lets each continuation see the prefix and itself, causally; RoPE takes the
positions above (the per-token rotary rows of mtrain/models/packed_rope.py). Per-token fields move between the row
layout and the stream as for ordinary packs (mtrain/trainer/packing.py asks `TreePack.row_positions`): reading,
every row takes its first P values from the shared prefix; writing, the group's first row fills the prefix.

`plan_shared_micro_batches` keeps a group in one micro-batch (split only when it does not fit the token budget),
so each prompt is computed once per micro-batch.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mtrain.trainer.packing import PackingError, plan_micro_batches


def _common_prefix(rows: list[list[int]]) -> int:
    n = min(len(r) for r in rows)
    for j in range(n):
        t = rows[0][j]
        if any(r[j] != t for r in rows[1:]):
            return j
    return n


def group_keys(tokens: torch.Tensor, seq_lens: torch.Tensor, response_lens: torch.Tensor) -> list[tuple]:
    """One key per row: its prompt's tokens (rows of a GRPO group share it)."""
    out = []
    for i in range(tokens.shape[0]):
        p = int(seq_lens[i]) - int(response_lens[i])
        out.append(tuple(tokens[i, :p].tolist()))
    return out


def shared_rows(batch) -> tuple[list[list[int]], list[tuple]]:
    """(each row's tokens, each row's group key) of a RolloutBatch."""
    rows = [batch.tokens[i, :int(batch.seq_lens[i])].tolist() for i in range(batch.size)]
    return rows, group_keys(batch.tokens, batch.seq_lens, batch.response_lens)


def _groups(keys: list, indices: list[int]) -> list[list[int]]:
    by: dict = {}
    for i in indices:
        by.setdefault(keys[i], []).append(i)
    return list(by.values())


def shared_length(token_rows: list[list[int]]) -> int:
    """P of a group: the longest common prefix, at most the shortest row, minus 1; 0 for a single row."""
    if len(token_rows) < 2:
        return 0
    return max(_common_prefix(token_rows) - 1, 0)


def _cost(token_rows: list[list[int]]) -> int:
    p = shared_length(token_rows)
    return p + sum(len(r) - p for r in token_rows)


def plan_shared_micro_batches(token_rows: list[list[int]], keys: list, budget: int, count_multiple: int = 1,
                              budget_name: str | None = None) -> list[list[int]]:
    """Micro-batches (lists of row indices) of at most `budget` stream tokens, a group's rows together: each group
    (rows with the same key) is one unit of its shared size, split into consecutive chunks when larger than the
    budget; the units are then planned as packing.plan_micro_batches plans samples."""
    units: list[list[int]] = []
    for g in _groups(keys, list(range(len(token_rows)))):
        chunk: list[int] = []
        for i in g:
            if chunk and _cost([token_rows[j] for j in chunk + [i]]) > budget:
                units.append(chunk)
                chunk = []
            chunk.append(i)
        units.append(chunk)
    plan = plan_micro_batches([_cost([token_rows[i] for i in u]) for u in units], budget,
                              count_multiple=count_multiple, budget_name=budget_name)
    return [sorted(i for u in b for i in units[u]) for b in plan]


@dataclass
class TreePack:
    """A shared-prefix stream: the Pack interface the trainer uses (rows, lengths, total, cu_seqlens, max_seqlen,
    position_ids, packed_seq_params) plus where each row's tokens sit."""
    rows: torch.Tensor  # [n] long: indices into the batch, in the order of the row layout
    lengths: torch.Tensor  # [n] long
    shared: torch.Tensor  # [n] long: P of the row's group (0: not shared)
    prefix_start: torch.Tensor  # [n] long: stream position of the row's shared prefix (its own start if unshared)
    suffix_start: torch.Tensor  # [n] long: stream position of token P of the row
    owner: torch.Tensor  # [n] bool: the row that writes its group's prefix
    total: int
    segments: list[tuple[int, int, int, int]]  # tree_attention's (q_start, q_len, prefix_start, prefix_len)
    cu_seqlens: torch.Tensor  # int32 segment boundaries (prefixes, continuations, padding)
    max_seqlen: int
    positions: torch.Tensor  # [total] long: each token's position in its own sequence
    index_cache: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def shared_tokens(self) -> int:
        """Tokens the stream saves against packing every row whole."""
        return int(self.lengths.sum()) - int((self.lengths - self.shared).sum() + self.shared[self.owner].sum())

    def position_ids(self) -> torch.Tensor:
        return self.positions.unsqueeze(0)

    def row_positions(self, width: int, shift: int, writing: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(row index into the row layout, column, stream position) of every value of a width-W field (a row holds
        lengths - shift of them); writing: the prefix's values from the group's owner row only."""
        locals_, cols, dsts = [], [], []
        for i in range(len(self.rows)):
            n = max(0, min(int(self.lengths[i]) - shift, width))
            col = torch.arange(n)
            p = int(self.shared[i])
            dst = torch.where(col < p, int(self.prefix_start[i]) + col, int(self.suffix_start[i]) + col - p)
            if writing and not bool(self.owner[i]):
                col, dst = col[p:], dst[p:]
            locals_.append(torch.full((len(col),), i, dtype=torch.long))
            cols.append(col)
            dsts.append(dst)
        return torch.cat(locals_), torch.cat(cols), torch.cat(dsts)

    def packed_seq_params(self, device, host_cu_seqlens: bool = False, rope_positions: torch.Tensor | None = None):
        """Megatron's PackedSeqParams: one RoPE segment [0, S] with per-token positions (the only RoPE path that
        takes arbitrary positions) and the tree for mtrain's local attention."""
        if not host_cu_seqlens or rope_positions is None:
            raise PackingError("train.shared_prefix needs mtrain's local attention with per-token RoPE positions "
                               "(no Transformer Engine attention, parallel.cp=1, plain RoPE or YaRN, no vision model)")
        from megatron.core.packed_seq_params import PackedSeqParams
        cu = torch.tensor([0, self.total], dtype=torch.int32)
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=self.max_seqlen,
                                 max_seqlen_kv=self.max_seqlen)
        params.mtrain_host_cu_seqlens = self.cu_seqlens.tolist()
        params.mtrain_device_cu_seqlens = self.cu_seqlens.to(device)
        params.mtrain_rope_positions = rope_positions.reshape(-1)
        params.mtrain_tree = self.segments
        return params


def make_tree_pack(rows: torch.Tensor | list[int], token_rows: list[list[int]], keys: list,
                   pad_to_multiple: int = 1, min_total: int = 0) -> TreePack:
    """The stream of these rows (token_rows[i]: row i's tokens, its length its own), groups by key in order of
    first appearance; padded at the end like packing.make_pack (one segment of its own)."""
    rows = torch.as_tensor(rows, dtype=torch.long)
    n = len(token_rows)
    if n == 0 or rows.numel() != n or any(len(r) < 1 for r in token_rows):
        raise PackingError(f"a shared-prefix pack needs non-empty rows, got {n} rows for {rows.numel()} indices")
    shared, pstart, sstart = [0] * n, [0] * n, [0] * n
    owner = [False] * n
    segments, positions, pos = [], [], 0
    for g in _groups(keys, list(range(n))):
        p = shared_length([token_rows[i] for i in g])
        if p:
            segments.append((pos, p, 0, 0))
            positions.append(torch.arange(p))
            owner[g[0]] = True
            prefix = pos
            pos += p
        for i in g:
            length = len(token_rows[i])
            shared[i], pstart[i], sstart[i] = p, (prefix if p else pos), pos
            owner[i] = owner[i] or not p
            segments.append((pos, length - p, prefix if p else 0, p))
            positions.append(torch.arange(p, length))
            pos += length - p
    used = pos
    total = -(-max(used, min_total) // pad_to_multiple) * pad_to_multiple
    if total > used:
        segments.append((used, total - used, 0, 0))
        positions.append(torch.arange(total - used))
    cu = [0]
    for q0, qn, _, _ in segments:
        cu.append(q0 + qn)
    lengths = torch.tensor([len(r) for r in token_rows])
    return TreePack(rows=rows, lengths=lengths, shared=torch.tensor(shared), prefix_start=torch.tensor(pstart),
                    suffix_start=torch.tensor(sstart), owner=torch.tensor(owner), total=total, segments=segments,
                    cu_seqlens=torch.tensor(cu, dtype=torch.int32),
                    max_seqlen=int(max(int(lengths.max()), total - used)), positions=torch.cat(positions))
