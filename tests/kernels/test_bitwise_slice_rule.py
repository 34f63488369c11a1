"""The bitwise row-parallel rule, declared once in mtrain/kernels/bitwise_ops.py and read by both the layer that is
built (mtrain/models/bitwise_layers.py) and the launcher's early refusal (mtrain/preflight.py): the rule holds
exactly where the ranks' partial tree sums add up to the single-rank tree sum bit for bit."""
from __future__ import annotations

import torch

from mtrain.kernels.bitwise_ops import row_parallel_slice_problem, tree_sum


def _split_sum(x: torch.Tensor, ranks: int) -> torch.Tensor:
    """What the bitwise row-parallel layer computes: each rank's tree over its slice, then the tree over the ranks."""
    parts = torch.stack([tree_sum(p) for p in x.chunk(ranks, dim=-1)], dim=-1)
    return tree_sum(parts)


def test_the_rule_is_where_split_sums_equal_the_single_rank_sum():
    gen = torch.Generator().manual_seed(0)
    for size, ranks in ((128, 2), (256, 4), (64, 2), (96, 2), (48, 2), (192, 4)):
        x = torch.randn(512, size, generator=gen, dtype=torch.float32) * 1e3
        equal = torch.equal(_split_sum(x, ranks), tree_sum(x))
        problem = row_parallel_slice_problem(size, ranks)
        if problem is None:
            assert equal, (size, ranks)  # allowed: must be bit for bit
        else:
            assert not equal, (size, ranks)  # refused: it would not be
            assert f"{size}/{ranks}={size // ranks} is not one" in problem
    assert row_parallel_slice_problem(96, 1) is None  # one rank is the single-rank tree itself


def test_both_readers_call_the_one_rule():
    import inspect

    import mtrain.models.bitwise_layers as layers
    import mtrain.preflight as preflight
    # both readers call the one rule (neither restates the power-of-two test)
    for module in (layers, preflight):
        source = inspect.getsource(module)
        assert "row_parallel_slice_problem(" in source
        assert "& (local - 1)" not in source
