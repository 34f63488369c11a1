"""mtrain/trainer/packing.py on its own: plans, the packed layout, and the round trip of any per-token field."""
from __future__ import annotations

import pytest
import torch

from mtrain.trainer.packing import (PackingError, balanced_dp_rows, make_pack, pack, plan_micro_batches, unpack)


def _heavy_tail(n: int, seed: int = 0) -> list[int]:
    """RL-like response lengths: most short, a few near the 900-token cap."""
    g = torch.Generator().manual_seed(seed)
    return [int(x) for x in (8 + (torch.rand(n, generator=g) ** 6) * 900)]


def test_plan_respects_budget_and_covers_every_sample_once():
    lengths = _heavy_tail(200)
    for budget in (910, 1500, 4096):
        plan = plan_micro_batches(lengths, budget)
        flat = sorted(i for mb in plan for i in mb)
        assert flat == list(range(len(lengths)))
        assert all(sum(lengths[i] for i in mb) <= budget for mb in plan)
        # close to the fewest micro-batches the token count allows
        assert len(plan) <= -(-sum(lengths) // budget) + 2, (budget, len(plan))


def test_plan_balances_micro_batches():
    lengths = _heavy_tail(256, seed=1)
    plan = plan_micro_batches(lengths, 4096)
    loads = [sum(lengths[i] for i in mb) for mb in plan]
    assert max(loads) - min(loads) <= max(lengths), loads


def test_sample_longer_than_budget_is_one_clear_error():
    with pytest.raises(PackingError, match=r"sample 2 has 50 tokens, more than train.max_tokens_per_micro_batch=40"):
        plan_micro_batches([10, 20, 50, 5], 40)


def test_dp_split_balances_tokens_and_is_a_partition():
    lengths = _heavy_tail(64, seed=2)
    parts = [balanced_dp_rows(lengths, r, 4) for r in range(4)]
    flat = sorted(torch.cat(parts).tolist())
    assert flat == list(range(64))
    loads = [sum(lengths[i] for i in p.tolist()) for p in parts]
    assert max(loads) - min(loads) <= max(lengths)
    # the plan is the same on every rank (deterministic), and more even than equal counts in order
    assert all(torch.equal(balanced_dp_rows(lengths, r, 4), parts[r]) for r in range(4))
    naive = [sum(lengths[i * 16:(i + 1) * 16]) for i in range(4)]
    assert max(loads) - min(loads) <= max(naive) - min(naive)
    with pytest.raises(PackingError, match="3 samples cannot give each of 4"):
        balanced_dp_rows([1, 2, 3], 0, 4)


def test_pack_layout_cu_seqlens_positions_and_padding_segment():
    p = make_pack([4, 1, 7], [3, 5, 2], pad_to_multiple=4)
    assert p.total == 12 and p.cu_seqlens.tolist() == [0, 3, 8, 10, 12] and p.max_seqlen == 5
    assert p.position_ids()[0].tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 0, 1, 0, 1]
    q = make_pack([0, 1], [3, 5])
    assert q.total == 8 and q.cu_seqlens.tolist() == [0, 3, 8]
    with pytest.raises(PackingError, match="at least one token"):
        make_pack([0, 1], [3, 0])


@pytest.mark.parametrize("trailing", [(), (3,), (2, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.long, torch.bool])
def test_any_per_token_field_round_trips(trailing, dtype):
    """Both widths (per input token T, per predicting position T-1), any trailing dims and dtype: e.g. routed
    experts [B, T, layers, top_k] long, weight versions [B, T-1] long, masks [B, T-1] bool."""
    B, T = 6, 9
    lengths = torch.tensor([9, 2, 5, 1, 7, 3])
    rows = torch.tensor([5, 0, 2, 3])
    p = make_pack(rows, lengths[rows], pad_to_multiple=8)
    for width in (T, T - 1):
        x = (torch.randint(1, 100, (B, width, *trailing)) % 2 == 1) if dtype == torch.bool else \
            torch.randint(1, 100, (B, width, *trailing)).to(dtype)
        packed = pack(p, x, T, "f")
        assert packed.shape == (p.total, *trailing) and packed.dtype == dtype
        back = unpack(p, packed, width, T, "f")
        shift = T - width
        for j, r in enumerate(rows.tolist()):
            n = int(lengths[r]) - shift
            assert torch.equal(back[j, :n], x[r, :n])
            assert not back[j, n:].any()
        # positions of each sequence's last token hold nothing for per-predicting-position fields
        if shift:
            ends = (p.offsets + p.lengths - 1).tolist()
            assert not packed[ends].any()


def test_unpack_is_differentiable():
    p = make_pack([0, 1], [4, 3])
    x = torch.randn(p.total - 1, requires_grad=True)
    rows = unpack(p, x, 5, 6)
    (rows * torch.arange(10.0).view(2, 5)).sum().backward()
    # row 0 holds x[0:3] at columns 0..2, row 1 holds x[4:6] at columns 0..1; x[3] (a boundary) gets no gradient
    assert x.grad.tolist() == [0, 1, 2, 0, 5, 6]


def test_wrong_width_is_named():
    p = make_pack([0], [3])
    with pytest.raises(PackingError, match="'routed_experts' has width 5; expected 9"):
        pack(p, torch.zeros(1, 5), 9, "routed_experts")


def test_plan_count_multiple_for_the_interleaved_schedule():
    lengths = [30, 5, 7, 2, 9, 11, 3]
    plan = plan_micro_batches(lengths, 40, count_multiple=2)
    assert len(plan) % 2 == 0 and all(plan) and sorted(i for mb in plan for i in mb) == list(range(7))
    with pytest.raises(PackingError, match="3 samples cannot fill 4 micro-batches"):
        plan_micro_batches([30, 30, 30], 40, count_multiple=4)


def test_config_budget_must_hold_the_longest_sample_and_frees_micro_batch_size():
    from pathlib import Path

    from mtrain.config import ConfigError, load_config
    yaml = Path(__file__).resolve().parents[2] / "mtrain" / "configs" / "tiny_llama_grpo.yaml"
    # 64 prompt + 8 new tokens: a budget of 71 could meet a sample it cannot hold -> refused at load
    with pytest.raises(ConfigError, match=r"train.max_tokens_per_micro_batch: .* must hold the longest .* = 72"):
        load_config(yaml, ["model.hf_path=x", "train.max_tokens_per_micro_batch=71"])
    # per GPU: with CP the micro-batch holds cp times the budget (72 padded to a multiple of 4 = 72 <= 2 x 36)
    load_config(yaml, ["model.hf_path=x", "train.max_tokens_per_micro_batch=36", "parallel.cp=2"])
    with pytest.raises(ConfigError, match=r"parallel.cp=2 must hold .* = 72 padded to a multiple of 2\*cp, got 35"):
        load_config(yaml, ["model.hf_path=x", "train.max_tokens_per_micro_batch=35", "parallel.cp=2"])
    # packed: train.micro_batch_size no longer has to divide the global batch
    cfg = load_config(yaml, ["model.hf_path=x", "train.max_tokens_per_micro_batch=72", "train.micro_batch_size=5"])
    assert cfg.train.max_tokens_per_micro_batch == 72
    with pytest.raises(ConfigError, match="train.micro_batch_size"):
        load_config(yaml, ["model.hf_path=x", "train.micro_batch_size=5"])


def test_context_parallel_is_accepted_padded_and_packed():
    """CP splits padded rows as well as packed sequences (docs/design-packing.md): neither is refused."""
    from pathlib import Path

    from mtrain.config import load_config
    yaml = Path(__file__).resolve().parents[2] / "mtrain" / "configs" / "tiny_llama_grpo.yaml"
    assert load_config(yaml, ["model.hf_path=x", "parallel.cp=2"]).parallel.cp == 2
    cfg = load_config(yaml, ["model.hf_path=x", "parallel.cp=2", "train.max_tokens_per_micro_batch=80"])
    assert cfg.train.max_tokens_per_micro_batch == 80


def test_padded_cp_inputs_split_rows_like_packed_sequences():
    import torch

    from mtrain.trainer.packing import padded_cp_inputs
    tokens = torch.arange(2 * 7).reshape(2, 7) + 1  # width 7 -> padded to 8, chunks of 2 at cp=2
    parts = [padded_cp_inputs(tokens, 2, r) for r in range(2)]
    assert parts[0]["tokens"].tolist() == [[1, 2, 7, 0], [8, 9, 14, 0]]
    assert parts[1]["tokens"].tolist() == [[3, 4, 5, 6], [10, 11, 12, 13]]
    assert parts[0]["labels"].tolist() == [[2, 3, 0, 0], [9, 10, 0, 0]]
    assert parts[1]["position_ids"].tolist() == [[2, 3, 4, 5]] * 2
    assert parts[0]["cp_index"].tolist() == [0, 1, 6, 7, 2, 3, 4, 5] and parts[0]["cp_width"] == 7
    sp = padded_cp_inputs(tokens, 2, 1, chunk_multiple=2)  # width 7 -> 8: chunks of 2, already a multiple
    assert sp["tokens"].shape == (2, 4)
    assert padded_cp_inputs(tokens[:, :5].repeat(1, 2), 2, 0, chunk_multiple=3)["tokens"].shape == (2, 6)  # 10 -> 12
